"""The command `batch MANIFEST` (convert/cli/main.py puts it on the command line; convert/batch/run.py runs it)."""

from __future__ import annotations

from pathlib import Path

import click

from dsv4.convert.cli.common import (
    echo_json,
    json_option,
    quiet_option,
)


@click.command("batch")
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
    from dsv4.convert.batch.manifest import load_manifest, shard_from_env
    from dsv4.convert.batch.run import default_report_path, run_batch  # start-up time: the hub client
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
