"""`convert-dsv4 batch MANIFEST`: convert (and push) many hub repositories, idempotently.

Each source is first resolved to its commit (one metadata request). A source whose output
already records that commit and the table's version is skipped before any of its files is
read: the local output's conversion.json decides, or with --push the target repo's. Other
sources are converted (reading only the planned byte ranges), checked with
`convert-dsv4 check` (dsv4.convert.check) where it is installed, and with --push uploaded
with a model card (convert/card.py) in the same commit. A failing repository is reported
and the others go on; every run writes a JSON report.

Scale-out: the manifest's sources are sorted by id and shard K of N takes every N-th one
from K, so array tasks split the work the same way on every machine without talking to
each other. N and K default from Slurm array or Kubernetes indexed-Job variables.
"""

from __future__ import annotations

import os
import string
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from dsv4 import __version__
from dsv4.convert import interrupts
from dsv4.convert.card import model_card, with_card
from dsv4.convert.errors import HubError, OutputError
from dsv4.convert.exit_codes import exit_code
from dsv4.convert.hub import default_backend, download, hub_errors, resolve_commit
from dsv4.convert.location import HF_PREFIX, open_source, parse_hub_spec
from dsv4.convert.output import hold_lock
from dsv4.convert.pipeline import DEFAULT_MAX_SHARD, plan_source, run_plan
from dsv4.convert.sizes import shard_size
from dsv4.convert.source import HUB_SCHEME, HubSpec
from dsv4.mapping.table import Table, installed_targets, load_table, tables_of_target
from dsv4.model import strictjson
from dsv4.model.errors import DSV4Error
from dsv4.model.record import CONVERSION_RECORD, ConversionRecord, RecordError
from dsv4.model.strictjson import write_record

TOP_KEYS = {"target", "sources", "output", "options"}
OUTPUT_KEYS = {"dir", "name", "repo", "private"}
OPTION_KEYS = {"max_shard_size", "check"}
PLACEHOLDERS = ("org", "name", "target", "revision")
DEFAULT_DIR = "converted"
DEFAULT_NAME = "{name}-{target}"
# Shards of an older conversion whose names the new one does not reuse are deleted from the
# target repo in the same commit; anything else there is left alone, but README.md is replaced
# by the card of the conversion pushed (convert/card.py).
STALE_SHARDS = ["model-*-of-*.safetensors"]
NUM_SHARDS_ENV = "DSV4_NUM_SHARDS"


@dataclass(frozen=True)
class ManifestEntry:
    """One repository of the manifest's `sources`, and where its output goes."""

    repo: str
    revision: str | None  # as the manifest names it; None = the default branch
    output: Path  # local output directory
    push_repo: str | None  # target hub repo, when the manifest names one

    @property
    def key(self) -> str:
        return f"{self.repo}@{self.revision}" if self.revision else self.repo


@dataclass(frozen=True)
class Manifest:
    path: Path
    target: str
    out_dir: Path
    sources: tuple[ManifestEntry, ...]  # sorted by key: the order shards are cut from
    private: bool | None  # visibility of target repos that --push creates; None: the hub's default
    max_shard_size: int
    check: bool


def _table(raw: Any, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise HubError(f"{where}: must be a table", kind="bad_manifest", path=str(where))
    unknown = sorted(set(raw) - keys)
    if unknown:
        raise HubError(
            f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(keys))})",
            kind="bad_manifest",
            path=str(where),
        )
    return raw


def _fill(template: str, hub: HubSpec, target: str, where: str) -> str:
    org, name = hub.repo.split("/")
    values = {"org": org, "name": name, "target": target, "revision": hub.revision or "main"}
    try:
        # bare placeholders only: str.format would also run "{name.upper}" (attribute access)
        # and "{name:>999999999}" (a gigabyte of padding) straight from the manifest
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
        bad = next(
            (
                f"{{{f}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}"
                for f, spec, conv in fields
                if f not in values or spec or conv
            ),
            None,
        )
        if bad is not None:
            raise ValueError(f"{bad} is not a placeholder")
        return template.format(**values)
    except ValueError as exc:
        raise HubError(
            f"{where}: bad template {template!r} ({exc}); placeholders are "
            f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}",
            kind="bad_manifest",
            path=str(where),
        ) from None


def _hub_spec(raw: Any, where: str, base: Path) -> HubSpec:
    if isinstance(raw, dict):
        raw = _table(raw, where, {"repo", "revision"})
        repo, revision = raw.get("repo"), raw.get("revision")
        if not isinstance(repo, str) or "@" in repo or not (revision is None or isinstance(revision, str)):
            raise HubError(
                f'{where}: needs repo = "org/name" and optionally revision = "branch, tag or commit"',
                kind="bad_manifest",
                path=str(where),
            )
        raw = f"{repo}@{revision}" if revision else repo
    if not isinstance(raw, str):
        raise HubError(
            f'{where}: a source is "org/name[@revision]" or {{repo = ..., revision = ...}}',
            kind="bad_manifest",
            path=str(where),
        )
    if not raw.startswith(HF_PREFIX) and (Path(raw).is_dir() or (base / raw).is_dir()):
        raise HubError(
            f"{where}: {raw!r} is a local directory; batch takes hub repositories only (convert a local checkpoint "
            f"with convert-dsv4 {raw} OUT --target xpu)",
            kind="bad_manifest",
            path=str(where),
        )
    try:
        return parse_hub_spec(raw)
    except DSV4Error as exc:
        raise HubError(f"{where}: {exc}", kind="bad_manifest", path=str(where)) from None


def load_manifest(path: str | Path, out_dir: str | Path | None = None) -> Manifest:
    """Read and check a batch manifest. `out_dir` overrides its output.dir."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise HubError(f"{path}: cannot read the manifest ({exc})", kind="bad_manifest", path=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise HubError(f"{path}: not valid TOML ({exc})", kind="bad_manifest", path=str(path)) from None
    _table(raw, str(path), TOP_KEYS)
    output = _table(raw.get("output", {}), f"{path}: [output]", OUTPUT_KEYS)
    options = _table(raw.get("options", {}), f"{path}: [options]", OPTION_KEYS)
    target = raw.get("target", "xpu")
    name_t, repo_t, private = output.get("name", DEFAULT_NAME), output.get("repo"), output.get("private")
    max_shard, check = options.get("max_shard_size", DEFAULT_MAX_SHARD), options.get("check", True)
    if not isinstance(target, str) or not isinstance(name_t, str) or not (repo_t is None or isinstance(repo_t, str)):
        raise HubError(f"{path}: target, output.name and output.repo are strings", kind="bad_manifest", path=str(path))
    if target not in installed_targets():  # before it fills a template or names a path
        raise HubError(
            f"{path}: target {target!r} is not an installed mapping table (installed: "
            f"{', '.join(installed_targets())}); a table is chosen by name, not path",
            kind="bad_manifest",
            path=str(path),
        )
    if not (private is None or isinstance(private, bool)) or not isinstance(check, bool):
        raise HubError(
            f"{path}: output.private and options.check are true or false", kind="bad_manifest", path=str(path)
        )
    try:
        max_shard = shard_size(max_shard)  # the rule --max-shard-size follows
    except ValueError as exc:
        raise HubError(f"{path}: options.max_shard_size: {exc}", kind="bad_manifest", path=str(path)) from None
    if out_dir is None:
        dir_raw = output.get("dir", DEFAULT_DIR)
        if not isinstance(dir_raw, str):
            raise HubError(f"{path}: output.dir is a string", kind="bad_manifest", path=str(path))
        out_root = path.parent / dir_raw  # relative to the manifest, so jobs may start anywhere
    else:
        out_root = Path(out_dir)

    entries = raw.get("sources")
    if not isinstance(entries, list) or not entries:
        raise HubError(
            f'{path}: sources must be a non-empty list of "org/name[@revision]"', kind="bad_manifest", path=str(path)
        )
    sources: dict[str, ManifestEntry] = {}
    names: dict[str, str] = {}
    for k, listed in enumerate(entries):
        where = f"{path}: sources[{k}]"
        hub = _hub_spec(listed, where, Path(path).parent)
        local = _fill(name_t, hub, target, f"{path}: output.name")
        if not local or local in (".", "..") or "/" in local or "\\" in local:
            raise HubError(
                f"{where}: output.name gives {local!r}, not a plain directory name",
                kind="bad_manifest",
                path=str(where),
            )
        push_repo = _fill(repo_t, hub, target, f"{path}: output.repo") if repo_t else None
        if push_repo is not None and not (default_backend().valid_repo_id(push_repo) and push_repo.count("/") == 1):
            raise HubError(
                f"{where}: output.repo gives {push_repo!r}, not a repo id org/name",
                kind="bad_manifest",
                path=str(where),
            )
        entry = ManifestEntry(hub.repo, hub.revision, out_root / local, push_repo)
        if entry.key in sources:
            raise HubError(f"{where}: {entry.key} is listed twice", kind="bad_manifest", path=str(where))
        for label, value in (("local output", local), ("target repo", push_repo)):
            if value is not None and (other := names.get(f"{label}:{value}")) is not None:
                raise HubError(
                    f"{where}: {entry.key} and {other} get the same {label} {value!r}; tell them apart in the template "
                    f"({{org}}, {{revision}})",
                    kind="bad_manifest",
                    path=str(where),
                )
            names[f"{label}:{value}"] = entry.key
        sources[entry.key] = entry
    ordered = tuple(sources[k] for k in sorted(sources))
    return Manifest(path, target, out_root, ordered, private, max_shard, check)


def shard_from_env(
    num_shards: int | None, shard_index: int | None, env: Mapping[str, str] = os.environ
) -> tuple[int, int]:
    """(N, K): the options where given (N also from DSV4_NUM_SHARDS), else a Slurm array task
    ((SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP, of
    SLURM_ARRAY_TASK_COUNT) or a Kubernetes indexed Job (JOB_COMPLETION_INDEX, with N from
    --num-shards / DSV4_NUM_SHARDS), else (1, 0). A variable that is set but unusable is a
    ValueError naming it."""

    def number(var: str, *, least: int) -> int:
        try:
            value = int(env[var])
        except ValueError:
            value = None
        if value is None or value < least:
            raise ValueError(f"{var}={env[var]!r} is not {'a positive' if least == 1 else 'a non-negative'} integer")
        return value

    if num_shards is None and NUM_SHARDS_ENV in env:
        num_shards = number(NUM_SHARDS_ENV, least=1)
    if shard_index is None:
        if "SLURM_ARRAY_TASK_ID" in env:
            task = number("SLURM_ARRAY_TASK_ID", least=0)
            low = number("SLURM_ARRAY_TASK_MIN", least=0) if "SLURM_ARRAY_TASK_MIN" in env else 0
            step = number("SLURM_ARRAY_TASK_STEP", least=1) if "SLURM_ARRAY_TASK_STEP" in env else 1
            if task < low or (task - low) % step:
                raise ValueError(
                    f"SLURM_ARRAY_TASK_ID={task} is not in the array SLURM_ARRAY_TASK_MIN={low}, "
                    f"SLURM_ARRAY_TASK_STEP={step} describe"
                )
            shard_index = (task - low) // step
            if num_shards is None and "SLURM_ARRAY_TASK_COUNT" in env:
                num_shards = number("SLURM_ARRAY_TASK_COUNT", least=1)
        elif "JOB_COMPLETION_INDEX" in env:
            shard_index = number("JOB_COMPLETION_INDEX", least=0)
            if num_shards is None:
                raise ValueError(
                    "JOB_COMPLETION_INDEX is set but not the number of shards: pass --num-shards or set "
                    f"{NUM_SHARDS_ENV} to the Job's completions"
                )
        elif num_shards not in (None, 1):
            raise ValueError(
                f"--num-shards {num_shards} needs --shard-index (or SLURM_ARRAY_TASK_ID / JOB_COMPLETION_INDEX)"
            )
        else:
            shard_index = 0
    num_shards = 1 if num_shards is None else num_shards
    if not 0 <= shard_index < num_shards:
        raise ValueError(
            f"shard index {shard_index} is outside 0..{num_shards - 1} (a Slurm array must be a range like 0-7 or "
            "1-15:2)"
        )
    return num_shards, shard_index


def select_shard(sources: Sequence[ManifestEntry], num_shards: int, shard_index: int) -> list[ManifestEntry]:
    """Shard K of N: every N-th source of the sorted list, from K. Each source lands in
    exactly one shard, and shard sizes differ by at most one."""
    return [s for k, s in enumerate(sorted(sources, key=lambda s: s.key)) if k % num_shards == shard_index]


def records(record: ConversionRecord | None, location: str, commit: str, tables: Mapping[str, Table]) -> bool:
    """Whether a conversion.json records a forward conversion of this commit with one of
    `tables` (by name) at its current version. One commit always takes the same table (the
    one for the drafter it holds), so the record's table is the one it would take again."""
    if record is None:
        return False
    table = tables.get(record.table)
    return (
        record.source.location == location
        and record.source.revision == commit
        and record.direction == "forward"
        and table is not None
        and record.table_version == table.version
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
    repo's head when its record was read, with README.md = `card` (convert/card.py) in the
    same commit; returns the commit.

    The backend's upload (convert/hub_protocol.py; the Hugging Face Hub's resumable
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
        now = HubSpec(repo, None, explicit=True)
        landed = resolve_commit(now)
        if (
            landed == head
            or download(now, landed, CONVERSION_RECORD, partial(HubError, kind="push_failed"), missing_ok=True)
            != (out / CONVERSION_RECORD).read_bytes()
        ):
            raise
        return landed


def run_check(out: Path) -> str:
    """Verify `out` with dsv4.convert.check where it is installed; returns its one-line
    summary, or "unavailable". A failed check raises that check's own one-line error."""
    try:
        from dsv4.convert.check import run_checks
    except ModuleNotFoundError as exc:
        if exc.name != "dsv4.convert.check":  # the checker is there but broken: say so
            raise
        return "unavailable"
    report = run_checks(out)
    report.raise_for_failure()
    return report.summary()


class _Job:
    """One source's run; `fetched` is kept up to date so a failure still reports it."""

    def __init__(self, entry: ManifestEntry, manifest: Manifest, tables: Mapping[str, Table], push_to_hub: bool):
        self.entry, self.manifest, self.tables, self.push_to_hub = entry, manifest, tables, push_to_hub
        self.hub = HubSpec(entry.repo, entry.revision, explicit=True)  # a manifest names hub repositories only
        self.commit: str | None = None
        self.fetched = 0

    def run(self) -> tuple[str, dict[str, Any]]:
        entry, tables = self.entry, self.tables
        self.commit = commit = resolve_commit(self.hub)
        target = entry.push_repo if self.push_to_hub else None  # run_batch refuses --push without output.repo
        head, pushed = pushed_record(target) if target else (None, None)
        if target and records(pushed, self.hub.location, commit, tables):
            return "skipped", {"reason": f"{HUB_SCHEME}{target} already records {_what(pushed)}"}
        local = ConversionRecord.find(entry.output)
        if records(local, self.hub.location, commit, tables):
            if not target:
                return "skipped", {"reason": f"{entry.output} already records {_what(local)}"}
            conversion, table = "reused", tables[local.table]
        else:
            with open_source(HubSpec(entry.repo, commit, explicit=True)) as source:
                header_bytes = self.fetched = source.inventory.header_bytes
                plan = plan_source(source, self.manifest.target)
                try:
                    # replacing is safe only over an earlier conversion (it has a conversion.json), never
                    # over anything else
                    result = run_plan(
                        plan,
                        source,
                        entry.output,
                        overwrite=(entry.output / CONVERSION_RECORD).exists(),
                        max_shard_size=self.manifest.max_shard_size,
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
            card = model_card(target, entry.repo, commit, table)
            row["pushed"] = {
                "repo": target,
                "commit": push(entry.output, target, message, description, self.manifest.private, head, card),
            }
        return "converted", row


def _what(record: ConversionRecord) -> str:
    """A conversion record that `records` accepted, as a skip reason names it."""
    return f"source commit {(record.source.revision or '')[:12]} with table {record.table} v{record.table_version}"


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
    mine = select_shard(manifest.sources, num_shards, shard_index)
    report_path = report_path or default_report_path(manifest, num_shards, shard_index)
    report: dict[str, Any] = {
        "tool": "dsv4-convert",
        "tool_version": __version__,
        "manifest": str(manifest.path),
        "started": started,
        "target": manifest.target,
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
            job = _Job(entry, manifest, tables, push_to_hub)
            t0 = time.monotonic()
            try:
                outcome, row = job.run()
            except Exception as exc:  # one repo's failure, whatever it is, must not stop the others
                interrupts.raise_if_interrupted()  # but a signal stops them all, whatever error it caused
                outcome = "failed"
                code = exit_code(exc)
                reason = (
                    str(exc)
                    if isinstance(exc, DSV4Error)
                    else f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
                )
                row = {
                    "reason": reason,
                    "error": type(exc).__name__,
                    "exit_code": code,
                    **(exc.fields() if isinstance(exc, DSV4Error) else {}),
                }
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
