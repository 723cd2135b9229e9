"""What several commands of the command line (convert/cli/main.py) share: the option types,
the options defined once (one name, default and help each) and the JSON output."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dsv4.convert.sizes import shard_size
from dsv4.mapping.targets import default_target, installed_targets, serving_targets
from dsv4.model.memory import refuse_unless_torch_fits

if TYPE_CHECKING:
    from dsv4.convert.serving import Serving

# --draft-format's choices: auto, then the routes (convert/schemes/base.py ROUTES; not imported
# at start-up, tests/convert/test_serve_cli.py holds the two equal)
DRAFT_FORMATS = ("auto", "native", "overlay", "bf16", "match-target")
JSON_DIGITS = 6  # significant digits of a float in --json output


class ShardSize(click.ParamType):
    """A shard size such as 5GB or 2GiB, checked by the rule batch manifests use too."""

    name = "size"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return shard_size(value)  # type: ignore[arg-type]  # shard_size refuses other types itself
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class Device(click.ParamType):
    """`auto` (xpu, else cuda, else cpu: torch.accelerator's choice), or a torch device that
    exists on this machine: cpu, cuda, cuda:1, xpu, ..."""

    name = "device"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str | None:
        if value is None or value == "auto":
            return None
        refuse_unless_torch_fits(f"--device {value}")
        import torch  # only commands that run the model take a device, and they import torch anyway

        try:
            device = torch.device(str(value))
        except (RuntimeError, ValueError):
            self.fail(f"{value!r} is not a device (auto, cpu, cuda, cuda:1, xpu, ...)", param, ctx)
        if device.type == "cpu":
            return str(value)
        backend = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, ...
        if not (hasattr(backend, "is_available") and backend.is_available()):
            self.fail(f"{value!r}: this machine has no {device.type} device", param, ctx)
        if device.index is not None and device.index >= backend.device_count():
            self.fail(f"{value!r}: this machine has {backend.device_count()} {device.type} device(s)", param, ctx)
        return str(value)


# --- options shared by several commands: one name, default and help each ---------------------
# A target is chosen by name from those installed, never by path (click lists the names).
# The target's table for the checkpoint's drafter (MTP or DSpark) is the plan's choice.
target_option = click.option(
    "--target",
    type=click.Choice(installed_targets()),
    default=default_target(),
    show_default=True,
    help="Runtime layout: its table for the checkpoint's drafter (MTP: mapping/xpu.toml, DSpark: "
    "mapping/xpu_dspark.toml) is chosen from config.json and the tensors.",
)
native_option = click.option(
    "--native",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="The NATIVE checkpoint the output was converted from: compare with an independent reference run on it.",
)
device_option = click.option(
    "--device",
    type=Device(),
    default="auto",
    show_default=True,
    help="Device for the model: auto (xpu, else cuda, else cpu), cpu, cuda, cuda:1, xpu, ...",
)
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print the result as JSON (floats rounded to 6 significant digits)."
)
quiet_option = click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="No progress output (bars, notices, per-item lines); the result is still printed.",
)
# the hub options of the `hf` CLI, same names and meaning
revision_option = click.option(
    "--revision",
    help="Hub source: the branch, tag or commit to read (same as SOURCE@REVISION; giving both, they must agree).",
)
token_option = click.option(
    "--token", help="Hub source: the access token (default: HF_TOKEN, else the `hf auth login` one). Never printed."
)


# --serve-with and its two options, on `convert` and `plan` (convert/serving.py)
def serve_options(command: Callable[..., Any]) -> Callable[..., Any]:
    command = click.option(
        "--allow-lossy",
        is_flag=True,
        help="With --serve-with: allow a route that requantises the draft with rounding (the error is recorded).",
    )(command)
    command = click.option(
        "--draft-format",
        type=click.Choice(DRAFT_FORMATS),
        help="With --serve-with: how the draft is made to serve beside TARGET (default auto: the exact route the "
        "target's quantisation allows; docs/serving.md says what each costs and guarantees).",
    )(command)
    return click.option(
        "--serve-with",
        metavar="TARGET",
        help="--target draft: write the draft that serves beside TARGET, the target model (a directory, its "
        "config.json, or a hub repo [hf://]org/name[@revision], of which only config.json is read), with its launch "
        "commands in OUT/serve/.",
    )(command)


def serving_request(
    target: str, serve_with: str | None, draft_format: str | None, allow_lossy: bool, reverse: bool
) -> Serving | None:
    """The serving target the options name, read (its refusals before OUT is touched); None
    without --serve-with. The options apply to a forward --target draft conversion only."""
    if serve_with is None:
        if draft_format is not None or allow_lossy:
            raise click.UsageError("--draft-format and --allow-lossy choose how a draft serves: they need --serve-with")
        return None
    if target not in serving_targets() or reverse:
        raise click.UsageError(
            f"--serve-with makes a draft directory to serve beside a target: it takes --target "
            f"{' or '.join(serving_targets())} without --reverse"
        )
    from dsv4.convert.serving import Serving  # start-up time
    from dsv4.convert.serving_target import read_serving_target

    return Serving(read_serving_target(serve_with), draft_format or "auto", allow_lossy)


def _rounded(value: Any) -> Any:
    """`value` with every float rounded to JSON_DIGITS significant digits (a timing in ms
    or a max|diff| means nothing past that)."""
    if isinstance(value, float):
        return float(f"{value:.{JSON_DIGITS}g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def echo_json(data: Any) -> None:
    click.echo(json.dumps(_rounded(data), indent=2))


def gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e7 else f"{n:,} B"
