"""The executor: copies a plan's byte ranges from a source into shards, hashing each tensor,
and computes a served draft's computed tensors (convert/transforms.py) from their inputs.

Reads, writes and hashes overlap in threads; a fixed set of buffers bounds the memory
whatever the size of the checkpoint. A computation holds its inputs whole, one at a time:
the memory is bounded by one module's tensors. What to copy is the plan's (convert/plan.py); where
it lands is the writer's (convert/writer.py); the output directory's life cycle is
convert/output.py's; convert/pipeline.py ties them together.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4.convert import transforms
from dsv4.convert.computed import Computed, Measured
from dsv4.convert.plan import PlannedTensor
from dsv4.convert.sources.local import DIRECT_ALIGN
from dsv4.convert.sources.source import ByteReader
from dsv4.convert.writer import ShardWriter
from dsv4.model.dtypes import tensor_bytes

if TYPE_CHECKING:
    import torch

CHUNK = 8 * 1024 * 1024  # bytes per read/write: large enough for full disk speed


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
    writer: ShardWriter  # the shard the tensor goes into
    lane: int  # the hasher lane of the tensor
    file: str
    offset: int  # in the source file
    n: int
    at: int  # in the output tensor
    last: bool  # the tensor's final chunk


def _tensor_chunks(t: PlannedTensor, writer: ShardWriter, lane: int) -> list[_Chunk]:
    spans = [(p.file, off, min(CHUNK, p.end - off)) for p in t.pieces for off in range(p.start, p.end, CHUNK)] or [
        ("", 0, 0)
    ]
    out, at = [], 0
    for k, (file, off, n) in enumerate(spans):
        out.append(_Chunk(t, writer, lane, file, off, n, at, k == len(spans) - 1))
        at += n
    return out


def schedule(jobs: list[tuple[PlannedTensor, ShardWriter]], streams: int) -> list[_Chunk]:
    """The chunks of `jobs` in the order they are read: the largest tensors first,
    `streams` tensors at a time, their chunks taken in turn; each tensor's own chunks in
    order, all in one hasher lane (its stream). A tensor's sha256 is one stream, slower
    than a fast disk: several tensors in progress at once keep several lanes hashing, and
    starting with the largest keeps a big tensor's hash from being the tail of the run."""
    pending = collections.deque(sorted(jobs, key=lambda job: -job[0].nbytes))
    active: list[collections.deque[_Chunk]] = [collections.deque() for _ in range(streams)]
    order: list[_Chunk] = []
    while pending or any(active):
        for lane, chunks in enumerate(active):
            if not chunks and pending:
                chunks.extend(_tensor_chunks(*pending.popleft(), lane))
            if chunks:
                order.append(chunks.popleft())
    return order


def _read_view(reader: ByteReader, file: str, offset: int, n: int, buf: memoryview) -> memoryview:
    """The n bytes at `offset` of `file`, in `buf`: the reader's direct read where it has one
    (convert/sources/local.py: LocalReader.read_view), else a read into the front of buf."""
    if n == 0:  # a tensor with no elements reads nothing
        return buf[:0]
    read_view = getattr(reader, "read_view", None)
    if read_view is not None:
        return read_view(file, offset, n, buf)
    reader.read_into(file, offset, buf[:n])
    return buf[:n]


class _Hashers:
    """A pool of hasher threads in which each tensor keeps ONE sha256 over its bytes in
    order: a tensor's chunks all go to one single-thread lane (FIFO), different tensors
    hash at once in different lanes (`schedule` assigns them). hashlib releases the GIL for
    large updates, so lanes really run in parallel; one lane alone (1.2-2 GB/s) is slower
    than a fast disk."""

    def __init__(self, lanes: int):
        self.lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") for _ in range(lanes)]
        self.digests: dict[str, Any] = {}

    def submit(self, name: str, lane: int, view: memoryview) -> Future[None]:
        """Hash `view` as the next bytes of tensor `name`; a tensor's chunks all go to one lane."""
        digest = self.digests.get(name)
        if digest is None:
            digest = self.digests[name] = hashlib.sha256()
        return self.lanes[lane].submit(digest.update, view)

    def hexdigest(self, name: str) -> str:
        """Once the tensor's last update has finished."""
        return self.digests.pop(name).hexdigest()

    def close(self) -> None:
        for lane in self.lanes:
            lane.shutdown()


def _cores() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def hasher_lanes() -> int:
    """Hasher threads: enough for disk speed (four lanes hash at 5-8 GB/s), never more than
    the cores this process may use."""
    return max(1, min(4, _cores()))


@contextmanager
def _intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads at `n` (at least 1) while computing, as they were after: a
    computation runs beside the writer's write and sha256, and OpenMP threads that outnumber
    the free cores wait for each other at every operation (measured here, 2 cores: 0.87 s
    a routed expert's dequantisation with 2 threads, 0.16 s with 1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Executor:
    """Copies planned byte ranges to their final place in the shards, hashing each tensor.

    Three stages overlap: reader threads fill buffers ahead (source reads never wait for
    output writes), the main thread tests for zeros and writes, a pool of hasher threads
    checksums (hashlib and file I/O release the GIL). A buffer goes back to the free list
    when it is both written and hashed, so a slow hash of one big tensor does not stall the
    reads while other buffers are free. Reads follow `schedule`: as many tensors in
    progress as there are hasher lanes, the largest first, over all shards at once. They
    are written in that order, and while the main thread waits for one, every buffer that
    comes back starts another read: reads of unequal lengths finish out of order, and
    starting reads only as the awaited one came in kept 5.4-6.8 of a hub's 8 reads in flight on
    average (docs/results/hub-convert.md). A fixed set of buffers bounds the memory whatever
    the size of the checkpoint."""

    def __init__(self, reader: ByteReader, progress: Callable[[int], object]):
        self.reader = reader
        self.progress = progress
        readers = getattr(reader, "parallel_reads", 1)
        self.lanes = hasher_lanes()
        # reads in flight, two chunks queued per hasher lane, the chunk being written
        self.depth = readers + 2 * self.lanes + 1
        self.free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for _ in range(self.depth):
            # anonymous mappings, not bytearrays: page-aligned (direct I/O reads into them
            # the aligned blocks around a chunk: DIRECT_ALIGN of slack on each side), no
            # zero-fill up front, and a page costs memory only once a read has filled it
            self.free.put(memoryview(mmap.mmap(-1, CHUNK + 2 * DIRECT_ALIGN)))
        self.reads = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="read")
        self.hashers = _Hashers(self.lanes)
        self.written = 0

    def run(self, jobs: list[tuple[PlannedTensor, ShardWriter]]) -> Iterator[tuple[PlannedTensor, str]]:
        """Write each tensor into its shard's writer; yields each finished tensor with its
        sha256 (in the order their hashes finish)."""
        chunks = schedule(jobs, self.lanes)
        reads: collections.deque[tuple[memoryview, Future[memoryview]]] = collections.deque()  # buffer, its read
        hashing: collections.deque[tuple[PlannedTensor, Future[None]]] = (
            collections.deque()
        )  # last chunk of each tensor
        started = 0
        moved = threading.Event()  # a read finished or a buffer came back: reads may start

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
                read = self.reads.submit(_read_view, self.reader, c.file, c.offset, c.n, buf)
                read.add_done_callback(lambda _: moved.set())
                reads.append((buf, read))
                started += 1

        def release(_: Future[None], buf: memoryview) -> None:
            self.free.put(buf)
            moved.set()

        for k, c in enumerate(chunks):
            start_reads(k)
            buf, read = reads.popleft()
            while not read.done():  # chunk k is awaited: the buffers that come back meanwhile
                moved.wait()  # start more reads, so one slow read leaves no reader idle
                moved.clear()
                start_reads(k)
            view = read.result()
            hashed = self.hashers.submit(c.tensor.name, c.lane, view)
            if c.n and not _all_zero(view):
                c.writer.write(c.tensor.name, view, c.at)
                c.writer.start_writeback(c.tensor.name, c.at, c.n)
            hashed.add_done_callback(partial(release, buf=buf))  # written and hashed
            self.written += c.n
            self.progress(c.n)
            if c.last:
                hashing.append((c.tensor, hashed))  # a lane is FIFO: this is its last update
            while hashing and (hashing[0][1].done() or k == len(chunks) - 1):
                t, last = hashing.popleft()
                last.result()
                yield t, self.hashers.hexdigest(t.name)

    def compute(
        self, jobs: list[tuple[PlannedTensor, ShardWriter]]
    ) -> Iterator[tuple[PlannedTensor, str, Measured | None]]:
        """Compute each transformed tensor into its shard's writer; yields it with its sha256
        and its computation's measured error. A computation (a weight and its scale) runs
        once for all of its tensors in `jobs`, its inputs read whole and let go after; the
        next one is read and computed in a thread (torch lets go of the GIL) while this one
        is written and hashed: two at most in memory."""
        computations: dict[object, list[tuple[PlannedTensor, ShardWriter]]] = {}
        for t, writer in jobs:
            assert t.transform is not None
            computations.setdefault(t.transform.computation, []).append((t, writer))
        pending = list(computations.values())
        if not pending:
            return  # torch not imported: a plan without computed tensors never needs it
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute") as pool, _intra_op_threads(_cores() - 1):
            ahead: Future[Computed] | None = pool.submit(self._computed, pending[0])
            for k, members in enumerate(pending):
                assert ahead is not None
                result = ahead.result()
                ahead = pool.submit(self._computed, pending[k + 1]) if k + 1 < len(pending) else None
                for t, writer in members:
                    view = _as_planned(t, result.tensors[t.transform.leaf if t.transform else ""])
                    writer.write(t.name, view)
                    self.written += len(view)
                    self.progress(len(view))
                    yield t, hashlib.sha256(view).hexdigest(), result.measured

    def _computed(self, members: list[tuple[PlannedTensor, ShardWriter]]) -> Computed:
        transform = members[0][0].transform
        assert transform is not None
        return transforms.compute(transform, [read_whole(self.reader, t) for t in transform.inputs], members[0][0].name)

    def close(self) -> None:
        self.reads.shutdown()
        self.hashers.close()


def read_whole(reader: ByteReader, t: PlannedTensor) -> torch.Tensor:
    """Planned tensor `t` (its pieces back to back) as a CPU tensor, read CHUNK bytes a call."""
    import torch

    from dsv4.model.dtypes import TORCH_DTYPES

    buf = bytearray(t.nbytes)
    view, at = memoryview(buf), 0
    for p in t.pieces:
        for off in range(p.start, p.end, CHUNK):
            n = min(CHUNK, p.end - off)
            reader.read_into(p.file, off, view[at : at + n])
            at += n
    return torch.frombuffer(buf, dtype=TORCH_DTYPES[t.dtype]).view(t.shape)


def _as_planned(t: PlannedTensor, value: torch.Tensor) -> memoryview:
    """A computed tensor's bytes, once it is what the plan said (a transform that makes
    something else is a bug, never written)."""
    from dsv4.model.dtypes import SAFETENSORS_NAMES

    made = (SAFETENSORS_NAMES[value.dtype], tuple(value.shape))
    if made != (t.dtype, t.shape):
        raise AssertionError(f"{t.name}: {t.op} made {made[0]}{list(made[1])}, planned {t.dtype}{list(t.shape)}")
    return tensor_bytes(value)


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


def still_valid(path: Path, entries: list[dict[str, Any]], offsets: dict[str, int]) -> set[str]:
    """Journaled tensors whose bytes in a resumed shard still hash as recorded (several
    tensors at once, one thread each). The journal is not fsynced per tensor (a kill -9
    loses nothing the kernel already holds), so after a crash of the machine itself a
    journaled tensor may be stale: it is then redone."""
    with ThreadPoolExecutor(max_workers=hasher_lanes()) as pool:
        digests = pool.map(lambda e: _hash_range(path, offsets[e["name"]], e["nbytes"]), entries)
        return {e["name"] for e, digest in zip(entries, digests, strict=True) if digest == e["sha256"]}
