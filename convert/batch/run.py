"""`convert-dsv4 batch MANIFEST`: convert (and push) many hub repositories, idempotently.

Each source is first resolved to its commit (one metadata request). A source whose output
already records that commit and the table's version is skipped before any of its files is
read: the local output's conversion.json decides, or with --push the target repo's. Other
sources are converted (reading only the planned byte ranges), checked with
`convert-dsv4 check` (dsv4.convert.check.run) where it is installed, and with --push uploaded
with a model card (convert/batch/card.py) in the same commit. A failing repository is reported
and the others go on; every run writes a JSON report.

The manifest, and which of its sources a task of an array takes: convert/batch/manifest.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from dsv4 import __version__
from dsv4.convert import interrupts
from dsv4.convert.batch.card import model_card, with_card
from dsv4.convert.batch.manifest import Manifest, ManifestEntry, select_shard
from dsv4.convert.errors import HubError, OutputError
from dsv4.convert.exit_codes import exit_code
from dsv4.convert.output import hold_lock
from dsv4.convert.pipeline import plan_served, plan_source, run_plan
from dsv4.convert.serving import Serving
from dsv4.convert.serving_target import read_serving_target
from dsv4.convert.sources.hub import default_backend, download, hub_errors, resolve_commit
from dsv4.convert.sources.location import open_source
from dsv4.convert.sources.source import HUB_SCHEME, HubSpec
from dsv4.mapping.table import Table, load_table
from dsv4.mapping.targets import tables_of_target
from dsv4.model import strictjson
from dsv4.model.errors import DSV4Error
from dsv4.model.record import CONVERSION_RECORD, ConversionRecord, RecordError
from dsv4.model.strictjson import write_record

# Shards of an older conversion whose names the new one does not reuse are deleted from the
# target repo in the same commit; anything else there is left alone, but README.md is replaced
# by the card of the conversion pushed (convert/batch/card.py).
STALE_SHARDS = ["model-*-of-*.safetensors"]


def records(
    record: ConversionRecord | None,
    location: str,
    commit: str,
    tables: Mapping[str, Table],
    serving: Serving | None = None,
) -> bool:
    """Whether a conversion.json records a forward conversion of this commit with one of
    `tables` (by name) at its current version, for the serving target of `serving` (None:
    for none). One commit always takes the same table (the one for the drafter it holds), so
    the record's table is the one it would take again."""
    if record is None:
        return False
    table = tables.get(record.table)
    served_for = (record.serve or {}).get("target")
    return (
        record.source.location == location
        and record.source.revision == commit
        and record.direction == "forward"
        and table is not None
        and record.table_version == table.version
        and served_for == (serving.target.to_json() if serving is not None else None)
    )


def pushed_record(repo: str) -> tuple[str | None, ConversionRecord | None]:
    """(head commit, conversion.json there) of `repo`'s default branch; (None, None) when the
    repo does not exist yet, (head, None) when it has no conversion.json or what is there is
    no record of this tool (model/record.py reads it strictly)."""
    hub = HubSpec(repo, None, explicit=True)
    try:
        head = resolve_commit(hub)
    except HubError as exc:
        if exc.kind == "repo_not_found":
            return None, None
        raise HubError(str(exc), kind="push_failed", path=f"{HUB_SCHEME}{repo}") from None
    raw = download(hub, head, CONVERSION_RECORD, partial(HubError, kind="push_failed"), missing_ok=True)
    try:
        return head, None if raw is None else ConversionRecord.from_json(
            strictjson.loads(raw), f"{HUB_SCHEME}{repo}/{CONVERSION_RECORD}"
        )
    except (strictjson.StrictJSONError, RecordError):
        return head, None  # records nothing, as ConversionRecord.find says of a local one


def push(
    out: Path, repo: str, message: str, description: str, private: bool | None, head: str | None, card: str
) -> str:
    """Upload `out` to `repo` (created if missing) as one commit on top of `head`, the
    repo's head when its record was read, with README.md = `card` (convert/batch/card.py) in the
    same commit; returns the commit.

    The backend's upload (convert/sources/hub_protocol.py; the Hugging Face Hub's resumable
    upload_folder) takes a commit message, which must name the source commit and table
    version. An output is a handful of files, so it lands as one commit: conversion.json
    never appears on the hub without its shards.

    Idempotent: the backend may retry a commit whose answer was lost, and that commit may
    have landed. The commit names its parent (`head`), so the hub refuses a second copy of
    it; then, and after any failed push, the repo's head is read: when the head moved from
    `head` and holds exactly this output's conversion.json (every tensor's sha256), this
    output is what landed, and the push succeeded.
    """
    backend = default_backend()
    where = f"{HUB_SCHEME}{repo}"
    with hub_errors(where, partial(HubError, kind="push_failed")):
        if head is None:
            backend.create_repo(repo, private)
            head = resolve_commit(HubSpec(repo, None, explicit=True))
    try:
        with hub_errors(where, partial(HubError, kind="push_failed")), with_card(out, card) as folder:
            return backend.upload_folder(repo, folder, message, description, STALE_SHARDS, head)
    except HubError as exc:
        if exc.kind != "push_failed":
            raise
        try:
            landed = _landed(repo, head, out)
        except HubError:
            raise exc from None  # the read-back failed too: it says nothing of the push, whose own error stands
        if landed is None:
            raise
        return landed


def _landed(repo: str, head: str, out: Path) -> str | None:
    """The head of `repo` when it moved from `head` and holds exactly `out`'s conversion.json
    (the push landed although its answer said otherwise), else None."""
    now = HubSpec(repo, None, explicit=True)
    landed = resolve_commit(now)
    if landed == head:
        return None
    pushed = download(now, landed, CONVERSION_RECORD, partial(HubError, kind="push_failed"), missing_ok=True)
    return landed if pushed == (out / CONVERSION_RECORD).read_bytes() else None


def run_check(out: Path) -> str:
    """Verify `out` with dsv4.convert.check.run where it is installed; returns its one-line
    summary, or "unavailable". A failed check raises that check's own one-line error."""
    try:
        from dsv4.convert.check.run import run_checks
    except ModuleNotFoundError as exc:
        if exc.name != "dsv4.convert.check.run":  # the checker is there but broken: say so
            raise
        return "unavailable"
    report = run_checks(out)
    report.raise_for_failure()
    return report.summary()


class _Job:
    """One source's run; `fetched` is kept up to date so a failure still reports it."""

    def __init__(
        self,
        entry: ManifestEntry,
        manifest: Manifest,
        tables: Mapping[str, Table],
        push_to_hub: bool,
        serving: Serving | None = None,
    ):
        self.entry, self.manifest, self.tables, self.push_to_hub = entry, manifest, tables, push_to_hub
        self.serving = serving
        self.hub = HubSpec(entry.repo, entry.revision, explicit=True)  # a manifest names hub repositories only
        self.commit: str | None = None
        self.fetched = 0

    def run(self) -> tuple[str, dict[str, Any]]:
        entry, tables = self.entry, self.tables
        self.commit = commit = resolve_commit(self.hub)
        target = entry.push_repo if self.push_to_hub else None  # run_batch refuses --push without output.repo
        head, pushed = pushed_record(target) if target else (None, None)
        if target and records(pushed, self.hub.location, commit, tables, self.serving):
            return "skipped", {"reason": f"{HUB_SCHEME}{target} already records {_what(pushed)}"}
        local = ConversionRecord.find(entry.output)
        if records(local, self.hub.location, commit, tables, self.serving):
            if not target:
                return "skipped", {"reason": f"{entry.output} already records {_what(local)}"}
            conversion, table = "reused", tables[local.table]
        else:
            with open_source(HubSpec(entry.repo, commit, explicit=True)) as source:
                header_bytes = self.fetched = source.inventory.header_bytes
                plan, served = plan_served(source, plan_source(source, self.manifest.target), self.serving)
                try:
                    # replacing is safe only over an earlier conversion (it has a conversion.json), never
                    # over anything else
                    result = run_plan(
                        plan,
                        source,
                        entry.output,
                        overwrite=(entry.output / CONVERSION_RECORD).exists(),
                        max_shard_size=self.manifest.max_shard_size,
                        served=served,
                    )
                finally:
                    self.fetched = header_bytes + source.reader.bytes_read
            conversion, table = result.status, tables[plan.table]
        row: dict[str, Any] = {
            "conversion": conversion,
            "table": table.name,
            "check": run_check(entry.output) if self.manifest.check else "disabled",
        }
        if target:
            message = f"Convert {entry.repo}@{commit[:12]} with table {table.name} v{table.version}"
            description = (
                f"Source: {entry.repo} commit {commit}\n"
                f"Table: {table.name} v{table.version} (target {table.target})\n"
                f"Tool: dsv4-convert {__version__}"
            )
            card = model_card(target, entry.repo, commit, table, out=entry.output)
            row["pushed"] = {
                "repo": target,
                "commit": push(entry.output, target, message, description, self.manifest.private, head, card),
            }
        return "converted", row


def _what(record: ConversionRecord) -> str:
    """A conversion record that `records` accepted, as a skip reason names it."""
    return f"source commit {(record.source.revision or '')[:12]} with table {record.table} v{record.table_version}"


def _failure(exc: Exception) -> dict[str, Any]:
    """A failed repository's row of the report: the reason (one line), the error, its exit code and fields."""
    reason = (
        str(exc)
        if isinstance(exc, DSV4Error)
        else f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    )
    return {
        "reason": reason,
        "error": type(exc).__name__,
        "exit_code": exit_code(exc),
        **(exc.fields() if isinstance(exc, DSV4Error) else {}),
    }


def _write_report(path: Path, report: dict[str, Any]) -> None:
    # rewritten after every repo (durably), so a killed job still leaves an accurate report
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_record(path, report)
    except OSError as exc:
        # mkdir says "File exists" when the folder's name is taken by a file
        why = f"{path.parent} is not a directory" if isinstance(exc, FileExistsError) else exc.strerror or str(exc)
        raise OutputError(
            f"{path}: cannot write the batch report ({why})", kind="write_failed", path=str(path)
        ) from None


def _own_report(path: Path, stack: ExitStack) -> None:
    """Hold the report file's lock (`.NAME.lock` beside it) until `stack` closes: a second
    run that would write the same report (same manifest and out-dir, or the same --report)
    is refused at once (47, naming the first run) instead of overwriting its report."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        stack.enter_context(
            hold_lock(
                path,
                path.parent / f".{path.name}.lock",
                path.parent / f".{path.name}.lock.owner",
                instead="pass --report FILE to write this run's report elsewhere",
            )
        )
    except OSError as exc:
        why = f"{path.parent} is not a directory" if isinstance(exc, FileExistsError) else exc.strerror or str(exc)
        raise OutputError(
            f"{path}: cannot write the batch report ({why})", kind="write_failed", path=str(path)
        ) from None


def default_report_path(manifest: Manifest, num_shards: int, shard_index: int) -> Path:
    name = "batch-report.json" if num_shards == 1 else f"batch-report-{shard_index}-of-{num_shards}.json"
    return manifest.out_dir / name


def run_batch(
    manifest: Manifest,
    *,
    push_to_hub: bool = False,
    num_shards: int = 1,
    shard_index: int = 0,
    report_path: Path | None = None,
    echo: Callable[[str], object] | None = None,
) -> dict[str, Any]:
    """Process this shard's sources; returns the report (also written to `report_path`)."""
    start, started = time.monotonic(), datetime.now(UTC).isoformat(timespec="seconds")
    if push_to_hub and any(s.push_repo is None for s in manifest.sources):
        raise HubError(
            f"{manifest.path}: --push needs output.repo, the target repo name template",
            kind="bad_manifest",
            path=str(manifest.path),
        )
    tables = {name: load_table(name) for name in tables_of_target(manifest.target)}
    # the serving target is read once, before any source: its refusal stops the batch
    serving = (
        Serving(read_serving_target(manifest.serve_with), manifest.draft_format, manifest.allow_lossy)
        if manifest.serve_with is not None
        else None
    )
    mine = select_shard(manifest.sources, num_shards, shard_index)
    report_path = report_path or default_report_path(manifest, num_shards, shard_index)
    report: dict[str, Any] = {
        "tool": "dsv4-convert",
        "tool_version": __version__,
        "manifest": str(manifest.path),
        "started": started,
        "target": manifest.target,
        "serve_with": serving.target.to_json() if serving is not None else None,
        "tables": {name: t.version for name, t in tables.items()},
        "push": push_to_hub,
        "shard": {"index": shard_index, "count": num_shards},
        "planned": [
            {"repo": s.repo, "revision": s.revision, "output": str(s.output), "push_repo": s.push_repo} for s in mine
        ],
        "converted": [],
        "skipped": [],
        "failed": [],
        "bytes_fetched": 0,
        "seconds": 0.0,
    }
    with ExitStack() as stack:
        _own_report(report_path, stack)  # before anything is converted: one run per report file
        for n, entry in enumerate(mine, 1):
            if echo is not None:  # a conversion takes minutes: say which repo is under way
                echo(f"[{n}/{len(mine)}] {entry.key}: starting")
            job = _Job(entry, manifest, tables, push_to_hub, serving)
            t0 = time.monotonic()
            try:
                outcome, row = job.run()
            except Exception as exc:  # one repo's failure, whatever it is, must not stop the others
                interrupts.raise_if_interrupted()  # but a signal stops them all, whatever error it caused
                outcome, row = "failed", _failure(exc)
            row = {
                "repo": entry.repo,
                "revision": entry.revision,
                "commit": job.commit,
                "output": str(entry.output),
                **row,
                "bytes_fetched": job.fetched,
                "seconds": round(time.monotonic() - t0, 3),
            }
            report[outcome].append(row)
            report["bytes_fetched"] += job.fetched
            report["seconds"] = round(time.monotonic() - start, 3)
            _write_report(report_path, report)
            detail = (
                row.get("reason")
                or f"{row['conversion']} -> {entry.output} ({job.fetched:,} bytes fetched, {row['seconds']:.1f} s)"
            )
            if echo is not None:
                echo(f"[{n}/{len(mine)}] {entry.key}: {outcome}: {detail}")
        report["seconds"] = round(time.monotonic() - start, 3)
        _write_report(report_path, report)
    return report
