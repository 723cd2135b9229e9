"""`convert-dsv4`: the command line. `convert-dsv4 IN OUT --target xpu` converts; the other
subcommands plan, check, smoke-test, synthesise and batch-convert."""

from __future__ import annotations

import importlib
import json
import os
import sys
import warnings
from typing import TYPE_CHECKING

import click

from dsv4 import __version__
from dsv4.convert.errors import DSV4Error
from dsv4.convert.sizes import shard_size
from dsv4.mapping.table import installed_targets

if TYPE_CHECKING:
    from dsv4.convert.plan import Plan

# Subcommands that live beside the code they drive, imported only when invoked: the model
# (Triton) and the hub client (huggingface_hub) cost start-up time a conversion need not pay.
LAZY_COMMANDS = {
    "check": "dsv4.convert.check:check_command",
    "smoke": "dsv4.model.smoke:smoke_command",
    "synth": "dsv4.convert.synth:synth_command",
    "batch": "dsv4.convert.batch:batch_command",
}


class _Commands(click.Group):
    """`convert-dsv4 IN OUT ...` means `convert-dsv4 convert IN OUT ...`; the subcommands
    of LAZY_COMMANDS are imported when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in LAZY_COMMANDS and name not in self.commands:
            module, attr = LAZY_COMMANDS[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.list_commands(ctx):
            args = ["convert", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="convert-dsv4")
def cli() -> None:
    """Convert a native DeepSeek V4 checkpoint's MTP draft layer into vLLM's XPU MTP layout.

    \b
      convert-dsv4 IN OUT --target xpu     convert (IN: directory or hub repo org/name[@rev])
      convert-dsv4 plan IN --target xpu    show what a conversion would read and write
      convert-dsv4 check OUT               verify a converted checkpoint (for CI)
      convert-dsv4 smoke OUT               load it into the bundled model and run a forward
      convert-dsv4 synth OUT --preset tiny write a synthetic native checkpoint
      convert-dsv4 batch MANIFEST          convert many hub repositories
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
    """A torch device that exists on this machine: cpu, cuda, cuda:1, xpu, ..."""

    name = "device"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str:
        import torch  # only commands that run the model take a device, and they import torch anyway

        try:
            device = torch.device(str(value))
        except (RuntimeError, ValueError):
            self.fail(f"{value!r} is not a device (cpu, cuda, cuda:1, xpu, ...)", param, ctx)
        if device.type == "cpu":
            return str(value)
        backend = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, ...
        if not (hasattr(backend, "is_available") and backend.is_available()):
            self.fail(f"{value!r}: this machine has no {device.type} device", param, ctx)
        if device.index is not None and device.index >= backend.device_count():
            self.fail(f"{value!r}: this machine has {backend.device_count()} {device.type} device(s)", param, ctx)
        return str(value)


# A table is chosen by name from those installed, never by path (click lists the names).
# The target's table for the checkpoint's drafter (MTP or DSpark) is the plan's choice.
target_option = click.option("--target", type=click.Choice(installed_targets()), default="xpu", show_default=True, help="Runtime layout: its table for the checkpoint's drafter (MTP: mapping/xpu.toml, DSpark: mapping/xpu_dspark.toml) is chosen from config.json and the tensors.")


@cli.command("convert")
@click.argument("source")
@click.argument("out", type=click.Path(file_okay=False))
@target_option
@click.option("--reverse", is_flag=True, help="SOURCE is a converted checkpoint: write the draft's tensors back under native names.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it is a previous output of this tool (anything else is refused).")
@click.option("--wait", is_flag=True, help="If another run holds OUT, wait for it to finish instead of exiting with code 47.")
@click.option("--max-shard-size", type=ShardSize(), default="5GB", show_default=True, help="Largest output shard: bytes, or with a unit (K, M, G, T = 1000^n; KiB, MiB, GiB, TiB = 1024^n).")
@click.option("--dry-run", is_flag=True, help="Print the plan and stop (same as `plan`).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary (bytes read/written, seconds, output path).")
def convert_command(source: str, out: str, target: str, reverse: bool, overwrite: bool, wait: bool, max_shard_size: int, dry_run: bool, quiet: bool, as_json: bool) -> None:
    """Convert SOURCE (a native checkpoint directory or hub repo org/name[@revision]) into OUT.

    Reads only the byte ranges the plan needs, writes shards header-first with bounded
    memory in a hidden partial directory, and resumes there if interrupted. OUT appears
    only when complete and verified; rerunning on an up-to-date OUT does nothing.
    """
    from dsv4.convert.job import convert

    if dry_run:
        _print_plan(_plan(source, target, reverse)[0], as_json, full=False)
        return
    result = convert(source, out, target=target, reverse=reverse, overwrite=overwrite, wait=wait, max_shard_size=max_shard_size, quiet=quiet or as_json)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    elif result.status == "up-to-date":
        click.echo(f"{out}: already up to date (same source, table {result.plan.table} v{result.plan.table_version}); nothing to do")
    else:
        click.echo(f"{result.status} {result.tensors} tensors into {out}: read {_gb(result.bytes_read)}, wrote {_gb(result.bytes_written)} in {result.seconds:.1f} s")


@cli.command("plan")
@click.argument("source")
@target_option
@click.option("--reverse", is_flag=True, help="Plan the reverse conversion of a converted checkpoint.")
@click.option("--json", "as_json", is_flag=True, help="The whole plan (every tensor and byte range, every skip) as JSON.")
def plan_command(source: str, target: str, reverse: bool, as_json: bool) -> None:
    """Show what converting SOURCE would read and write. Reads headers only."""
    plan, header_bytes = _plan(source, target, reverse)
    _print_plan(plan, as_json, full=True, header_bytes=header_bytes)


def _plan(source: str, target: str, reverse: bool) -> tuple[Plan, int]:
    """The plan for SOURCE, from headers only, and the header bytes read."""
    from dsv4.convert.job import open_source, plan_source

    inv, reader = open_source(source)
    plan = plan_source(inv, reader, target, reverse=reverse)
    reader.close()
    return plan, inv.header_bytes


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e7 else f"{n:,} B"


# how `plan` names the layout it chose (convert/plan.py choose_table)
DRAFTER_NAMES = {
    "mtp": "MTP (no dspark_* fields in config.json): vLLM DeepSeekV4MTP",
    "dspark": "DSpark (dspark_* fields and mtp.0.main_proj.weight): vLLM DSparkDeepseekV4ForCausalLM",
}


def _print_plan(plan: Plan, as_json: bool, *, full: bool, header_bytes: int | None = None) -> None:
    if as_json:
        data = plan.to_json() if full else plan.summary()
        if header_bytes is not None:
            data["header_bytes_read"] = header_bytes
        click.echo(json.dumps(data, indent=2))
        return
    s = plan.summary()
    click.echo(f"{s['direction']} plan: {s['source']} -> {s['target']} (table {s['table']})")
    click.echo(f"  draft layout:         {DRAFTER_NAMES[s['drafter']]}")
    click.echo(f"  tensors out:          {s['tensors_out']}")
    click.echo(f"  source keys consumed: {s['source_keys_consumed']}")
    click.echo(f"  source keys skipped:  {s['source_keys_skipped']}")
    click.echo(f"  bytes to read:        {_gb(s['bytes_to_read'])} from {len(s['files_to_read'])} file(s): {', '.join(s['files_to_read'])}")
    click.echo(f"  bytes to write:       {_gb(s['bytes_to_write'])}")
    if header_bytes is not None:
        click.echo(f"  header bytes read:    {header_bytes:,} (no tensor data)")
    click.echo("  ops:  " + ", ".join(f"{op} x{n}" for op, n in s["ops"].items()))
    for reason, n in s["skip_reasons"].items():
        click.echo(f"  skip x{n}: {reason}")


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


def main() -> None:
    """The entry point: every outcome is an exit code and at most one line on stderr.

    The tool's own errors carry their documented code; click's usage errors exit 2; Ctrl-C
    exits 130. Anything else is a bug or an unclassified OS error: one line and exit 1, never a
    traceback (unless DSV4_TRACEBACK=1)."""
    # numpy is no dependency of this tool; torch warns at import when it is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        cli(prog_name="convert-dsv4", standalone_mode=False)
    except DSV4Error as exc:
        click.echo(f"error: {_escape_newlines(str(exc))}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.UsageError as exc:  # one line like every other error, not click's usage block
        if isinstance(exc, getattr(click.exceptions, "NoArgsIsHelpError", ())):  # click >= 8.2: no arguments means help
            exc.show()
            sys.exit(exc.exit_code)
        hint = f" (see: {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
        click.echo(f"error: {_escape_newlines(exc.format_message())}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):  # click turns Ctrl-C into Abort
        click.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:  # stdout closed early (`... --json | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        sys.exit(1)
    except Exception as exc:
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        if isinstance(exc, OSError):
            click.echo(_os_error(exc), err=True)
        else:
            click.echo(f"internal error: {type(exc).__name__}: {_one_line(exc)} (please report this bug with the command that caused it; {TRACEBACK_ENV}=1 shows the traceback)", err=True)
        sys.exit(1)
