"""The commands `convert` (convert-dsv4 IN OUT) and `plan` (convert/cli/main.py puts them on the command line)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from dsv4.convert.cli.common import (
    ShardSize,
    echo_json,
    gb,
    json_option,
    quiet_option,
    revision_option,
    serve_options,
    serving_request,
    target_option,
    token_option,
)

if TYPE_CHECKING:
    from dsv4.convert.plan import Plan
    from dsv4.convert.serving import Served


@click.command("convert")
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
@serve_options
@revision_option
@token_option
@click.option(
    "--verify-source",
    is_flag=True,
    help="Hub source: download each shard the output uses whole, once, and check it against the sha256 and size the "
    "hub publishes (docs/hub.md: what is checked without it).",
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
    serve_with: str | None,
    draft_format: str | None,
    allow_lossy: bool,
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
    from dsv4.convert.pipeline import convert  # start-up time (see the module's docstring)
    from dsv4.convert.pipeline import dry_run as preview
    from dsv4.convert.sources.location import locate

    serving = serving_request(target, serve_with, draft_format, allow_lossy, reverse)
    options: dict[str, Any] = {
        "target": target,
        "reverse": reverse,
        "overwrite": overwrite,
        "max_shard_size": max_shard_size,
        "serving": serving,
    }
    # the hub options are checked against SOURCE here; without them convert() locates it
    where = (
        locate(source, revision=revision, token=token, verify_files=verify_source)
        if revision or token or verify_source
        else source
    )
    if dry_run:
        plan, would, header_bytes, served = preview(where, out, **options)
        if as_json:
            echo_json(
                plan.to_json()
                | {"header_bytes_read": header_bytes, "output": out, "would": would}
                | _serve_json(served)
            )
            return
        _print_plan(plan, False, quiet, full=True, header_bytes=header_bytes, served=served)
        click.echo(f"dry run: {out} {DRY_RUN_OUTCOMES[would]}; nothing was written")
        return
    result = convert(where, out, wait=wait, quiet=quiet or as_json, **options)
    from dsv4.convert.served import agreement_line, recorded_agreement

    figures = recorded_agreement(result.out) if serving is not None else None
    if as_json:
        echo_json(result.to_json() | ({"agreement": figures} if figures is not None else {}))
    elif result.status == "up-to-date":
        click.echo(
            f"{out}: already up to date (same source, table {result.plan.table} v{result.plan.table_version}); "
            "nothing to do"
        )
    else:
        click.echo(
            f"{result.status} {result.tensors} tensors into {out}: read {gb(result.bytes_read)}, wrote "
            f"{gb(result.bytes_written)} in {result.seconds:.1f} s"
        )
    if figures is not None and not as_json:
        click.echo(agreement_line(figures))
    if serving is not None and not as_json:
        from dsv4.convert.serving import COMMANDS_FILE

        click.echo((result.out / COMMANDS_FILE).read_text(encoding="utf-8"), nl=False)


DRY_RUN_OUTCOMES = {
    "up-to-date": "is already up to date: the run would do nothing",
    "create": "would be created",
    "replace": "would be replaced (--overwrite)",
}


@click.command("plan")
@click.argument("source")
@target_option
@click.option("--reverse", is_flag=True, help="Plan the reverse conversion of a converted checkpoint.")
@serve_options
@revision_option
@token_option
@quiet_option
@click.option(
    "--json", "as_json", is_flag=True, help="The whole plan (every tensor and byte range, every skip) as JSON."
)
def plan_command(
    source: str,
    target: str,
    reverse: bool,
    serve_with: str | None,
    draft_format: str | None,
    allow_lossy: bool,
    revision: str | None,
    token: str | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Show what converting SOURCE would read and write; with --serve-with, each draft module's
    scheme beside TARGET and why. Reads headers only."""
    from dsv4.convert.pipeline import plan_served, plan_source
    from dsv4.convert.sources.location import locate, open_source  # start-up time (see the module's docstring)

    serving = serving_request(target, serve_with, draft_format, allow_lossy, reverse)
    with open_source(locate(source, revision=revision, token=token), quiet=quiet or as_json) as opened:
        plan, served = plan_served(opened, plan_source(opened, target, reverse=reverse), serving)
    _print_plan(plan, as_json, quiet, full=True, header_bytes=opened.inventory.header_bytes, served=served)


# how `plan` names the layout it chose (convert/plan.py choose_table)
DRAFTER_NAMES = {
    "mtp": "MTP (no dspark_* fields in config.json)",
    "dspark": "DSpark (dspark_* fields and mtp.0.main_proj.weight)",
}


def _serve_json(served: Served | None) -> dict[str, object]:
    from dsv4.convert.serving import serve_json

    return {"serve": serve_json(served)} if served is not None else {}


def _print_plan(
    plan: Plan,
    as_json: bool,
    quiet: bool,
    *,
    full: bool,
    header_bytes: int | None = None,
    served: Served | None = None,
) -> None:
    if as_json:
        data = plan.to_json() if full else plan.summary()
        if header_bytes is not None:
            data["header_bytes_read"] = header_bytes
        echo_json(data | _serve_json(served))
        return
    s = plan.summary()
    click.echo(
        f"{s['direction']} plan: {s['source']} -> {s['target']} (table {s['table']} v{s['table_version']})"
        + (f": {s['tensors_out']} tensors, {gb(s['bytes_to_read'])} to read" if quiet else "")
    )
    if quiet:
        return
    click.echo(f"  draft layout:         {DRAFTER_NAMES[s['drafter']]}: {s['runtime']} {s['runtime_class']}")
    for line in _drafter_lines(plan, served):
        click.echo(f"  {line}")
    click.echo(f"  tensors out:          {s['tensors_out']}")
    click.echo(f"  source keys consumed: {s['source_keys_consumed']}")
    click.echo(f"  source keys skipped:  {s['source_keys_skipped']}")
    click.echo(
        f"  bytes to read:        {gb(s['bytes_to_read'])} from {len(s['files_to_read'])} file(s): "
        f"{', '.join(s['files_to_read'])}"
    )
    click.echo(f"  bytes to write:       {gb(s['bytes_to_write'])}")
    if header_bytes is not None:
        click.echo(f"  header bytes read:    {header_bytes:,} (no tensor data)")
    click.echo("  ops:  " + ", ".join(f"{op} x{n}" for op, n in s["ops"].items()))
    for reason, n in s["skip_reasons"].items():
        click.echo(f"  skip x{n}: {reason}")
    if served is not None:
        _print_decisions(served)


def _drafter_lines(plan: Plan, served: Served | None) -> list[str]:
    """The drafter family the source holds and, for a draft directory, how each runtime serves
    it (convert/launch.py); a reverse plan's target is the native layout, which names nothing."""
    from dsv4.convert.launch import drafter_lines
    from dsv4.convert.serving import OVERRIDES_FILE
    from dsv4.mapping.targets import installed_targets, require_target

    if plan.identity.target not in installed_targets():
        return []
    route = served.plan.route if served is not None else None
    overrides = f"OUT/{OVERRIDES_FILE}" if served is not None and served.plan.overrides is not None else None
    return drafter_lines(plan.drafter_family, require_target(plan.identity.target), route=route, overrides=overrides)


def _print_decisions(served: Served) -> None:
    """The serve plan: the target and route, then per draft module its scheme, tensors and why."""
    from dsv4.convert.serving import OVERRIDES_FILE, decision_rows

    plan = served.plan
    click.echo(f"  serve with:           {served.serving.target.name} ({served.serving.target.where})")
    click.echo(f"  route:                {plan.route} ({plan.why})")
    launch = f"OUT/{OVERRIDES_FILE} (--hf-overrides)" if plan.overrides is not None else "none"
    click.echo(f"  launch overrides:     {launch}")
    rows = decision_rows(served)
    width = max(len(r["module"]) for r in rows)
    click.echo(f"  {'module':{width}}  {'scheme':12} tensors  why")
    for r in rows:
        click.echo(f"  {r['module']:{width}}  {r['scheme']:12} {len(r['tensors']):7}  {r['why']}")
