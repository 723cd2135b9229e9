"""Running a Plan: the executor, and the run that owns OUT (convert/output.py) while it
plans, writes and publishes.

Work happens in a hidden partial directory beside OUT with a journal of finished tensors;
OUT appears (one rename) only once every tensor is written and the result is verified.
A run killed at any point resumes from the journal and gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dsv4 import __version__
from dsv4.convert.errors import SourceNotFoundError, WriteFailedError
from dsv4.convert.inventory import INDEX_NAME, Inventory, read_inventory, read_local_header
from dsv4.convert.output import CONFIG, CONVERSION_RECORD, TOOL, OutputClaim, claim_output, write_json
from dsv4.convert.plan import LAYOUT_RECORD, Plan, PlannedTensor, plan_conversion, plan_reverse
from dsv4.convert.source import ByteReader, LocalReader
from dsv4.convert.writer import ShardWriter, TensorSpec, shard_name
from dsv4.mapping.table import Table, load_table
from dsv4.model import strictjson

CHUNK = 16 * 1024 * 1024  # bytes per read/write: large enough for full disk speed
DEFAULT_MAX_SHARD = 5 * 10**9
# Test hook: SIGKILL this process once the output stream (tensors in write order, those
# finished by an earlier run included) reaches this byte, so tests can prove that a run
# killed anywhere resumes to byte-identical output.
CRASH_AFTER_ENV = "DSV4_CRASH_AFTER_BYTES"
HUB_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


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


def local_source(source: str | Path) -> Path | None:
    """The directory of a local source; None for a hub repo id; neither is exit 19."""
    path = Path(source)
    if path.exists():
        return path
    if not HUB_REPO.fullmatch(str(source)):
        raise SourceNotFoundError(f"{source}: no such checkpoint directory (nor a hub repo id org/name[@revision])")
    return None


def open_source(source: str | Path) -> tuple[Inventory, ByteReader]:
    """A local checkpoint directory, or a hub repo `org/name[@revision]`."""
    path = local_source(source)
    if path is not None:
        return read_inventory(path), LocalReader(path)
    from dsv4.convert.hub import open_hub_source  # only hub sources need the network code

    return open_hub_source(str(source))


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


def output_config(plan: Plan) -> dict[str, Any]:
    from dsv4.convert.quant import carried_quantization  # used by this function alone

    config = {k: v for k, v in plan.config.items() if k != LAYOUT_RECORD}
    # a compressed-tensors config names modules: rewritten to the draft's layer names
    # (forward) or restored from the record (reverse); an FP8 block config goes through as is
    quantization, note = carried_quantization(plan)
    if quantization is not None:
        config["quantization_config"] = quantization
    if plan.direction == "forward":
        config[LAYOUT_RECORD] = {"layout": plan.target, "table": plan.table, "table_version": plan.table_version, "tool_version": __version__}
        if note is not None:
            config[LAYOUT_RECORD]["quantization_config"] = note
    return config


def _fingerprint(plan: Plan, reader: ByteReader, shards: list[list[PlannedTensor]]) -> dict[str, Any]:
    layout = [[(t.name, t.dtype, list(t.shape), [(p.file, p.start, p.end) for p in t.pieces]) for t in s] for s in shards]
    return {
        "tool_version": __version__,
        "direction": plan.direction,
        "table": plan.table,
        "table_version": plan.table_version,
        "source": {**reader.fingerprint(plan.files_needed), "revision": plan.revision},
        "plan_sha256": hashlib.sha256(json.dumps(layout).encode()).hexdigest(),
    }


def read_record(path: Path) -> dict[str, Any] | None:
    """A JSON object record (conversion.json, the resume state), parsed strictly; None if
    absent, unreadable, not strict JSON or not an object: such a file records nothing."""
    try:
        record = strictjson.loads(path.read_bytes())
    except (OSError, strictjson.StrictJSONError):
        return None
    return record if isinstance(record, dict) else None


def _journal(path: Path) -> dict[str, dict[str, Any]]:
    """Finished tensors; a line torn by a kill is ignored (that tensor is redone)."""
    done: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
                done[entry["name"]] = entry
            except (ValueError, KeyError, TypeError):
                continue
    return done


def _all_zero(chunk: memoryview) -> bool:
    # a run of zeros (a sparse source, or data that really is zero) is left as a hole in
    # the output, as `cp --sparse=auto` does; the byte test is cheap next to the write
    return chunk[0] == 0 and chunk[-1] == 0 and not torch.frombuffer(chunk, dtype=torch.uint8).any()


@dataclass(frozen=True)
class _Chunk:
    """At most CHUNK bytes of one piece of one tensor."""

    tensor: PlannedTensor
    file: str
    offset: int  # in the source file
    n: int
    at: int  # in the output tensor
    last: bool  # the tensor's final chunk


def _chunks(tensors: list[PlannedTensor]) -> list[_Chunk]:
    out = []
    for t in tensors:
        spans = [(p.file, off, min(CHUNK, p.end - off)) for p in t.pieces for off in range(p.start, p.end, CHUNK)] or [("", 0, 0)]
        at = 0
        for k, (file, off, n) in enumerate(spans):
            out.append(_Chunk(t, file, off, n, at, k == len(spans) - 1))
            at += n
    return out


class _Executor:
    """Copies planned byte ranges to their final place in a shard, hashing each tensor.

    Three stages overlap: reader threads fill buffers ahead (source reads never wait for
    output writes), the main thread writes, a hasher thread checksums (hashlib and file
    I/O release the GIL). A local disk gets one reader, reading each file front to back;
    a hub reader asks for several (its requests are latency-bound). `depth` buffers of CHUNK
    bytes bound the memory whatever the size of the checkpoint."""

    def __init__(self, reader: ByteReader, progress: Callable[[int], object], position: int = 0):
        self.reader = reader
        self.progress = progress
        readers = getattr(reader, "parallel_reads", 1)
        self.depth = readers + 3  # reads in flight, plus the chunk being written and hashed
        self.buffers = [memoryview(bytearray(CHUNK)) for _ in range(self.depth)]
        self.reads = ThreadPoolExecutor(max_workers=readers)
        self.hashes = ThreadPoolExecutor(max_workers=1)  # one hasher: digest updates stay in order
        self.written = 0
        self.position = position  # bytes of the output stream done, earlier runs included
        crash = os.environ.get(CRASH_AFTER_ENV)
        self.crash_after = int(crash) if crash else None

    def run(self, tensors: list[PlannedTensor], writer: ShardWriter) -> Iterator[tuple[PlannedTensor, str]]:
        """Write `tensors` into `writer`; yields each finished tensor with its sha256."""
        chunks = _chunks(tensors)
        hashed: list[Future[None] | None] = [None] * self.depth
        reads: dict[int, Future[None]] = {}
        digests: dict[str, Any] = {}

        def start_read(k: int) -> None:
            slot = k % self.depth
            if hashed[slot] is not None:
                hashed[slot].result()  # the buffer's previous chunk is hashed (and written)
            c = chunks[k]
            reads[k] = self.reads.submit(self.reader.read_into, c.file, c.offset, self.buffers[slot][: c.n])

        for k in range(min(self.depth - 1, len(chunks))):
            start_read(k)
        for k, c in enumerate(chunks):
            if k + self.depth - 1 < len(chunks):
                start_read(k + self.depth - 1)
            reads.pop(k).result()
            view = self.buffers[k % self.depth][: c.n]
            digest = digests.setdefault(c.tensor.name, hashlib.sha256())
            hashed[k % self.depth] = self.hashes.submit(digest.update, view)
            if c.n and not _all_zero(view):
                writer.write(c.tensor.name, view, c.at)
            self.written += c.n
            self.position += c.n
            self.progress(c.n)
            if self.crash_after is not None and self.position >= self.crash_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if c.last:
                hashed[k % self.depth].result()  # FIFO: every update of this tensor is done
                yield c.tensor, digests.pop(c.tensor.name).hexdigest()

    def close(self) -> None:
        self.reads.shutdown()
        self.hashes.shutdown()


def _still_valid(path: Path, entries: list[dict[str, Any]], offsets: dict[str, int]) -> set[str]:
    """Journaled tensors whose bytes in a resumed shard still hash as recorded. The journal
    is not fsynced per tensor (a kill -9 loses nothing the kernel already holds), so after
    a crash of the machine itself a journaled tensor may be stale: it is then redone."""
    ok = set()
    with open(path, "rb") as f:
        for e in entries:
            f.seek(offsets[e["name"]])
            digest, left = hashlib.sha256(), e["nbytes"]
            while left:
                block = f.read(min(CHUNK, left))
                if not block:
                    break
                digest.update(block)
                left -= len(block)
            if not left and digest.hexdigest() == e["sha256"]:
                ok.add(e["name"])
    return ok


def _verify(partial: Path, shards: list[list[PlannedTensor]], names: list[str], journal: dict[str, dict[str, Any]]) -> None:
    """Re-read every written header and check it against the plan and the journal."""
    for tensors, name in zip(shards, names):
        found, _ = read_local_header(partial / name)
        for t in tensors:
            src = found.get(t.name)
            if src is None or (src.dtype, src.shape, src.nbytes) != (t.dtype, t.shape, t.nbytes):
                raise WriteFailedError(f"{partial / name}: tensor {t.name} does not read back as planned")
            if t.name not in journal:
                raise WriteFailedError(f"{partial / name}: tensor {t.name} was never finished")


def run_plan(plan: Plan, reader: ByteReader, out: str | Path, *, overwrite: bool = False, wait: bool = False, max_shard_size: int = DEFAULT_MAX_SHARD, quiet: bool = True) -> ConversionResult:
    """Write an already made plan into OUT, owning OUT (its lock) from here to publish;
    the reader is closed at the end. `convert` takes OUT before it plans."""
    try:
        with claim_output(out, source=_local_root(reader), wait=wait, on_wait=_waiting_notice(quiet)) as claim:
            return _write_output(plan, reader, claim, overwrite=overwrite, max_shard_size=max_shard_size, quiet=quiet)
    finally:
        reader.close()


def _local_root(reader: ByteReader) -> Path | None:
    return reader.root if isinstance(reader, LocalReader) else None


def _waiting_notice(quiet: bool) -> Callable[[str], object] | None:
    return None if quiet else lambda line: print(line, file=sys.stderr, flush=True)


def _write_output(plan: Plan, reader: ByteReader, claim: OutputClaim, *, overwrite: bool, max_shard_size: int, quiet: bool) -> ConversionResult:
    """Convert `plan` into the claimed OUT: nothing if it is up to date, else in the
    partial directory (resuming its work), then publish."""
    start = time.monotonic()
    config = output_config(plan)  # before any byte is written: a config that cannot be carried fails here
    shards = shard_layout(plan, max_shard_size)
    names = [shard_name(k, len(shards)) for k in range(len(shards))]
    fingerprint = _fingerprint(plan, reader, shards)

    record = read_record(claim.path / CONVERSION_RECORD) if claim.path.is_dir() else None
    if isinstance(record, dict) and record.get("fingerprint") == fingerprint and not overwrite:
        return ConversionResult(claim.out, "up-to-date", 0, 0, time.monotonic() - start, len(plan.tensors), plan)
    claim.refuse_unless_replaceable(overwrite)

    try:
        resumed = claim.start(fingerprint)
        journal = _journal(claim.journal) if resumed else {}
    except OSError as exc:
        raise claim.write_failed(exc) from None
    partial = claim.partial

    todo = sum(t.nbytes for s in shards for t in s if t.name not in journal)
    bar = tqdm(total=todo, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", disable=quiet)
    executor = _Executor(reader, bar.update, position=plan.bytes_to_write - todo)
    try:
        with open(claim.journal, "a") as jf:
            for tensors, name in zip(shards, names):
                specs = [TensorSpec(t.name, t.dtype, t.shape) for t in tensors]
                with ShardWriter(partial / name, specs, {"format": "pt"}, resume=resumed) as writer:
                    done = [journal[t.name] for t in tensors if t.name in journal]
                    valid = _still_valid(writer.path, done, writer.offsets) if writer.resumed else set()
                    for t in tensors:
                        if t.name in journal and t.name not in valid:
                            del journal[t.name]
                    for t, sha in executor.run([t for t in tensors if t.name not in journal], writer):
                        entry = {"name": t.name, "file": name, "nbytes": t.nbytes, "sha256": sha}
                        jf.write(json.dumps(entry, sort_keys=True) + "\n")
                        jf.flush()
                        journal[t.name] = entry
                    writer.sync()
        # the journal is closed: nothing writes into the partial directory once it is OUT
        _verify(partial, shards, names, journal)
        _write_records(plan, config, partial, shards, names, journal, fingerprint)
        claim.publish()
    except OSError as exc:
        raise claim.write_failed(exc) from None
    finally:
        bar.close()
        executor.close()
    return ConversionResult(claim.out, "resumed" if resumed else "converted", reader.bytes_read, executor.written, time.monotonic() - start, len(plan.tensors), plan)


def _write_records(plan: Plan, config: dict[str, Any], partial: Path, shards: list[list[PlannedTensor]], names: list[str], journal: dict[str, dict[str, Any]], fingerprint: dict[str, Any]) -> None:
    weight_map = {t.name: name for tensors, name in zip(shards, names) for t in tensors}
    write_json(partial / INDEX_NAME, {"metadata": {"total_size": plan.bytes_to_write}, "weight_map": weight_map})
    write_json(partial / CONFIG, config)
    write_json(
        partial / CONVERSION_RECORD,
        {
            "tool": TOOL,
            "tool_version": __version__,
            "direction": plan.direction,
            "table": plan.table,
            "table_version": plan.table_version,
            "target": plan.target,
            "source": fingerprint["source"],
            "fingerprint": fingerprint,
            "skipped": len(plan.skipped),
            "tensors": {t.name: {"file": journal[t.name]["file"], "nbytes": t.nbytes, "sha256": journal[t.name]["sha256"]} for s in shards for t in s},
        },
    )


def plan_source(inv: Inventory, reader: ByteReader, table: Table, *, reverse: bool = False) -> Plan:
    """Plan the conversion of an opened source; the reader is closed when planning fails."""
    try:
        return plan_reverse(inv, table) if reverse else plan_conversion(inv, table)
    except BaseException:
        reader.close()
        raise


def convert(source: str | Path, out: str | Path, *, target: str = "xpu", reverse: bool = False, overwrite: bool = False, wait: bool = False, max_shard_size: int = DEFAULT_MAX_SHARD, quiet: bool = True) -> ConversionResult:
    """Convert `source` (native checkpoint, or with reverse=True a converted one) into `out`.

    OUT is owned (checked safe, locked) before the source is planned and until the output
    is published; with `wait` a run finding OUT locked waits for the other run."""
    table = load_table(target)
    with claim_output(out, source=local_source(source), wait=wait, on_wait=_waiting_notice(quiet)) as claim:
        inv, reader = open_source(source)
        plan = plan_source(inv, reader, table, reverse=reverse)
        try:
            return _write_output(plan, reader, claim, overwrite=overwrite, max_shard_size=max_shard_size, quiet=quiet)
        finally:
            reader.close()
