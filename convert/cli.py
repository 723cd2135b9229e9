"""`convert-dsv4`: the command line, every command of it. `convert-dsv4 IN OUT --target xpu`
converts; the other commands plan, check, smoke-test, synthesise and batch-convert.

Each command's body imports the library code it drives when it runs (start-up time: the
model needs torch and Triton, the hub client its network stack, and a conversion neither).
Options that several commands share are defined once below, with one name, default and help.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from dsv4 import __version__
from dsv4.convert import interrupts
from dsv4.convert.exit_codes import INTERNAL_ERROR, exit_code
from dsv4.convert.sizes import shard_size
from dsv4.mapping.table import installed_targets, table_headers
from dsv4.model.errors import DSV4Error, OutOfMemoryError
from dsv4.model.memory import refuse_unless_torch_fits
from dsv4.model.parity import MIN_TOP1, SMOKE_TOKENS
from dsv4.model.presets import PRESETS, VARIANTS

if TYPE_CHECKING:
    from dsv4.convert.plan import Plan

F = TypeVar("F", bound=Callable[..., Any])
JSON_DIGITS = 6  # significant digits of a float in --json output


class _Commands(click.Group):
    """`convert-dsv4 IN OUT ...` means `convert-dsv4 convert IN OUT ...`, unless IN is
    neither an existing path nor a hub id (no `/`) and looks like a mistyped command."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            first = args[0]
            close = difflib.get_close_matches(first, self.commands, n=1)
            if close and "/" not in first and not os.path.lexists(first):
                ctx.fail(f"No such command {first!r}. Did you mean {close[0]!r}?")
            args = ["convert", *args]
        return super().parse_args(ctx, args)


def _version_message() -> str:
    """`--version`: the tool's version and, per target, the runtime its layouts are those of."""
    runtimes = {}
    for head in table_headers().values():
        runtimes.setdefault(head.target, set()).add(head.runtime)
    return (
        "%(prog)s %(version)s ("
        + "; ".join(f"target {t}: {', '.join(sorted(r))}" for t, r in sorted(runtimes.items()))
        + ")"
    )


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="convert-dsv4", message=_version_message())
def cli() -> None:
    """Convert a native DeepSeek V4 checkpoint's draft layers: into a standalone draft
    directory vLLM and SGLang serve (--target draft), or vLLM's XPU draft layout (--target xpu).

    \b
      convert-dsv4 IN OUT --target draft   the draft directory runtimes serve (IN: directory, or hub repo [hf://]org/name[@rev])
      convert-dsv4 IN OUT --target xpu     vLLM's XPU in-memory layout (bundled model, check)
      convert-dsv4 plan IN --target xpu    show what a conversion would read and write
      convert-dsv4 check OUT               verify a converted checkpoint (for CI)
      convert-dsv4 smoke OUT               load it into the bundled model and run a forward
      convert-dsv4 synth OUT --preset tiny write a synthetic native checkpoint
      convert-dsv4 batch MANIFEST          convert many hub repositories
      convert-dsv4 targets                 the installed targets and their tables
    """


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
    default="xpu",
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


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e7 else f"{n:,} B"


@cli.command("convert")
@click.argument("source")
@click.argument("out", type=click.Path(file_okay=False))
@target_option
@click.option(
    "--reverse",
    is_flag=True,
    help="SOURCE is a converted checkpoint: write the draft's tensors back under native names.",
)
@click.option(
    "--overwrite", is_flag=True, help="Replace OUT if it is a previous output of this tool (anything else is refused)."
)
@click.option(
    "--wait", is_flag=True, help="If another run holds OUT, wait for it to finish instead of exiting with code 47."
)
@click.option(
    "--max-shard-size",
    type=ShardSize(),
    default="5GB",
    show_default=True,
    help="Largest output shard: bytes, or with a unit (K, M, G, T = 1000^n; KiB, MiB, GiB, TiB = 1024^n).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Check SOURCE and OUT as the run would (the same refusals and exit codes), print the plan as `plan` "
    'does and what would become of OUT (--json: `plan --json` plus "output" and "would"), and stop; '
    "nothing is written.",
)
@revision_option
@token_option
@click.option(
    "--verify-source",
    is_flag=True,
    help="Hub source: download each shard the output uses whole, once, and check it against the sha256 and size the "
    "hub publishes (README: what is checked without it).",
)
@quiet_option
@json_option
def convert_command(
    source: str,
    out: str,
    target: str,
    reverse: bool,
    overwrite: bool,
    wait: bool,
    max_shard_size: int,
    dry_run: bool,
    revision: str | None,
    token: str | None,
    verify_source: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Convert SOURCE (a native checkpoint directory, or hub repo [hf://]org/name[@revision]) into OUT.

    Reads only the byte ranges the plan needs, writes shards header-first with bounded
    memory in a hidden partial directory, and resumes there if interrupted. OUT appears
    only when complete and verified; rerunning on an up-to-date OUT does nothing.
    """
    from dsv4.convert.location import locate
    from dsv4.convert.pipeline import convert  # start-up time (see the module's docstring)
    from dsv4.convert.pipeline import dry_run as preview

    # the hub options are checked against SOURCE here; without them convert() locates it
    where = (
        locate(source, revision=revision, token=token, verify_files=verify_source)
        if revision or token or verify_source
        else source
    )
    if dry_run:
        plan, would, header_bytes = preview(
            where, out, target=target, reverse=reverse, overwrite=overwrite, max_shard_size=max_shard_size
        )
        if as_json:
            echo_json(plan.to_json() | {"header_bytes_read": header_bytes, "output": out, "would": would})
            return
        _print_plan(plan, False, quiet, full=True, header_bytes=header_bytes)
        click.echo(f"dry run: {out} {DRY_RUN_OUTCOMES[would]}; nothing was written")
        return
    result = convert(
        where,
        out,
        target=target,
        reverse=reverse,
        overwrite=overwrite,
        wait=wait,
        max_shard_size=max_shard_size,
        quiet=quiet or as_json,
    )
    if as_json:
        echo_json(result.to_json())
    elif result.status == "up-to-date":
        click.echo(
            f"{out}: already up to date (same source, table {result.plan.table} v{result.plan.table_version}); "
            "nothing to do"
        )
    else:
        click.echo(
            f"{result.status} {result.tensors} tensors into {out}: read {_gb(result.bytes_read)}, wrote "
            f"{_gb(result.bytes_written)} in {result.seconds:.1f} s"
        )


DRY_RUN_OUTCOMES = {
    "up-to-date": "is already up to date: the run would do nothing",
    "create": "would be created",
    "replace": "would be replaced (--overwrite)",
}


@cli.command("plan")
@click.argument("source")
@target_option
@click.option("--reverse", is_flag=True, help="Plan the reverse conversion of a converted checkpoint.")
@revision_option
@token_option
@quiet_option
@click.option(
    "--json", "as_json", is_flag=True, help="The whole plan (every tensor and byte range, every skip) as JSON."
)
def plan_command(
    source: str, target: str, reverse: bool, revision: str | None, token: str | None, quiet: bool, as_json: bool
) -> None:
    """Show what converting SOURCE would read and write. Reads headers only."""
    from dsv4.convert.location import locate, open_source  # start-up time (see the module's docstring)
    from dsv4.convert.pipeline import plan_source

    with open_source(locate(source, revision=revision, token=token), quiet=quiet or as_json) as opened:
        plan = plan_source(opened, target, reverse=reverse)
    _print_plan(plan, as_json, quiet, full=True, header_bytes=opened.inventory.header_bytes)


# how `plan` names the layout it chose (convert/plan.py choose_table)
DRAFTER_NAMES = {
    "mtp": "MTP (no dspark_* fields in config.json)",
    "dspark": "DSpark (dspark_* fields and mtp.0.main_proj.weight)",
}


def _print_plan(plan: Plan, as_json: bool, quiet: bool, *, full: bool, header_bytes: int | None = None) -> None:
    if as_json:
        data = plan.to_json() if full else plan.summary()
        if header_bytes is not None:
            data["header_bytes_read"] = header_bytes
        echo_json(data)
        return
    s = plan.summary()
    click.echo(
        f"{s['direction']} plan: {s['source']} -> {s['target']} (table {s['table']} v{s['table_version']})"
        + (f": {s['tensors_out']} tensors, {_gb(s['bytes_to_read'])} to read" if quiet else "")
    )
    if quiet:
        return
    click.echo(f"  draft layout:         {DRAFTER_NAMES[s['drafter']]}: {s['runtime']} {s['runtime_class']}")
    click.echo(f"  tensors out:          {s['tensors_out']}")
    click.echo(f"  source keys consumed: {s['source_keys_consumed']}")
    click.echo(f"  source keys skipped:  {s['source_keys_skipped']}")
    click.echo(
        f"  bytes to read:        {_gb(s['bytes_to_read'])} from {len(s['files_to_read'])} file(s): "
        f"{', '.join(s['files_to_read'])}"
    )
    click.echo(f"  bytes to write:       {_gb(s['bytes_to_write'])}")
    if header_bytes is not None:
        click.echo(f"  header bytes read:    {header_bytes:,} (no tensor data)")
    click.echo("  ops:  " + ", ".join(f"{op} x{n}" for op, n in s["ops"].items()))
    for reason, n in s["skip_reasons"].items():
        click.echo(f"  skip x{n}: {reason}")


@cli.command("check")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@native_option
@click.option("--smoke", is_flag=True, help="Load strictly into the bundled model and run a few-token forward.")
@click.option(
    "--fast", is_flag=True, help="Skip hashing the tensor data against conversion.json (says so in the report)."
)
@device_option
@click.option(
    "--junit",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the report as JUnit XML to this file (its folder is created), one test case per check.",
)
@click.option(
    "--serve-with",
    type=click.Path(exists=True, path_type=Path),
    help="A draft directory: the target model (its directory or config.json) it is to be served beside; fails when "
    "vLLM would build the draft's layers differently (another quantisation, another architecture).",
)
@quiet_option
@json_option
def check_command(
    directory: Path,
    native: Path | None,
    smoke: bool,
    fast: bool,
    device: str | None,
    junit: Path | None,
    serve_with: Path | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Verify converted checkpoint DIRECTORY; exit with the first failed check's code.

    --native implies --smoke.

    \b
    exit codes: 71 index/headers  72 unreadable tensor  73 sizes  74 checksum
                75 config vs tensors  76 missing  77 unexpected  78 shape  79 dtype
                80 quantisation scheme  81 empty quantisation name (vLLM #44817)
                84 smoke  85 native parity  86 --serve-with: the target builds the draft otherwise
                42 the --junit file could not be written (after the report is printed)
    """
    refuse_unless_torch_fits("check")
    from dsv4.convert.check import run_checks  # start-up time
    from dsv4.convert.report import write_junit
    from dsv4.model.checkpoint import refuse_full_native

    refuse_full_native(directory, "check")
    report = run_checks(
        directory, native=native, smoke=smoke, fast=fast, device=device, serve_with=serve_with, quiet=quiet or as_json
    )
    if as_json:
        echo_json(report.to_json())
    else:
        if not quiet:
            for r in report.results:
                code = f" [{r.exit_code}]" if r.status == "fail" else ""
                click.echo(f"  {r.status.upper():4} {r.name:9} {r.reason}{code}")
        click.echo(report.summary())
    if junit is not None:  # after the report: a JUnit file that cannot be written loses nothing else
        write_junit(report, junit)
    report.raise_for_failure()  # main() exits with the failed check's code


@cli.command("smoke")
@click.argument("out", type=click.Path(exists=True, file_okay=False, path_type=Path))
@device_option
@click.option(
    "--tokens",
    type=click.IntRange(min=1),
    default=SMOKE_TOKENS,
    show_default=True,
    help="Tokens in the draft step (DSpark: context tokens of random target features).",
)
@native_option
@click.option(
    "--min-top1",
    type=click.FloatRange(0, 1),
    default=MIN_TOP1,
    show_default=True,
    help="With --native: fail when top-1 agreement with the reference is lower (a disagreement on a near-tie, within "
    "1% of max|logit| in the reference, counts as agreeing; DSpark: each draft position given the reference's "
    "previous token). `check --native` applies the same rule.",
)
@click.option(
    "--features",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="DSpark: a safetensors file of target features h_<l> [T_ctx, H] for each of dspark_target_layer_ids "
    "(default: random, seeded).",
)
@click.option(
    "--anchor",
    type=click.IntRange(min=0),
    help="DSpark: the anchor token (the last accepted one; default: random, seeded).",
)
@click.option(
    "--position",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="DSpark: the position of the context's first token.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@quiet_option
@json_option
def smoke_command(
    out: Path,
    device: str | None,
    tokens: int,
    native: Path | None,
    min_top1: float,
    features: Path | None,
    anchor: int | None,
    position: int,
    seed: int,
    quiet: bool,
    as_json: bool,
) -> None:
    """Load converted checkpoint OUT into the bundled draft model and run one draft step
    (MTP: one step on TOKENS tokens; DSpark: one block drafted from a context)."""
    refuse_unless_torch_fits("smoke")
    from dsv4.convert import progress
    from dsv4.convert.inmemory import model_loader
    from dsv4.model.checkpoint import refuse_full_native
    from dsv4.model.errors import LoadError
    from dsv4.model.loader import converted_config  # start-up time: torch and the kernels
    from dsv4.model.parity import parity_verdict
    from dsv4.model.smoke import run_dspark_smoke, run_smoke

    dspark = converted_config(out).is_dspark
    progress.step(
        f"smoke: loading {out} into the bundled model and drafting"
        + (" (then the reference on the native checkpoint)" if native is not None else ""),
        quiet or as_json,
    )
    refuse_full_native(out, "smoke")  # a draft directory in native names is fine; a whole native checkpoint is not
    load = model_loader(out)  # a draft directory (native names): the xpu plan, in memory
    if not dspark and (features is not None or anchor is not None or position):
        raise click.UsageError("--features, --anchor and --position are for a DSpark checkpoint; OUT is an MTP one")
    if dspark:
        try:
            report = run_dspark_smoke(out, device, tokens, features, anchor, position, native, seed, load=load)
        except ValueError as exc:  # an anchor outside the vocabulary
            raise click.UsageError(str(exc)) from None
    else:
        report = run_smoke(out, device, tokens, native, seed, load=load)
    verdict = parity_verdict(report, min_top1) if native is not None else None  # the rule of `check --native`
    if as_json:
        echo_json(report)
    else:
        _print_smoke(report, native, quiet)
    if verdict is not None and not verdict[0]:
        raise LoadError(
            f"{out}: differs from the reference on {native}: {verdict[1]}", kind="smoke_output", path=str(out)
        )


def _print_smoke(report: dict[str, Any], native: Path | None, quiet: bool) -> None:
    click.echo(f"smoke: {report['checkpoint']} on {report['device']}, fused norms: {report['kernels']}")
    dspark = report.get("layout") == "dspark"
    if dspark:
        click.echo(
            f"  draft tokens {report['draft_tokens']} (anchor {report['anchor']}, block positions "
            f"{report['block_positions'][0]}..{report['block_positions'][-1]})"
        )
    if not quiet:
        if dspark:
            click.echo(
                f"  load {report['load_ms']:.0f} ms; stages {report['hidden_first_ms']:.1f} ms first, "
                f"{report['hidden_warm_ms']:.1f} ms warm; "
                f"heads and sampler {report['logits_first_ms']:.1f} / {report['logits_warm_ms']:.1f} ms"
            )
        else:
            click.echo(
                f"  load {report['load_ms']:.0f} ms; forward {report['forward_first_ms']:.1f} ms first, "
                f"{report['forward_warm_ms']:.1f} ms warm; "
                f"logits {report['logits_first_ms']:.1f} / {report['logits_warm_ms']:.1f} ms"
            )
        click.echo(f"  hidden {report['hidden_shape']}, logits {report['logits_shape']}, all finite")
    if native is None:
        return
    diffs = (
        f"  vs reference {native}: hidden max|diff| {report['hidden_max_abs_diff']:.4g} (max|h| "
        f"{report['hidden_max_abs']:.4g}), "
        f"logits max|diff| {report['logits_max_abs_diff']:.4g} (max {report['logits_max_abs']:.4g}), "
    )
    if dspark:
        diffs += (
            f"reference draft tokens {report['reference_draft_tokens']}, "
            f"agreement {report['draft_token_agreement']:.3f} "
            f"(equal up to position {report['draft_tokens_agree_to']}), "
        )
    click.echo(
        diffs + f"top-1 agreement {report['top1_agreement']:.3f} "
        f"({report['top1_agreement_up_to_ties']:.3f} counting near-ties)"
    )
    for d in report["routing_disagreements"]:
        kind = "a near-tie" if d["near_tie"] else "NOT a near-tie"
        click.echo(
            f"  routing differs at MoE call {d['call']}, token {d['token']}: margin {d['margin']:.4g}, tolerance "
            f"{d['tolerance']:.4g} ({kind})"
        )


def _main_layers_arg(ctx: click.Context, param: click.Parameter, value: str) -> int | str:
    if value == "all":
        return value
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter("expected a number of layers or 'all'") from None


@cli.command("synth")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--preset",
    type=click.Choice(sorted(PRESETS)),
    help="Released config to replicate (default tiny; with --variant dspark: flash, i.e. V4-Flash-0731).",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="A config.json to use instead of a preset.",
)
@click.option("--variant", type=click.Choice(VARIANTS), default="instruct", show_default=True)
@click.option(
    "--main-layers",
    default="0",
    callback=_main_layers_arg,
    show_default=True,
    help="Main decoder layers to write: K or 'all'.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic tensor data.")
@click.option("--sparse", is_flag=True, help="Headers only; tensor data are file holes (read back as zeros).")
@quiet_option
@json_option
def synth_command(
    out: Path,
    preset: str | None,
    config_path: Path | None,
    variant: str,
    main_layers: int | str,
    seed: int,
    sparse: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Write a synthetic native DeepSeek V4 checkpoint to OUT."""
    refuse_unless_torch_fits("synth")
    from dsv4.convert.synth import synthesize  # start-up time: torch

    if preset and config_path:
        raise click.UsageError("--preset and --config are alternatives; give one")
    try:
        summary = synthesize(
            out,
            preset=preset,
            config_path=config_path,
            variant=variant,
            main_layers=main_layers,
            seed=seed,
            sparse=sparse,
            quiet=quiet or as_json,
        )
    except ValueError as exc:  # a preset or layer count the synthesiser does not have
        raise click.UsageError(str(exc)) from exc
    if as_json:
        echo_json(summary)
    else:
        holes = " (sparse)" if sparse else ""
        size = summary["bytes"]
        click.echo(
            f"synth: {summary['tensors']} tensors in {summary['files']} files, {size:,} bytes ({size / 1e9:.1f} GB) "
            f"logical{holes} -> {out}"
        )


@cli.command("batch")
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--out-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Root of the local outputs (default: the manifest's output.dir).",
)
@click.option(
    "--push",
    "push_to_hub",
    is_flag=True,
    help="Upload each output to the manifest's output.repo (HF_TOKEN or `hf auth login` with write access).",
)
@click.option(
    "--num-shards",
    type=click.IntRange(min=1),
    help="Split the manifest into N shards [env DSV4_NUM_SHARDS; default: SLURM_ARRAY_TASK_COUNT, else 1].",
)
@click.option(
    "--shard-index",
    type=click.IntRange(min=0),
    help="This run's shard, 0..N-1 [default: the Slurm array task's place in its array, or JOB_COMPLETION_INDEX].",
)
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="JSON report [default: OUT_DIR/batch-report[-K-of-N].json].",
)
@quiet_option
@json_option
def batch_command(
    manifest: Path,
    out_dir: Path | None,
    push_to_hub: bool,
    num_shards: int | None,
    shard_index: int | None,
    report_path: Path | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Convert every source repo of MANIFEST (TOML) that is not already converted.

    A source is skipped, without reading any of its files, when its output (with --push: its
    target repo) already records the source's current commit and the table's version. A
    failing repo is reported and the others go on; the exit code is non-zero if any failed.
    """
    from dsv4.convert.batch import (
        default_report_path,
        load_manifest,
        run_batch,
        shard_from_env,
    )  # start-up time: the hub client
    from dsv4.convert.errors import HubError

    try:
        n, k = shard_from_env(num_shards, shard_index)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    m = load_manifest(manifest, out_dir)
    path = report_path or default_report_path(m, n, k)
    report = run_batch(
        m,
        push_to_hub=push_to_hub,
        num_shards=n,
        shard_index=k,
        report_path=path,
        echo=None if quiet or as_json else click.echo,
    )
    counts = {key: len(report[key]) for key in ("planned", "converted", "skipped", "failed")}
    if as_json:
        echo_json(report)
    else:
        done = (
            f"{counts['converted']} converted, {counts['skipped']} skipped, "
            f"{counts['failed']} failed of {counts['planned']}"
        )
        click.echo(
            f"shard {k}/{n}: {done}; {report['bytes_fetched']:,} bytes fetched in {report['seconds']:.1f} s; report "
            f"{path}"
        )
    if counts["failed"]:
        raise HubError(
            f"{manifest}: {counts['failed']} of {counts['planned']} repositories failed; reasons in {path}",
            kind="batch_failed",
            path=str(path),
        )


@cli.command("targets")
@quiet_option
@json_option
def targets_command(quiet: bool, as_json: bool) -> None:
    """List the installed targets (--target) and their tables: the drafter each maps, its
    version, and the runtime and runtime class whose layout it writes."""
    rows = [
        {
            "target": h.target,
            "table": name,
            "drafter": h.drafter,
            "table_version": h.version,
            "runtime": h.runtime,
            "runtime_class": h.runtime_class,
        }
        for name, h in sorted(table_headers().items(), key=lambda item: (item[1].target, item[0]))
    ]
    if as_json:
        echo_json(rows)
        return
    for r in rows:
        click.echo(
            f"{r['target']:8} {r['table']:12} drafter {r['drafter']:7} v{r['table_version']:4} {r['runtime']} "
            f"({r['runtime_class']})"
        )


# Developers set DSV4_TRACEBACK=1 to see the traceback the last-resort handler hides.
TRACEBACK_ENV = "DSV4_TRACEBACK"


def _one_line(exc: BaseException, at_most: int = 300) -> str:
    """The first line of an exception we did not write, cut short: it may be any size."""
    lines = str(exc).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= at_most else line[: at_most - 3] + "..."


def _escape_newlines(text: str) -> str:
    """One line whatever a message quotes (a tensor name in a hostile header may hold a newline)."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _os_error(exc: OSError) -> str:
    """An OSError no part of the tool classified: the path(s) and the OS's reason."""
    paths = ": ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    reason = exc.strerror or _one_line(exc) or type(exc).__name__
    return f"error: {paths}: {reason}" if paths else f"error: {reason}"


class _NoticeFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return _escape_newlines(f"{record.levelname.lower()}: {record.getMessage()}")


def _log_to_stderr() -> None:
    """The library's notices (logging, logger "dsv4") as the command's own output: one
    line each on stderr, `warning: ...`, never a Python warning with a source path."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_NoticeFormatter())
    # every command that runs the model says in its result which path computed the fused
    # norms ("fused norms: torch fallback (...)"): the kernels' notice would repeat it
    handler.addFilter(lambda record: record.name != "dsv4.model.kernels")
    logger = logging.getLogger("dsv4")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main() -> None:
    """The entry point: every outcome is an exit code and at most one line on stderr.

    The tool's own errors carry their documented code; click's usage errors exit 2; Ctrl-C
    exits 130 and SIGTERM 143, with the one line `interrupted` whenever the signal lands
    (convert/interrupts.py). Anything else is a bug or an unclassified OS error: one line
    and exit 1, never a traceback (unless DSV4_TRACEBACK=1)."""
    # numpy is no dependency of this tool; torch warns at import when it is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    _log_to_stderr()
    interrupts.install()
    try:
        _run_command()
    except (click.exceptions.Abort, KeyboardInterrupt, interrupts.Interrupted) as exc:  # click turns Ctrl-C into Abort
        interrupts.exit_interrupted(exc)
    if interrupts.received() is not None:  # a signal the command swallowed (in a __del__): it still ends interrupted
        interrupts.exit_interrupted()


def _run_command() -> None:
    """The command, its errors turned into their line and code (SystemExit); an interruption,
    or an error a signal caused, is raised as Interrupted for main()."""
    with interrupts.running():  # errors are printed inside: a signal then still ends as `interrupted`
        try:
            cli(prog_name="convert-dsv4", standalone_mode=False)
        except DSV4Error as exc:
            interrupts.raise_if_interrupted()  # the error is what a signal left behind
            click.echo(f"error: {_escape_newlines(str(exc))}", err=True)
            sys.exit(exit_code(exc))
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.UsageError as exc:  # one line like every other error, not click's usage block
            if isinstance(
                exc, getattr(click.exceptions, "NoArgsIsHelpError", ())
            ):  # click >= 8.2: no arguments means help
                exc.show()
                sys.exit(exc.exit_code)
            hint = f" (see: {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
            click.echo(f"error: {_escape_newlines(exc.format_message())}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:  # click's form of a KeyboardInterrupt: main() ends it as interrupted
            raise
        except MemoryError:  # an allocation failed: the memory limit, not a bug
            click.echo("error: not enough memory: an allocation failed; raise the memory limit", err=True)
            sys.exit(exit_code(OutOfMemoryError("", kind="out_of_memory")))
        except BrokenPipeError:  # stdout closed early (`... --json | head`): nothing left to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
            sys.exit(1)
        except Exception as exc:
            interrupts.raise_if_interrupted()
            if os.environ.get(TRACEBACK_ENV) == "1":
                raise
            if isinstance(exc, OSError):
                click.echo(_os_error(exc), err=True)
            else:
                click.echo(
                    f"internal error: {type(exc).__name__}: {_one_line(exc)} (please report this bug with the command "
                    f"that caused it; {TRACEBACK_ENV}=1 shows the traceback)",
                    err=True,
                )
            sys.exit(INTERNAL_ERROR)
