"""`convert-dsv4`: the command line. `convert-dsv4 IN OUT --target xpu` converts; the other
subcommands plan, check, smoke-test, synthesise and batch-convert."""

from __future__ import annotations

import importlib
import json
import sys
import warnings
from typing import TYPE_CHECKING

import click

from dsv4 import __version__
from dsv4.convert.errors import DSV4Error

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


def _parse_size(value: str) -> int:
    units = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    v = value.strip().upper().removesuffix("B")
    try:
        return int(float(v[:-1]) * units[v[-1]]) if v and v[-1] in units else int(v)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a size like 5GB, 500MB or 1000000") from None


@cli.command("convert")
@click.argument("source")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--target", default="xpu", show_default=True, help="Mapping table (mapping/<target>.toml).")
@click.option("--reverse", is_flag=True, help="SOURCE is a converted checkpoint: write the draft's tensors back under native names.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it is a previous output of this tool (anything else is refused).")
@click.option("--wait", is_flag=True, help="If another run holds OUT, wait for it to finish instead of exiting with code 47.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output shard.")
@click.option("--dry-run", is_flag=True, help="Print the plan and stop (same as `plan`).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary (bytes read/written, seconds, output path).")
def convert_command(source: str, out: str, target: str, reverse: bool, overwrite: bool, wait: bool, max_shard_size: str, dry_run: bool, quiet: bool, as_json: bool) -> None:
    """Convert SOURCE (a native checkpoint directory or hub repo org/name[@revision]) into OUT.

    Reads only the byte ranges the plan needs, writes shards header-first with bounded
    memory in a hidden partial directory, and resumes there if interrupted. OUT appears
    only when complete and verified; rerunning on an up-to-date OUT does nothing.
    """
    from dsv4.convert.job import convert

    if dry_run:
        _print_plan(_plan(source, target, reverse)[0], as_json, full=False)
        return
    result = convert(source, out, target=target, reverse=reverse, overwrite=overwrite, wait=wait, max_shard_size=_parse_size(max_shard_size), quiet=quiet or as_json)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    elif result.status == "up-to-date":
        click.echo(f"{out}: already up to date (same source, table {result.plan.table} v{result.plan.table_version}); nothing to do")
    else:
        click.echo(f"{result.status} {result.tensors} tensors into {out}: read {_gb(result.bytes_read)}, wrote {_gb(result.bytes_written)} in {result.seconds:.1f} s")


@cli.command("plan")
@click.argument("source")
@click.option("--target", default="xpu", show_default=True, help="Mapping table (mapping/<target>.toml).")
@click.option("--reverse", is_flag=True, help="Plan the reverse conversion of a converted checkpoint.")
@click.option("--json", "as_json", is_flag=True, help="The whole plan (every tensor and byte range, every skip) as JSON.")
def plan_command(source: str, target: str, reverse: bool, as_json: bool) -> None:
    """Show what converting SOURCE would read and write. Reads headers only."""
    plan, header_bytes = _plan(source, target, reverse)
    _print_plan(plan, as_json, full=True, header_bytes=header_bytes)


def _plan(source: str, target: str, reverse: bool) -> tuple[Plan, int]:
    """The plan for SOURCE, from headers only, and the header bytes read."""
    from dsv4.convert.job import open_source, plan_source
    from dsv4.mapping.table import load_table

    table = load_table(target)
    inv, reader = open_source(source)
    plan = plan_source(inv, reader, table, reverse=reverse)
    reader.close()
    return plan, inv.header_bytes


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e7 else f"{n:,} B"


def _print_plan(plan: Plan, as_json: bool, *, full: bool, header_bytes: int | None = None) -> None:
    if as_json:
        data = plan.to_json() if full else plan.summary()
        if header_bytes is not None:
            data["header_bytes_read"] = header_bytes
        click.echo(json.dumps(data, indent=2))
        return
    s = plan.summary()
    click.echo(f"{s['direction']} plan: {s['source']} -> {s['target']} (table {s['table']})")
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


def main() -> None:
    # numpy is no dependency of this tool; torch warns at import when it is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        cli(standalone_mode=False)
    except DSV4Error as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
