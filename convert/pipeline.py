"""Running a Plan: the executor, and the run that owns OUT (convert/output.py) while it
plans, writes and publishes. The caller holds the Source (convert/sources/source.py) open around it.

Work happens in a hidden partial directory beside OUT with a journal of finished tensors;
OUT appears (one rename) only once every tensor is written and the result is verified.
A run killed at any point resumes from the journal and gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from dsv4 import __version__
from dsv4.convert import progress
from dsv4.convert.choose import Direction, choose_table
from dsv4.convert.errors import OutputError, PlanError
from dsv4.convert.execute import Executor
from dsv4.convert.journal import open_shards, read_journal, run_jobs
from dsv4.convert.outpath import resolve_output
from dsv4.convert.output import OutputClaim, claim_output
from dsv4.convert.plan import Plan, PlannedTensor, plan_conversion, plan_reverse
from dsv4.convert.quant_config import carried_quantization
from dsv4.convert.routes import apply_route
from dsv4.convert.served import measure_agreement, serve_object
from dsv4.convert.serving import (
    Served,
    Serving,
    Superseded,
    decide_serving,
    draft_config,
    provisional_serving,
    serve_identity,
    serving_output,
    settled,
    write_serve_files,
)
from dsv4.convert.sources.location import locate, open_source
from dsv4.convert.sources.source import HubSpec, Source, local_root
from dsv4.convert.writer import shard_name
from dsv4.mapping.targets import default_target, require_target
from dsv4.model import strictjson
from dsv4.model.checkpoint import CONFIG, INDEX_NAME, read_local_header
from dsv4.model.record import (
    LAYOUT_RECORD,
    ConversionRecord,
    LayoutRecord,
    SourceRecord,
    TensorEntry,
    fingerprint_digest,
    runtime_config_fields,
    sha256_hex,
)
from dsv4.model.strictjson import write_bytes, write_record

if TYPE_CHECKING:
    from huggingface_hub.utils import tqdm

DEFAULT_MAX_SHARD = 5 * 10**9
# refusals mid-run after which the partial directory is dropped: a source file that changed
# (its tensors may hold bytes of either version, a rerun starts over), and a computed tensor
# that cannot be made exactly (the same source refuses the same block again: nothing to resume)
DISCARDED = ("source_changed", "inexact_transform", "non_finite_agreement")


@dataclass
class ConversionResult:
    out: Path
    status: str  # "converted", "resumed" or "up-to-date"
    bytes_read: int
    bytes_written: int
    seconds: float
    tensors: int
    plan: Plan

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "output": str(self.out),
            "tensors": self.tensors,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "bytes_planned": self.plan.bytes_to_read,
            "seconds": round(self.seconds, 3),
        }


def shard_layout(plan: Plan, max_shard_size: int) -> list[list[PlannedTensor]]:
    """Tensors in write order, cut into shards of at most max_shard_size bytes (a larger
    tensor gets a shard of its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in plan.tensors:
        if shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def output_config(plan: Plan, served: Served | None = None) -> dict[str, Any] | bytes:
    """The output's config.json: the source's bytes unchanged for a table whose [table]
    config is "source" (a draft directory: the runtimes read it as the target's), or with the
    quantisation config a serving target has the draft built with (`served`); else the
    source's fields plus the layout record (forward) or without it (reverse)."""
    if plan.direction == "forward" and plan.config_kind == "source":
        return plan.config_bytes if served is None else draft_config(plan, served)
    config = {k: v for k, v in plan.config.items() if k != LAYOUT_RECORD}
    # a compressed-tensors config names modules: rewritten to the draft's layer names
    # (forward) or restored from the record (reverse); an FP8 block config goes through as is
    quantization, note = carried_quantization(plan)
    if quantization is not None:
        config["quantization_config"] = quantization
    if plan.direction == "forward":
        config[LAYOUT_RECORD] = LayoutRecord(plan.target, plan.table, plan.table_version, __version__, note).to_json()
    return config


def _fingerprint(
    plan: Plan, source: Source, shards: list[list[PlannedTensor]], serve: dict[str, Any] | None = None
) -> dict[str, Any]:
    layout = [
        [
            (t.name, t.dtype, list(t.shape), [(p.file, p.start, p.end) for p in t.pieces])
            + ((t.transform.to_json(),) if t.transform is not None else ())
            for t in s
        ]
        for s in shards
    ]
    return {
        "tool_version": __version__,
        "direction": plan.direction,
        "table": plan.table,
        "table_version": plan.table_version,
        "source": {**source.reader.fingerprint(plan.files_needed), "revision": plan.revision},
        "plan_sha256": hashlib.sha256(json.dumps(layout).encode()).hexdigest(),
        # the output's config.json is made from it (a draft directory's is it, byte for byte)
        "config_sha256": sha256_hex(plan.config_bytes),
        # a draft for a serving target (its record: the target's config, the route, OUT/serve/'s
        # files): another target, route or launch command is another output
        **({"serve": serve} if serve is not None else {}),
    }


def _verify(
    partial: Path, shards: list[list[PlannedTensor]], names: list[str], journal: dict[str, dict[str, Any]]
) -> None:
    """Re-read every written header and check it against the plan and the journal."""
    for tensors, name in zip(shards, names, strict=True):
        found, _ = read_local_header(partial / name)
        for t in tensors:
            src = found.get(t.name)
            if src is None or (src.dtype, src.shape, src.nbytes) != (t.dtype, t.shape, t.nbytes):
                raise OutputError(
                    f"{partial / name}: tensor {t.name} does not read back as planned",
                    kind="write_failed",
                    path=str(partial / name),
                    tensor=t.name,
                )
            if t.name not in journal:
                raise OutputError(
                    f"{partial / name}: tensor {t.name} was never finished",
                    kind="write_failed",
                    path=str(partial / name),
                    tensor=t.name,
                )


def run_plan(
    plan: Plan,
    source: Source,
    out: str | Path,
    *,
    overwrite: bool = False,
    wait: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD,
    quiet: bool = True,
    served: Served | None = None,
) -> ConversionResult:
    """Write a plan already made of open `source` (routed for `served`, when given) into OUT,
    owning OUT (its lock) from here to publish. `convert` takes OUT before it plans."""
    with claim_output(out, source=source.local_root, wait=wait, on_wait=_waiting_notice(quiet)) as claim:
        return _write_output(
            plan, source, claim, overwrite=overwrite, max_shard_size=max_shard_size, quiet=quiet, served=served
        )


def _waiting_notice(quiet: bool) -> Callable[[str], object] | None:
    return None if quiet else lambda line: print(line, file=sys.stderr, flush=True)


def progress_bar(total: int, done: int, quiet: bool) -> tqdm:
    """The bar over the output stream (tensors in write order); `done`: bytes an earlier run
    finished. Drawn only on a terminal, and not when HF_HUB_DISABLE_PROGRESS_BARS is set
    (huggingface_hub's tqdm). The kill tests wrap this function (tests/crashing_cli.py)."""
    return progress.bar(total, "convert", "B", quiet, initial=done)


def _up_to_date(claim: OutputClaim, fingerprint: dict[str, Any], overwrite: bool) -> bool:
    """OUT already holds this conversion (and --overwrite does not ask to redo it)."""
    record = ConversionRecord.find(claim.path) if claim.path.is_dir() else None
    return record is not None and record.fingerprint == fingerprint_digest(fingerprint) and not overwrite


class _OutputLayout(NamedTuple):
    config: dict[str, Any] | bytes | None  # the output's config.json; a served draft's once its plan is final
    shards: list[list[PlannedTensor]]
    names: list[str]  # the shards' file names
    fingerprint: dict[str, Any]


def _output_layout(plan: Plan, source: Source, served: Served | None, out: Path, max_shard_size: int) -> _OutputLayout:
    """What a run of `plan` writes into OUT (at `out`), before any byte is written: a config
    that cannot be carried fails here."""
    shards = shard_layout(plan, max_shard_size)
    names = [shard_name(k, len(shards)) for k in range(len(shards))]
    config, serve = (output_config(plan), None) if served is None else (None, serve_identity(served, out))
    return _OutputLayout(config, shards, names, _fingerprint(plan, source, shards, serve))


def _write_output(
    plan: Plan,
    source: Source,
    claim: OutputClaim,
    *,
    overwrite: bool,
    max_shard_size: int,
    quiet: bool,
    served: Served | None = None,
) -> ConversionResult:
    """Convert `plan` into the claimed OUT: nothing if it is up to date, else in the
    partial directory (resuming its work), then publish. With `serve` (a draft plan's
    ServePlan) the draft is written as its route makes it (convert/routes.py)."""
    start = time.monotonic()
    config, shards, names, fingerprint = _output_layout(plan, source, served, claim.path, max_shard_size)

    if _up_to_date(claim, fingerprint, overwrite):
        return ConversionResult(claim.out, "up-to-date", 0, 0, time.monotonic() - start, len(plan.tensors), plan)
    claim.refuse_unless_replaceable(overwrite)

    try:
        resumed = claim.start(fingerprint)
        journal = read_journal(claim.journal) if resumed else {}
    except OSError as exc:
        raise claim.write_failed(exc) from None
    partial = claim.partial

    shard_of = {t.name: name for tensors, name in zip(shards, names, strict=True) for t in tensors}
    todo = sum(t.nbytes for s in shards for t in s if t.name not in journal)
    bar = progress_bar(plan.bytes_to_write, plan.bytes_to_write - todo, quiet)
    executor = Executor(source.reader, bar.update)
    try:
        with open(claim.journal, "a") as jf, ExitStack() as opened:
            jobs, writers = open_shards(claim, opened, shards, names, journal, resumed)
            run_jobs(executor, jobs, shard_of, jf, journal)
            for writer in writers:
                writer.sync()
        # the journal is closed: nothing writes into the partial directory once it is OUT
        _verify(partial, shards, names, journal)
        if served is not None:  # its final plan: a refusal leaves no partial directory, as before writing
            served = settled(served, claim.discard_partial)
            config = output_config(plan, served)
        published = _published_source(plan, source, fingerprint)
        serving = serving_output(served, claim.path)
        _write_records(
            plan, config, partial, shards, names, journal, fingerprint, published, serving, source.local_root
        )
        source.reader.verify_unchanged([CONFIG, INDEX_NAME, *plan.files_needed])
        claim.publish()
    except PlanError as exc2:
        if exc2.kind not in DISCARDED:
            raise
        claim.discard_partial()
        raise
    except OSError as exc:
        raise claim.write_failed(exc) from None
    finally:
        bar.close()
        executor.close()
    return ConversionResult(
        claim.out,
        "resumed" if resumed else "converted",
        source.reader.bytes_read,
        executor.written,
        time.monotonic() - start,
        len(plan.tensors),
        plan,
    )


def _published_source(plan: Plan, source: Source, fingerprint: dict[str, Any]) -> SourceRecord:
    """The source as conversion.json names it: a hub repo and commit, or a local
    directory's name (not its path: a pushed output would publish it), the sizes of the
    files read and the sha256 of the config.json read. The sizes are the run's fingerprint's,
    taken before the first read, not asked of the source again: a source deleted meanwhile
    is the refusal that follows (`verify_unchanged`, 36), not an OSError here."""
    root = source.local_root
    location = root.resolve().name if root is not None else plan.location
    sizes = fingerprint["source"]["files"]
    return SourceRecord(
        location, plan.revision, dict(sizes), sha256_hex(plan.config_bytes) if plan.config_bytes else None
    )


def _write_records(
    plan: Plan,
    config: dict[str, Any] | bytes,
    partial: Path,
    shards: list[list[PlannedTensor]],
    names: list[str],
    journal: dict[str, dict[str, Any]],
    fingerprint: dict[str, Any],
    published: SourceRecord,
    serving: tuple[dict[str, bytes], dict[str, Any]] | None = None,
    native: Path | None = None,
) -> None:
    """The index, config.json, OUT/serve/'s files, then conversion.json (last: a lossy draft's
    agreement with `native`, the local source, is measured on the files before it)."""
    weight_map = {t.name: name for tensors, name in zip(shards, names, strict=True) for t in tensors}
    write_record(partial / INDEX_NAME, {"metadata": {"total_size": plan.bytes_to_write}, "weight_map": weight_map})
    if isinstance(config, bytes):
        write_bytes(partial / CONFIG, config)
    else:
        write_record(partial / CONFIG, config)
    if serving is not None:
        write_serve_files(serving[0], partial)
    ConversionRecord(
        tool_version=__version__,
        direction=plan.direction,
        identity=plan.identity,
        source=published,
        fingerprint=fingerprint_digest(fingerprint),
        tensors={
            t.name: TensorEntry(journal[t.name]["file"], t.nbytes, journal[t.name]["sha256"]) for s in shards for t in s
        },
        config=plan.config_kind if plan.direction == "forward" else "record",
        skipped=len(plan.skipped),
        config_fields=runtime_config_fields(
            strictjson.loads(config) if isinstance(config, bytes) else config
        ),  # as written
        serve=serve_object(
            plan, journal, serving[1] if serving is not None else None, measure_agreement(plan, partial, native)
        ),
    ).write(partial)


def plan_source(source: Source, target: str, *, reverse: bool = False) -> Plan:
    """Plan the conversion of open `source` to `target` with the table for the draft
    layout it holds (MTP or DSpark)."""
    direction: Direction = "reverse" if reverse else "forward"
    table = choose_table(target, source.inventory, direction, convertible=True)
    return plan_reverse(source.inventory, table) if reverse else plan_conversion(source.inventory, table)


def plan_served(
    source: Source, plan: Plan, serving: Serving | None, *, provisional: bool = False
) -> tuple[Plan, Served | None]:
    """Draft plan `plan` of open `source` made to serve beside `serving`'s target: each draft
    module's scheme under the target's config (convert/serving.py), and the plan routed to
    write what those schemes take (convert/routes.py). Without `serving`, `plan` as it is.
    `provisional`: the plan read without the library, which reads it meanwhile (convert/verdict.py)."""
    if serving is None:
        return plan, None
    early = provisional_serving(source.inventory, plan, serving) if provisional else None
    served = early or decide_serving(source.inventory, plan, serving)
    return apply_route(plan, served.plan), served


def convert(
    typed: str | Path | HubSpec,
    out: str | Path,
    *,
    target: str | None = None,
    reverse: bool = False,
    overwrite: bool = False,
    wait: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD,
    quiet: bool = True,
    serving: Serving | None = None,
) -> ConversionResult:
    """Convert the source `typed` names (native checkpoint, or with reverse=True a converted
    one) into `out`; with `serving` (a --target draft conversion), the draft to serve beside
    its target.

    OUT is owned (checked safe, locked) before the source is opened and until the output
    is published; with `wait` a run finding OUT locked waits for the other run. `target`:
    --target's default (mapping/targets/*.toml `default = true`) when None."""
    target = target or default_target()
    require_target(target)  # a bad name is refused before OUT is touched
    where = locate(typed)
    with (
        claim_output(out, source=local_root(where), wait=wait, on_wait=_waiting_notice(quiet)) as claim,
        open_source(where, quiet=quiet) as source,
    ):
        draft = plan_source(source, target, reverse=reverse)
        plan, served = plan_served(source, draft, serving, provisional=True)
        written = {"overwrite": overwrite, "max_shard_size": max_shard_size, "quiet": quiet}
        try:
            return _write_output(plan, source, claim, served=served, **written)
        except Superseded as exc:
            return _write_output(apply_route(draft, exc.served.plan), source, claim, served=exc.served, **written)
        finally:
            if served is not None and served.verdict is not None:
                served.verdict.close()  # a run that ended before its verdict was wanted


class DryRun(NamedTuple):
    plan: Plan
    would: str  # what would become of OUT: "up-to-date", "create" or "replace"
    header_bytes: int  # read from the source to plan
    served: Served | None = None  # the serve plan, for a draft to serve beside a target


def dry_run(
    typed: str | Path | HubSpec,
    out: str | Path,
    *,
    target: str | None = None,
    reverse: bool = False,
    overwrite: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD,
    serving: Serving | None = None,
) -> DryRun:
    """What `convert` with these arguments would do, refusals included, without writing,
    locking or deleting anything: the same checks in the same order (target, OUT's safety
    43-46, the source and its plan, a quantisation config that cannot be carried, an OUT
    that is not empty 41 or not replaceable 48). Another run holding OUT's lock is not looked for."""
    target = target or default_target()
    require_target(target)
    where = locate(typed)
    claim = OutputClaim(Path(out), resolve_output(Path(out), local_root(where)))
    with open_source(where) as source:
        plan, served = plan_served(source, plan_source(source, target, reverse=reverse), serving)
        fingerprint = _output_layout(plan, source, served, claim.path, max_shard_size).fingerprint
        header_bytes = source.inventory.header_bytes
    if _up_to_date(claim, fingerprint, overwrite):
        return DryRun(plan, "up-to-date", header_bytes, served)
    claim.refuse_unless_replaceable(overwrite)
    would = "replace" if os.path.lexists(claim.path) and any(claim.path.iterdir()) else "create"
    return DryRun(plan, would, header_bytes, served)
