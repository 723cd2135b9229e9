"""Property-based tests (hypothesis) of the header and index parsers.

Random and mutated shard files and index files go into the parsers; the only outcomes
allowed are a valid result or one of the tool's own errors, with a one-line message naming
the file. Whenever the inventory accepts a shard, the safetensors library accepts the same
bytes and agrees on every tensor's dtype, shape and bytes: the inventory is at least as
strict as safetensors, never laxer.

Runs are reproducible (derandomize: the examples depend only on the test) and small enough
for CI; BENCHMARKS.md lists each target's examples and seconds.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from dsv4.model.checkpoint import read_local_header
from dsv4.model.checkpoint import INDEX_NAME, load_index
from dsv4.model.dtypes import ITEMSIZE, SAFETENSORS_NAMES, nbytes, tensor_bytes
from dsv4.model.errors import CheckpointError

EXAMPLES = 250
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SHARD = "model.safetensors"

# --- building blocks ---------------------------------------------------------------------
names = st.text(alphabet="abcdefghij._0123456789", min_size=1, max_size=10)
dtypes = st.sampled_from(sorted(ITEMSIZE))
shapes = st.lists(st.integers(0, 4), max_size=3)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def encode(header: dict[str, Any] | bytes, data: bytes, pad: int = 0) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * pad
    return struct.pack("<Q", len(raw)) + raw + data


@st.composite
def valid_shards(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """A well-formed shard: header (tensors in a random key order) and its data section."""
    tensors = draw(st.lists(st.tuples(names, dtypes, shapes), min_size=1, max_size=6, unique_by=lambda t: t[0]))
    header: dict[str, Any] = {}
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    at = 0
    entries = []
    for name, dtype, shape in tensors:
        n = nbytes(dtype, shape)
        entries.append((name, {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}))
        at += n
    for name, entry in draw(st.permutations(entries)):
        header[name] = entry
    data = random.Random(draw(st.integers(0, 2**32))).randbytes(at)
    return header, data


def _offset_pair(entry: dict[str, Any]) -> bool:
    offsets = entry.get("data_offsets")
    return isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)


def mutate_header(draw: st.DrawFn, header: dict[str, Any]) -> dict[str, Any] | bytes:
    """One change of meaning: offsets, shapes, dtypes, types, keys (JSON-level)."""
    header = json.loads(json.dumps(header))
    tensors = [k for k in header if k != "__metadata__"]
    name = draw(st.sampled_from(tensors))
    entry = header[name]
    # a second mutation may find what the first left: only changes that apply to it are drawn
    kinds = ["entry", "drop", "metadata"]
    if isinstance(entry, dict):
        kinds += ["offset_value", "shape", "shape_value", "dtype", "duplicate", "unknown_field"]
        if _offset_pair(entry):
            kinds += ["offset"]
        if any(isinstance(header[t], dict) and _offset_pair(header[t]) for t in tensors):
            kinds += ["copy_offsets"]
    kind = draw(st.sampled_from(kinds))
    if kind == "offset":
        i = draw(st.integers(0, 1))
        entry["data_offsets"][i] = entry["data_offsets"][i] + draw(st.integers(-3, 3))
    elif kind == "offset_value":
        entry["data_offsets"] = draw(json_values | st.lists(st.integers(-2, 50), max_size=3))
    elif kind == "shape":
        entry["shape"] = draw(st.lists(st.integers(-1, 5), max_size=4))
    elif kind == "shape_value":
        entry["shape"] = draw(json_values)
    elif kind == "dtype":
        entry["dtype"] = draw(dtypes | json_values)
    elif kind == "entry":
        header[name] = draw(json_values)
    elif kind == "drop":
        del header[name]
    elif kind == "copy_offsets":
        other = header[
            draw(st.sampled_from([t for t in tensors if isinstance(header[t], dict) and _offset_pair(header[t])]))
        ]
        entry["data_offsets"] = list(other["data_offsets"])
    elif kind == "metadata":
        header["__metadata__"] = draw(json_values)
    elif kind == "unknown_field":
        entry[draw(st.text(max_size=6))] = draw(json_values)
    elif kind == "duplicate":  # the same name twice in the JSON text: a dict cannot hold it
        raw = json.dumps(header)
        twin = json.dumps(
            {name: {**entry, "data_offsets": draw(st.lists(st.integers(0, 50), min_size=2, max_size=2))}}
        )[1:-1]
        return raw.replace("{", "{" + twin + ", ", 1).encode()
    return header


def mutate_bytes(draw: st.DrawFn, raw: bytes) -> bytes:
    """One byte-level change anywhere in the file, the length prefix included."""
    kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "append", "length"]))
    pos = draw(st.integers(0, max(0, len(raw) - 1)))
    if kind == "flip" and raw:
        return raw[:pos] + bytes([raw[pos] ^ draw(st.integers(1, 255))]) + raw[pos + 1 :]
    if kind == "insert":
        return raw[:pos] + draw(st.binary(min_size=1, max_size=4)) + raw[pos:]
    if kind == "delete":
        return raw[:pos] + raw[pos + draw(st.integers(1, 4)) :]
    if kind == "truncate":
        return raw[:pos]
    if kind == "append":
        return raw + draw(st.binary(min_size=1, max_size=8))
    (n,) = struct.unpack("<Q", raw[:8].ljust(8, b"\0"))
    length = draw(st.sampled_from([0, 1, max(0, n - 1), n + 1, n + 8, 2**63, 2**64 - 1, 100_000_001]))
    return struct.pack("<Q", min(length, 2**64 - 1)) + raw[8:]  # an earlier change may have left n at the top


@st.composite
def mutated_shards(draw: st.DrawFn) -> bytes:
    header, data = draw(valid_shards())
    changed: dict[str, Any] | bytes = header
    for _ in range(draw(st.integers(0, 2))):
        if isinstance(changed, dict) and any(k != "__metadata__" for k in changed):
            changed = mutate_header(draw, changed)
    raw = encode(changed, data, pad=draw(st.integers(0, 7)))
    for _ in range(draw(st.integers(0, 2))):
        raw = mutate_bytes(draw, raw)
    return raw


entry_like = st.fixed_dictionaries(
    {
        "dtype": dtypes | json_values,
        "shape": st.lists(st.integers(-1, 4), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-1, 40), max_size=3) | json_values,
    }
)


@st.composite
def random_shards(draw: st.DrawFn) -> bytes:
    """Built from nothing: random bytes, or a random header of entry-like objects."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=64))
    header = draw(st.dictionaries(names | st.just("__metadata__"), entry_like | json_values, max_size=4))
    return encode(header, draw(st.binary(max_size=48)))


# --- the property for shards ---------------------------------------------------------------
@pytest.fixture(scope="module")
def shard_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / SHARD


def assert_valid_or_own_error(path: Path, raw: bytes) -> None:
    path.write_bytes(raw)
    try:
        tensors, data_start = read_local_header(path)
    except CheckpointError as exc:  # the tool's own errors: 11..19, one line naming the file
        assert str(exc).startswith(f"{SHARD}: ") and "\n" not in str(exc)
        event(f"refused: {type(exc).__name__}")
        return
    event("accepted")
    # accepted: safetensors accepts the same bytes and sees the same tensors
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(tensors)
        for name, src in tensors.items():
            t = f.get_tensor(name)
            assert (SAFETENSORS_NAMES[t.dtype], tuple(t.shape)) == (src.dtype, src.shape)
            assert bytes(tensor_bytes(t)) == raw[src.start : src.end]
    assert data_start <= len(raw)


@FUZZ
@given(raw=mutated_shards())
def test_mutated_shards_parse_or_fail_with_the_tools_error(shard_path: Path, raw: bytes) -> None:
    assert_valid_or_own_error(shard_path, raw)


@FUZZ
@given(raw=random_shards())
def test_random_shards_parse_or_fail_with_the_tools_error(shard_path: Path, raw: bytes) -> None:
    assert_valid_or_own_error(shard_path, raw)


@settings(FUZZ, max_examples=50)
@given(shard=valid_shards(), pad=st.integers(0, 7))
def test_valid_shards_are_accepted_with_every_tensor(
    shard_path: Path, shard: tuple[dict[str, Any], bytes], pad: int
) -> None:
    """The generator's unmutated shards are valid: the mutated ones start from accepted files."""
    header, data = shard
    shard_path.write_bytes(encode(header, data, pad))
    tensors, _ = read_local_header(shard_path)
    assert set(tensors) == set(header) - {"__metadata__"}


# --- index files ------------------------------------------------------------------------------
shard_names = st.sampled_from(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "a.safetensors"])


@st.composite
def index_files(draw: st.DrawFn) -> bytes:
    weight_map = draw(st.dictionaries(names, shard_names, min_size=1, max_size=5))
    index: dict[str, Any] = {"metadata": {"total_size": draw(st.integers(0, 10**6))}, "weight_map": weight_map}
    kind = draw(
        st.sampled_from(["none", "weight_map", "entry", "metadata", "total_size", "top", "shard_name", "random"])
    )
    if kind == "weight_map":
        index["weight_map"] = draw(json_values)
    elif kind == "entry":
        index["weight_map"][draw(st.sampled_from(sorted(weight_map)))] = draw(json_values)
    elif kind == "metadata":
        index["metadata"] = draw(json_values)
    elif kind == "total_size":
        index["metadata"]["total_size"] = draw(json_values)
    elif kind == "top":
        index = draw(json_values)
    elif kind == "shard_name":
        index["weight_map"][draw(st.sampled_from(sorted(weight_map)))] = draw(
            st.sampled_from(["../x.safetensors", "/abs.safetensors", "a/b.safetensors", "..", ".", "", "a\\b"])
            | st.text(max_size=8)
        )
    elif kind == "random":
        return draw(st.binary(max_size=80))
    raw = json.dumps(index).encode()
    for _ in range(draw(st.integers(0, 2))):
        raw = _mutate_text(draw, raw)
    return raw


def _mutate_text(draw: st.DrawFn, raw: bytes) -> bytes:
    kind = draw(st.sampled_from(["flip", "insert", "delete", "keep"]))
    pos = draw(st.integers(0, max(0, len(raw) - 1)))
    if kind == "flip" and raw:
        return raw[:pos] + bytes([raw[pos] ^ draw(st.integers(1, 255))]) + raw[pos + 1 :]
    if kind == "insert":
        return (
            raw[:pos]
            + draw(st.binary(min_size=1, max_size=4) | st.sampled_from([b"-0", b"1e999", b"NaN", b'"x":1,', b"[[[["]))
            + raw[pos:]
        )
    if kind == "delete":
        return raw[:pos] + raw[pos + draw(st.integers(1, 4)) :]
    return raw


@FUZZ
@given(raw=index_files())
def test_index_files_parse_or_fail_with_the_tools_error(raw: bytes) -> None:
    try:
        weight_map = load_index(raw, INDEX_NAME)
    except CheckpointError as exc:  # 17 malformed, 16 a shard name leaving the directory
        assert str(exc).startswith(f"{INDEX_NAME}: ") and "\n" not in str(exc)
        event(f"refused: {type(exc).__name__}")
        return
    event("accepted")
    # accepted: what a plain JSON reader sees, every value a plain file name
    assert weight_map == json.loads(raw)["weight_map"] and weight_map
    for shard in weight_map.values():
        assert isinstance(shard, str) and shard and "/" not in shard and "\\" not in shard and shard not in (".", "..")
