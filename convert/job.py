"""Running a Plan: the executor, and the run that owns OUT (convert/output.py) while it
plans, writes and publishes.

Work happens in a hidden partial directory beside OUT with a journal of finished tensors;
OUT appears (one rename) only once every tensor is written and the result is verified.
A run killed at any point resumes from the journal and gives byte-identical files.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import json
import mmap
import os
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dsv4 import __version__
from dsv4.convert.errors import SourceNotFoundError, WriteFailedError
from dsv4.convert.inventory import INDEX_NAME, Inventory, read_inventory, read_local_header
from dsv4.convert.output import CONFIG, CONVERSION_RECORD, TOOL, OutputClaim, claim_output, read_record, write_json
from dsv4.convert.plan import LAYOUT_RECORD, Direction, Plan, PlannedTensor, choose_table, plan_conversion, plan_reverse
from dsv4.convert.source import ByteReader, LocalReader
from dsv4.convert.writer import ShardWriter, TensorSpec, shard_name
from dsv4.mapping.table import require_target
from dsv4.model import strictjson

CHUNK = 8 * 1024 * 1024  # bytes per read/write: large enough for full disk speed
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


def _journal(path: Path) -> dict[str, dict[str, Any]]:
    """Finished tensors; a line torn by a kill is ignored (that tensor is redone)."""
    done: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_bytes().splitlines():
            try:
                entry = strictjson.loads(line)
            except strictjson.StrictJSONError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("nbytes"), int) and isinstance(entry.get("sha256"), str):
                done[entry["name"]] = entry
    return done


# libc's memcmp, for the zero test: the standard library has no fast "all zero" test
# (bytes comparison and bytearray.count run at 1-2 GB/s, memcmp at > 20 GB/s), numpy is no
# dependency and importing torch for it would cost a second of start-up
_memcmp = ctypes.CDLL(None).memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def _all_zero(chunk: memoryview) -> bool:
    """Whether every byte of `chunk` (a writable buffer) is zero.

    A run of zeros (a sparse source, or data that really is zero) is left as a hole in the
    output, as `cp --sparse=auto` does. Real data almost never has a zero at both ends, so
    it costs two byte reads; a zero run costs one memcmp of the chunk against itself shifted
    by one byte (all bytes equal their successor and the first is zero), no zero buffer."""
    n = len(chunk)
    if n == 0 or chunk[0] != 0 or chunk[-1] != 0:
        return False
    start = ctypes.addressof(ctypes.c_char.from_buffer(chunk))
    return _memcmp(start, start + 1, n - 1) == 0


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


class _Hashers:
    """A pool of hasher threads in which each tensor keeps ONE sha256 over its bytes in
    order: a tensor's chunks all go to one single-thread lane (FIFO), different tensors
    hash at once in different lanes. hashlib releases the GIL for large updates, so lanes
    really run in parallel; one lane alone (1.2-2 GB/s) is slower than a fast disk."""

    def __init__(self, lanes: int):
        self.lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") for _ in range(lanes)]
        self.queued = [0] * lanes  # bytes submitted and not yet hashed, per lane
        self.lock = threading.Lock()  # guards `queued`, updated by the caller and the lanes
        self.lane_of: dict[str, int] = {}
        self.digests: dict[str, Any] = {}

    def submit(self, name: str, view: memoryview) -> Future[None]:
        lane = self.lane_of.get(name)
        if lane is None:  # a new tensor goes to the least busy lane
            with self.lock:
                lane = self.lane_of[name] = min(range(len(self.lanes)), key=self.queued.__getitem__)
            self.digests[name] = hashlib.sha256()
        with self.lock:
            self.queued[lane] += len(view)
        return self.lanes[lane].submit(self._update, lane, self.digests[name], view)

    def _update(self, lane: int, digest: Any, view: memoryview) -> None:
        digest.update(view)
        with self.lock:
            self.queued[lane] -= len(view)

    def hexdigest(self, name: str) -> str:
        """Once the tensor's last update has finished."""
        del self.lane_of[name]
        return self.digests.pop(name).hexdigest()

    def close(self) -> None:
        for lane in self.lanes:
            lane.shutdown()


def hasher_lanes() -> int:
    """Hasher threads: enough for disk speed (four lanes hash at 5-8 GB/s), never more than
    the cores this process may use."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


class _Executor:
    """Copies planned byte ranges to their final place in a shard, hashing each tensor.

    Three stages overlap: reader threads fill buffers ahead (source reads never wait for
    output writes), the main thread tests for zeros and writes, a pool of hasher threads
    checksums (hashlib and file I/O release the GIL). A buffer goes back to the free list
    when it is both written and hashed, so a slow hash of one big tensor does not stall the
    reads while other buffers are free. A local disk gets one reader, reading each file
    front to back; a hub reader asks for several (its requests are latency-bound). A fixed
    set of CHUNK-byte buffers bounds the memory whatever the size of the checkpoint."""

    def __init__(self, reader: ByteReader, progress: Callable[[int], object], position: int = 0):
        self.reader = reader
        self.progress = progress
        readers = getattr(reader, "parallel_reads", 1)
        lanes = hasher_lanes()
        # reads in flight, two chunks queued per hasher lane, the chunk being written
        self.depth = readers + 2 * lanes + 1
        self.free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for _ in range(self.depth):
            # anonymous mappings, not bytearrays: no zero-fill up front, and a page costs
            # memory only once a read has filled it (a small conversion stays small)
            self.free.put(memoryview(mmap.mmap(-1, CHUNK)))
        self.reads = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="read")
        self.hashers = _Hashers(lanes)
        self.written = 0
        self.position = position  # bytes of the output stream done, earlier runs included
        crash = os.environ.get(CRASH_AFTER_ENV)
        self.crash_after = int(crash) if crash else None

    def run(self, tensors: list[PlannedTensor], writer: ShardWriter) -> Iterator[tuple[PlannedTensor, str]]:
        """Write `tensors` into `writer`; yields each finished tensor with its sha256 (in
        the order their hashes finish)."""
        chunks = _chunks(tensors)
        reads: collections.deque[tuple[memoryview, memoryview, Future[None]]] = collections.deque()  # buffer, view, read
        hashing: collections.deque[tuple[PlannedTensor, Future[None]]] = collections.deque()  # last chunk of each tensor
        started = 0

        def start_reads(k: int) -> None:
            nonlocal started
            while started < len(chunks):
                if started == k:  # nothing read ahead: wait for a buffer; every buffer
                    buf = self.free.get()  # taken is being hashed, so one comes back
                else:
                    try:
                        buf = self.free.get_nowait()
                    except queue.Empty:
                        return
                c = chunks[started]
                view = buf[: c.n]
                reads.append((buf, view, self.reads.submit(self.reader.read_into, c.file, c.offset, view)))
                started += 1

        for k, c in enumerate(chunks):
            start_reads(k)
            buf, view, read = reads.popleft()
            read.result()
            hashed = self.hashers.submit(c.tensor.name, view)
            if c.n and not _all_zero(view):
                writer.write(c.tensor.name, view, c.at)
                writer.start_writeback(c.tensor.name, c.at, c.n)
            hashed.add_done_callback(lambda _, buf=buf: self.free.put(buf))  # written and hashed
            self.written += c.n
            self.position += c.n
            self.progress(c.n)
            if self.crash_after is not None and self.position >= self.crash_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if c.last:
                hashing.append((c.tensor, hashed))  # a lane is FIFO: this is its last update
            while hashing and (hashing[0][1].done() or k == len(chunks) - 1):
                t, last = hashing.popleft()
                last.result()
                yield t, self.hashers.hexdigest(t.name)

    def close(self) -> None:
        self.reads.shutdown()
        self.hashers.close()


def _hash_range(path: Path, start: int, nbytes: int) -> str | None:
    """sha256 of `nbytes` bytes of `path` from `start`, or None if the file ends first."""
    digest = hashlib.sha256()
    buf = memoryview(bytearray(min(CHUNK, nbytes)))
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = nbytes
        while left:
            n = f.readinto(buf[: min(CHUNK, left)])
            if not n:
                return None
            digest.update(buf[:n])
            left -= n
    return digest.hexdigest()


def _still_valid(path: Path, entries: list[dict[str, Any]], offsets: dict[str, int]) -> set[str]:
    """Journaled tensors whose bytes in a resumed shard still hash as recorded (several
    tensors at once, one thread each). The journal is not fsynced per tensor (a kill -9
    loses nothing the kernel already holds), so after a crash of the machine itself a
    journaled tensor may be stale: it is then redone."""
    with ThreadPoolExecutor(max_workers=hasher_lanes()) as pool:
        digests = pool.map(lambda e: _hash_range(path, offsets[e["name"]], e["nbytes"]), entries)
        return {e["name"] for e, digest in zip(entries, digests) if digest == e["sha256"]}


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


def plan_source(inv: Inventory, reader: ByteReader, target: str, *, reverse: bool = False) -> Plan:
    """Plan the conversion of an opened source to `target` with the table for the draft
    layout it holds (MTP or DSpark); the reader is closed when planning fails."""
    try:
        direction: Direction = "reverse" if reverse else "forward"
        table = choose_table(target, inv, direction)
        return plan_reverse(inv, table) if reverse else plan_conversion(inv, table)
    except BaseException:
        reader.close()
        raise


def convert(source: str | Path, out: str | Path, *, target: str = "xpu", reverse: bool = False, overwrite: bool = False, wait: bool = False, max_shard_size: int = DEFAULT_MAX_SHARD, quiet: bool = True) -> ConversionResult:
    """Convert `source` (native checkpoint, or with reverse=True a converted one) into `out`.

    OUT is owned (checked safe, locked) before the source is planned and until the output
    is published; with `wait` a run finding OUT locked waits for the other run."""
    require_target(target)  # a bad name is refused before OUT is touched
    with claim_output(out, source=local_source(source), wait=wait, on_wait=_waiting_notice(quiet)) as claim:
        inv, reader = open_source(source)
        plan = plan_source(inv, reader, target, reverse=reverse)
        try:
            return _write_output(plan, reader, claim, overwrite=overwrite, max_shard_size=max_shard_size, quiet=quiet)
        finally:
            reader.close()
