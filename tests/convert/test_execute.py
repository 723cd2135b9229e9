"""The executor's read order and the local reader's direct reads: what makes the converter
run at disk speed must not change a byte of what it reads (tests/convert/test_pipeline.py holds
the output's byte identity); every tensor keeps one sha256 over its bytes in order whatever the
chunking and the number of hasher lanes, and the zero test sees every byte."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from dsv4.convert import execute, pipeline
from dsv4.convert.execute import CHUNK, schedule
from dsv4.convert.plan import PlannedTensor
from dsv4.convert.sources.local import DIRECT_ALIGN, LocalReader
from dsv4.model.errors import CheckpointError
from dsv4.model.safetensors_header import TensorBytes


def tensor(name: str, nbytes: int) -> PlannedTensor:
    return PlannedTensor(name, "U8", (nbytes,), (TensorBytes(name, "f", "U8", (nbytes,), 0, nbytes),), "rename", "r")


def test_schedule_reads_the_largest_tensors_first_several_at_a_time() -> None:
    small, mid, big, huge = (
        tensor("small", 100),
        tensor("mid", 2 * CHUNK),
        tensor("big", 3 * CHUNK),
        tensor("huge", 5 * CHUNK + 1),
    )
    writer = object()  # schedule only carries the writer along
    order = schedule([(t, writer) for t in (small, mid, big, huge)], streams=2)  # type: ignore[misc]

    # the two largest start together, their chunks in turn; a stream that finishes takes
    # the next largest waiting tensor
    assert [c.tensor.name for c in order[:6]] == ["huge", "big", "huge", "big", "huge", "big"]
    assert [c.tensor.name for c in order[6:]] == ["huge", "mid", "huge", "mid", "huge", "small"]
    for t in (small, mid, big, huge):
        mine = [c for c in order if c.tensor is t]
        # each tensor: its bytes once, in order, one hasher lane, the last chunk marked
        assert [c.at for c in mine] == list(range(0, t.nbytes, CHUNK))
        assert sum(c.n for c in mine) == t.nbytes
        assert len({c.lane for c in mine}) == 1
        assert [c.last for c in mine] == [False] * (len(mine) - 1) + [True]
    assert {c.lane for c in order} == {0, 1}


def test_schedule_with_one_stream_is_largest_first_one_at_a_time() -> None:
    ts = [tensor("a", 10), tensor("b", CHUNK + 5), tensor("c", 0)]
    order = schedule([(t, None) for t in ts], streams=1)  # type: ignore[misc]
    assert [(c.tensor.name, c.n) for c in order] == [("b", CHUNK), ("b", 5), ("a", 10), ("c", 0)]


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(5 * DIRECT_ALIGN + 123)  # ends off a block boundary
    (tmp_path / "f").write_bytes(data)
    return tmp_path, data


@pytest.mark.parametrize(
    "offset,n",
    [
        (0, 10),
        (1, DIRECT_ALIGN),
        (DIRECT_ALIGN - 1, 2),
        (DIRECT_ALIGN, 2 * DIRECT_ALIGN),
        (777, 3 * DIRECT_ALIGN + 5),
        (5 * DIRECT_ALIGN + 100, 23),
        (0, 5 * DIRECT_ALIGN + 123),
    ],
)
def test_read_view_returns_exactly_the_bytes_asked_for(source: tuple[Path, bytes], offset: int, n: int) -> None:
    root, data = source
    reader = LocalReader(root)
    buf = memoryview(mmap.mmap(-1, n + 2 * DIRECT_ALIGN))
    try:
        assert bytes(reader.read_view("f", offset, n, buf)) == data[offset : offset + n]
        assert reader.bytes_read == n
    finally:
        reader.close()


def test_read_view_past_the_end_is_a_truncated_shard(source: tuple[Path, bytes]) -> None:
    root, data = source
    reader = LocalReader(root)
    buf = memoryview(mmap.mmap(-1, 3 * DIRECT_ALIGN))
    try:
        with pytest.raises(CheckpointError, match=f"ends at byte {len(data)}") as raised:
            reader.read_view("f", len(data) - 10, 11, buf)
        assert raised.value.kind == "truncated_shard"
    finally:
        reader.close()


@pytest.mark.parametrize("n", [1, 2, 4096, 4097])
def test_zero_test_sees_every_byte(n: int) -> None:
    buf = mmap.mmap(-1, n)
    assert execute._all_zero(memoryview(buf))
    for at in {0, n // 2, n - 1}:
        buf[at] = 1
        assert not execute._all_zero(memoryview(buf)), at
        buf[at] = 0
    assert not execute._all_zero(memoryview(buf)[:0])  # an empty chunk writes nothing anyway


def shard_tensor_bytes(root: Path) -> dict[str, bytes]:
    """Each tensor's raw bytes, read straight off the safetensors layout."""
    out = {}
    for shard in sorted(root.glob("*.safetensors")):
        raw = shard.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        for name, t in json.loads(raw[8 : 8 + n]).items():
            if name != "__metadata__":
                start, end = t["data_offsets"]
                out[name] = raw[8 + n + start : 8 + n + end]
    return out


@pytest.mark.parametrize("lanes", [1, 3])
def test_each_tensor_keeps_one_sha256_over_its_bytes_in_order(
    tiny_native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lanes: int
) -> None:
    reference = tmp_path / "reference"
    pipeline.convert(tiny_native, reference)
    # chunks far smaller than the tensors: every big tensor is hashed in many updates while
    # other tensors hash in other lanes; the buffers are reused many times over
    monkeypatch.setattr(execute, "CHUNK", 1000)
    monkeypatch.setattr(execute, "hasher_lanes", lambda: lanes)
    out = tmp_path / "out"
    pipeline.convert(tiny_native, out)
    record = json.loads((out / "conversion.json").read_text())
    data = shard_tensor_bytes(out)
    assert max(len(b) for b in data.values()) > 50 * 1000
    assert {name: hashlib.sha256(b).hexdigest() for name, b in data.items()} == {
        name: t["sha256"] for name, t in record["tensors"].items()
    }
    assert data == shard_tensor_bytes(reference)
    assert record["tensors"] == json.loads((reference / "conversion.json").read_text())["tensors"]


class _GatedReader:
    """A source of zeros whose read at `gate` waits until `until` reads have started (5 s at
    most: `timed_out` says it was not released)."""

    parallel_reads = 2
    bytes_read = 0

    def __init__(self, gate: int, until: int):
        self.gate, self.until = gate, until
        self.started = 0
        self.lock = threading.Lock()
        self.enough = threading.Event()
        self.timed_out = False

    def read_into(self, file: str, offset: int, buf: memoryview) -> None:
        with self.lock:
            self.started += 1
            if self.started >= self.until:
                self.enough.set()
        if offset == self.gate and not self.enough.wait(5):
            self.timed_out = True


def test_buffers_that_come_back_while_a_read_is_awaited_start_more_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads finish out of order; the executor writes in order. While it waits for one slow
    read, the buffers whose hashes finish meanwhile must start the reads after it, or the
    reads in flight dwindle behind it (from a hub 50 ms away: 5.4-6.8 of 8 on average). Fails
    before: nothing started a read until the awaited one came in, so the gate timed out."""
    monkeypatch.setattr(execute, "CHUNK", 1000)
    monkeypatch.setattr(execute, "hasher_lanes", lambda: 1)
    submit = execute._Hashers.submit

    def slow_hash(self: execute._Hashers, name: str, lane: int, view: memoryview) -> object:
        self.lanes[lane].submit(time.sleep, 0.02)  # a lane is FIFO: the update waits behind this
        return submit(self, name, lane, view)

    monkeypatch.setattr(execute._Hashers, "submit", slow_hash)
    n, awaited = 1000, 10
    jobs = [
        (
            PlannedTensor(
                f"t{i}", "U8", (n,), (TensorBytes(f"t{i}", "f", "U8", (n,), i * n, (i + 1) * n),), "rename", "r"
            ),
            None,
        )
        for i in range(40)
    ]
    reader = _GatedReader(gate=awaited * n, until=0)
    executor = execute.Executor(reader, lambda _: None)
    # every buffer in use while chunk `awaited` is read: it, and depth - 1 reads after it
    reader.until = awaited + executor.depth
    try:
        done = [t.name for t, _ in executor.run(jobs)]  # type: ignore[arg-type]
    finally:
        executor.close()
    assert sorted(done) == sorted(f"t{i}" for i in range(40))
    assert not reader.timed_out
