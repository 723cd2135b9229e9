"""The executor's read order and the local reader's direct reads: what makes the converter
run at disk speed must not change a byte of what it reads (tests/test_convert.py holds the
output's byte identity)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from dsv4.convert.execute import CHUNK, schedule
from dsv4.convert.local import DIRECT_ALIGN, LocalReader
from dsv4.convert.plan import Piece, PlannedTensor
from dsv4.model.errors import TruncatedShardError


def tensor(name: str, nbytes: int) -> PlannedTensor:
    return PlannedTensor(name, "U8", (nbytes,), (Piece(name, "f", 0, nbytes),), "rename", "r")


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
        with pytest.raises(TruncatedShardError, match=f"ends at byte {len(data)}"):
            reader.read_view("f", len(data) - 10, 11, buf)
    finally:
        reader.close()
