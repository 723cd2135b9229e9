"""The source inventory: headers only, exact byte ranges, and one distinct error per
malformed checkpoint, each naming the file and the tensor.

Shard headers and index files are read at least as strictly as the safetensors library reads
them: whatever it refuses, the inventory refuses first, before any tensor byte is read, with one
line naming the file and the tensor or field, and a documented exit code; a source file that is
not a regular file is named as such, not as missing.

Property-based (hypothesis): random and mutated shard files and index files go into the parsers;
the only outcomes allowed are a valid result or one of the tool's own errors, with a one-line
message naming the file. Whenever the inventory accepts a shard, the safetensors library accepts
the same bytes and agrees on every tensor's dtype, shape and bytes: the inventory is at least as
strict as safetensors, never laxer. Runs are reproducible (derandomize: the examples depend only
on the test) and small enough for CI; docs/results/fuzzing.md lists each target's examples and seconds."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from inprocess import run_one_line
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4.convert.check.run import run_checks
from dsv4.convert.exit_codes import code_of
from dsv4.convert.sources.inventory import read_inventory
from dsv4.model import errors as model_errors
from dsv4.model.checkpoint import INDEX_NAME, load_index, read_local_header
from dsv4.model.dtypes import ITEMSIZE, SAFETENSORS_NAMES, nbytes, tensor_bytes
from dsv4.model.errors import CheckpointError
from dsv4.model.loader import load_converted
from dsv4.model.safetensors_header import MAX_HEADER, parse_header

CONFIG = {"model_type": "deepseek_v4"}


def make_checkpoint(
    root: Path, shards: dict[str, dict[str, torch.Tensor]], weight_map: dict[str, str] | None = None
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    for name, tensors in shards.items():
        save_file(tensors, str(root / name))
    if weight_map is None:
        weight_map = {k: name for name, tensors in shards.items() for k in tensors}
    (root / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def two_shards(root: Path) -> Path:
    return make_checkpoint(
        root,
        {
            "model-00001-of-00002.safetensors": {"embed.weight": torch.ones(4, 8, dtype=torch.bfloat16)},
            "model-00002-of-00002.safetensors": {
                "mtp.0.e_proj.weight": torch.zeros(8, 8).to(torch.float8_e4m3fn),
                "mtp.0.e_proj.scale": torch.ones(1, 1).to(torch.float8_e8m0fnu),
            },
        },
    )


def inventory_refusal(root: Path, match: str) -> model_errors.CheckpointError:
    """The error read_inventory(root) refuses with (its message matching `match`)."""
    with pytest.raises(model_errors.CheckpointError, match=match) as raised:
        read_inventory(root)
    return raised.value


def test_byte_ranges_point_at_each_tensors_bytes(tiny_native: Path) -> None:
    inv = read_inventory(tiny_native)
    assert inv.config["model_type"] == "deepseek_v4"
    for name in ["embed.weight", "mtp.0.e_proj.scale", "mtp.0.ffn.experts.3.w2.weight", "layers.0.ffn.gate.tid2eid"]:
        src = inv.tensors[name]
        with open(tiny_native / src.file, "rb") as f:
            f.seek(src.start)
            raw = f.read(src.nbytes)
        with safe_open(str(tiny_native / src.file), "pt") as f:
            expected = f.get_tensor(name)
        assert raw == expected.contiguous().view(torch.uint8).numpy().tobytes()
        assert list(expected.shape) == list(src.shape)


def test_single_file_checkpoint(tmp_path: Path) -> None:
    tmp_path.joinpath("config.json").write_text("{}")
    save_file({"a": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    inv = read_inventory(tmp_path)
    assert inv.tensors["a"].file == "model.safetensors" and inv.tensors["a"].shape == (3,)


@pytest.mark.slow
def test_reads_headers_only(flash_sparse: Path) -> None:
    inv = read_inventory(flash_sparse)
    assert len(inv.tensors) == 69_187
    header_sizes = []
    for file in inv.file_sizes:
        with open(flash_sparse / file, "rb") as f:
            header_sizes.append(8 + struct.unpack("<Q", f.read(8))[0])
    assert inv.header_bytes == sum(header_sizes)
    assert inv.header_bytes < 10**8 < sum(inv.file_sizes.values())


def test_missing_shard(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    os.remove(root / "model-00002-of-00002.safetensors")
    assert inventory_refusal(root, "model-00002-of-00002.safetensors").kind == "missing_shard"


# shards and an index that disagree: (shard -> its tensors, the index's weight_map, the refusal, its kind)
SHARDS_AGAINST_INDEX = [
    pytest.param(
        {"a.safetensors": {"x": torch.zeros(2)}, "b.safetensors": {"y": torch.zeros(2)}},
        {"x": "b.safetensors", "y": "b.safetensors"},
        r"b.safetensors: tensor x is listed in .* but not in the shard.s header",
        "index_mismatch",
        id="index-key-not-in-named-shard",
    ),
    pytest.param(
        {"a.safetensors": {"x": torch.zeros(2)}},
        {"x": "a.safetensors", "ghost": "a.safetensors"},
        "tensor ghost",
        "index_mismatch",
        id="index-key-missing-from-every-shard",
    ),
    pytest.param(
        {"a.safetensors": {"x": torch.zeros(2)}, "b.safetensors": {"x": torch.zeros(2), "y": torch.zeros(2)}},
        {"x": "a.safetensors", "y": "b.safetensors"},
        "tensor x is in both a.safetensors and b.safetensors",
        "duplicate_tensor",
        id="key-in-two-shards",
    ),
]


@pytest.mark.parametrize(("shards", "weight_map", "message", "kind"), SHARDS_AGAINST_INDEX)
def test_shards_that_disagree_with_the_index_are_refused(
    shards: dict[str, dict[str, torch.Tensor]], weight_map: dict[str, str], message: str, kind: str, tmp_path: Path
) -> None:
    root = make_checkpoint(tmp_path / "c", shards, weight_map=weight_map)
    assert inventory_refusal(root, message).kind == kind


def test_truncated_shard(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    shard = root / "model-00001-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 1)
    assert inventory_refusal(root, "model-00001-of-00002.safetensors: tensor embed.weight").kind == "truncated_shard"


def rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def test_unknown_dtype(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    rewrite_header(root / "model-00001-of-00002.safetensors", lambda h: h["embed.weight"].update(dtype="F4"))
    assert inventory_refusal(root, "tensor embed.weight: unknown dtype F4").kind == "unknown_dtype"


def test_offsets_that_disagree_with_shape(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    rewrite_header(root / "model-00001-of-00002.safetensors", lambda h: h["embed.weight"].update(shape=[4, 9]))
    assert inventory_refusal(root, "tensor embed.weight").kind == "malformed_header"


def test_header_not_json(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    shard = root / "model-00001-of-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[8] = ord("#")
    shard.write_bytes(bytes(raw))
    not_json = "model-00001-of-00002.safetensors: header is not valid JSON"
    assert inventory_refusal(root, not_json).kind == "malformed_header"


@pytest.mark.parametrize("bad", ["../x.safetensors", "/etc/x.safetensors", "sub/x.safetensors", ".."])
def test_shard_names_must_be_plain_files(tmp_path: Path, bad: str) -> None:
    root = two_shards(tmp_path / "c")
    index = json.loads((root / INDEX_NAME).read_text())
    index["weight_map"]["embed.weight"] = bad
    (root / INDEX_NAME).write_text(json.dumps(index))
    assert inventory_refusal(root, "not a plain file name").kind == "unsafe_shard_path"


def test_symlink_leaving_the_directory(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(root / "model-00001-of-00002.safetensors", outside)
    (root / "model-00001-of-00002.safetensors").symlink_to(outside)
    assert inventory_refusal(root, "outside the checkpoint directory").kind == "unsafe_shard_path"


def test_missing_config(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    os.remove(root / "config.json")
    assert inventory_refusal(root, "config.json").kind == "missing_config"


MTP_SHARD = "model-00005-of-00005.safetensors"  # the tiny preset's shard holding mtp.0.*


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv4", *args], capture_output=True, text=True)


def shard_bytes(header: dict[str, Any] | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def entry(dtype: str, shape: list[Any], lo: Any, hi: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [lo, hi]}


def single_file(root: Path, config: Path, raw: bytes) -> Path:
    """A checkpoint of one model.safetensors holding exactly `raw`, with a real config."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(config, root / "config.json")
    (root / "model.safetensors").write_bytes(raw)
    return root


def header_text(path: Path) -> tuple[str, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + n].decode(), raw[8 + n :]


def native_copy(tiny_native: Path, dest: Path) -> Path:
    return Path(shutil.copytree(tiny_native, dest))


def safetensors_refuses(path: Path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            f.keys()
    except Exception:  # safetensors raises its own SafetensorError (and others) on bad files
        return True
    return False


def assert_one_line_exit(r: subprocess.CompletedProcess, code: int, *named: str) -> None:
    assert r.returncode == code, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    for text in named:
        assert text in r.stderr


# --- the cases: silently wrong tensors ---------------------------------------------
def test_duplicate_tensor_key_is_refused_not_converted(tiny_native: Path, tmp_path: Path) -> None:
    """A second entry under an existing name (JSON readers keep the last) pointing at
    another norm's bytes: converting it would give hnorm enorm's values."""
    src = native_copy(tiny_native, tmp_path / "src")
    text, data = header_text(src / MTP_SHARD)
    dup = '"mtp.0.hnorm.weight":{"dtype":"BF16","shape":[256],"data_offsets":[0,512]},'
    (src / MTP_SHARD).write_bytes(
        shard_bytes(text.replace('"mtp.0.norm.weight"', dup + '"mtp.0.norm.weight"', 1).encode(), data)
    )
    assert safetensors_refuses(src / MTP_SHARD)
    r = cli(str(src), str(tmp_path / "out"), "-q")
    assert_one_line_exit(r, code_of("malformed_header"), MTP_SHARD, "duplicate key 'mtp.0.hnorm.weight'")
    assert not (tmp_path / "out").exists()


def test_overlapping_offsets_one_norm_reading_another_norms_bytes(tiny_native: Path, tmp_path: Path) -> None:
    src = native_copy(tiny_native, tmp_path / "src")
    text, data = header_text(src / MTP_SHARD)
    header = json.loads(text)
    header["mtp.0.hnorm.weight"]["data_offsets"] = header["mtp.0.enorm.weight"]["data_offsets"]
    (src / MTP_SHARD).write_bytes(shard_bytes(header, data))
    assert safetensors_refuses(src / MTP_SHARD)
    r = cli(str(src), str(tmp_path / "out"), "-q")
    assert_one_line_exit(
        r, code_of("malformed_header"), MTP_SHARD, "mtp.0.hnorm.weight", "mtp.0.enorm.weight", "overlap"
    )
    assert not (tmp_path / "out").exists()


def test_gap_in_the_data_section(tiny_native: Path, tmp_path: Path) -> None:
    """A header that forgets a tensor leaves its bytes owned by nobody."""
    src = native_copy(tiny_native, tmp_path / "src")
    text, data = header_text(src / MTP_SHARD)
    header = json.loads(text)
    del header["mtp.0.hnorm.weight"]
    (src / MTP_SHARD).write_bytes(shard_bytes(header, data))
    index = json.loads((src / INDEX_NAME).read_text())
    del index["weight_map"]["mtp.0.hnorm.weight"]
    (src / INDEX_NAME).write_text(json.dumps(index))
    assert safetensors_refuses(src / MTP_SHARD)
    unowned = rf"{MTP_SHARD}: data bytes 512..1024 before tensor mtp.0.norm.weight belong to no tensor"
    assert inventory_refusal(src, unowned).kind == "malformed_header"


# one shard whose tensors do not tile its data section: (header, data length, the refusal)
UNTILED_SHARDS = [
    pytest.param(
        {"a": entry("U8", [8], 0, 8), "b": entry("U8", [2], 3, 5)},
        8,
        r"model.safetensors: tensor b: data_offsets \[3, 5\] overlap tensor a's \[0, 8\]",
        id="overlap-inside-another-tensor",
    ),
    pytest.param(
        {"a": entry("U8", [2], 2, 4)},
        4,
        r"data bytes 0..2 before tensor a belong to no tensor",
        id="data-section-must-start-at-zero",
    ),
    # safetensors refuses a file its tensors do not cover to the end (MetadataIncompleteBuffer)
    pytest.param(
        {"a": entry("U8", [2], 0, 2)},
        3,
        r"model.safetensors: data bytes 2..3 after the last tensor belong to no tensor",
        id="bytes-after-the-last-tensor",
    ),
]


@pytest.mark.parametrize(("header", "data_len", "message"), UNTILED_SHARDS)
def test_a_shard_its_tensors_do_not_tile_is_refused_as_safetensors_does(
    header: dict, data_len: int, message: str, tmp_path: Path, tiny_native: Path
) -> None:
    root = single_file(tmp_path / "c", tiny_native / "config.json", shard_bytes(header, bytes(data_len)))
    assert safetensors_refuses(root / "model.safetensors")
    assert inventory_refusal(root, message).kind == "malformed_header"


def test_tensors_tile_in_offset_order_whatever_the_header_order(tmp_path: Path, tiny_native: Path) -> None:
    header = {"b": entry("U8", [2], 2, 4), "empty": entry("F32", [0, 3], 4, 4), "a": entry("U8", [2], 0, 2)}
    root = single_file(tmp_path / "c", tiny_native / "config.json", shard_bytes(header, b"abcd"))
    inv = read_inventory(root)
    raw = (root / "model.safetensors").read_bytes()
    assert {n: raw[s.start : s.end] for n, s in inv.tensors.items()} == {"a": b"ab", "b": b"cd", "empty": b""}
    assert not safetensors_refuses(root / "model.safetensors")


# --- header size -----------------------------------------------------------------------------
def test_a_150_mib_header_names_the_header_size_limit(tmp_path: Path, tiny_native: Path) -> None:
    n = 150 << 20
    root = single_file(tmp_path / "c", tiny_native / "config.json", struct.pack("<Q", n))
    os.truncate(root / "model.safetensors", 8 + n + 64)  # the file does hold that much (as a hole)
    r = cli("plan", str(root))
    assert_one_line_exit(r, code_of("malformed_header"), "model.safetensors", f"{n:,}", f"{MAX_HEADER:,}-byte limit")
    assert "truncated" not in r.stderr.lower()


def test_header_size_limit_is_safetensors_own_and_checked_before_reading() -> None:
    """safetensors' MAX_HEADER_SIZE is 100_000_000 bytes (not 100 MiB); a longer header is
    refused without reading it, one of that size is read."""
    assert MAX_HEADER == 100_000_000
    reads: list[int] = []

    def read(k: int) -> bytes:
        reads.append(k)
        return b"{}".ljust(k)

    with pytest.raises(model_errors.CheckpointError, match="limit") as raised:
        parse_header(struct.pack("<Q", MAX_HEADER + 1), read, "x.safetensors", 10**9)
    assert raised.value.kind == "malformed_header"
    assert reads == []
    assert parse_header(struct.pack("<Q", MAX_HEADER), read, "x.safetensors", 10**9) == ({}, 8 + MAX_HEADER)
    assert reads == [MAX_HEADER]


def test_header_longer_than_the_file_is_still_a_truncated_shard(tmp_path: Path, tiny_native: Path) -> None:
    root = single_file(tmp_path / "c", tiny_native / "config.json", struct.pack("<Q", 1000) + b"{}")
    assert inventory_refusal(root, "header claims 1000 bytes but the file has 10").kind == "truncated_shard"


# --- JSON pathologies through the CLI ---------------------------------------------------------
def test_deeply_nested_header_exits_17_without_a_traceback(tmp_path: Path, tiny_native: Path) -> None:
    deep = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    root = single_file(tmp_path / "c", tiny_native / "config.json", shard_bytes(deep))
    assert_one_line_exit(cli("plan", str(root)), code_of("malformed_header"), "model.safetensors", "nested more than")


def test_huge_integer_in_a_header_exits_17_without_a_traceback(tmp_path: Path, tiny_native: Path) -> None:
    huge = b'{"a":{"dtype":"U8","shape":[' + b"7" * 4_301 + b'],"data_offsets":[0,0]}}'
    root = single_file(tmp_path / "c", tiny_native / "config.json", shard_bytes(huge))
    assert_one_line_exit(cli("plan", str(root)), code_of("malformed_header"), "model.safetensors", "4301 digits")


# --- field types, each refused as safetensors refuses it ---------------------------------------
OK = entry("U8", [2], 0, 2)


# Two cases safetensors itself accepts, refused here all the same: a null __metadata__
# (ambiguous: no map, or an empty one) and a field this reader does not know (it could
# change what the entry means).
SAFETENSORS_ACCEPTS = ("__metadata__ is null", "unknown field")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"__metadata__": {"format": 1}, "a": OK}, r"__metadata__\['format'\] is an integer, not a string"),
        ({"__metadata__": ["format"], "a": OK}, r"__metadata__ is a list, not an object of strings"),
        ({"__metadata__": None, "a": OK}, r"__metadata__ is null, not an object of strings"),
        ({"a": None}, r"tensor a: entry is null, not an object"),
        ({"a": {"dtype": "U8", "shape": [2]}}, r"tensor a: entry lacks data_offsets"),
        ({"a": {**OK, "offset": 0}}, r"tensor a: unknown field 'offset'"),
        ({"a": entry("U8", ["2"], 0, 2)}, r"tensor a: shape \['2'\] is not a list of non-negative integers"),
        ({"a": entry("U8", [2.0], 0, 2)}, r"tensor a: shape \[2.0\] is not a list of non-negative integers"),
        ({"a": entry("U8", [True, 2], 0, 2)}, r"tensor a: shape \[True, 2\] is not a list of non-negative integers"),
        ({"a": entry("U8", [-2, -1], 0, 2)}, r"tensor a: shape \[-2, -1\] is not a list of non-negative integers"),
        ({"a": entry("U8", 2, 0, 2)}, r"tensor a: shape 2 is not a list of non-negative integers"),
        ({"a": entry("U8", [2**64, 0], 0, 2)}, r"tensor a: shape .* is not a list of non-negative integers"),
        ({"a": entry("U8", [2**63, 4, 0], 0, 2)}, r"tensor a: shape .* overflows 64 bits"),
        ({"a": entry(["U8"], [2], 0, 2)}, r"tensor a: dtype \['U8'\] is not a string"),
        (
            {"a": {**OK, "data_offsets": [0, 2, 4]}},
            r"tensor a: data_offsets \[0, 2, 4\] is not a pair of non-negative integers",
        ),
        ({"a": {**OK, "data_offsets": "02"}}, r"tensor a: data_offsets '02' is not a pair of non-negative integers"),
        ({"a": entry("U8", [2], 0.0, 2)}, r"tensor a: data_offsets \[0.0, 2\] is not a pair of non-negative integers"),
        ({"a": entry("U8", [2], 2, 0)}, r"tensor a: data_offsets \[2, 0\] do not fit U8\[2\]"),
        ({"\ud800": OK}, r"tensor '\\ud800': the name is not valid Unicode"),
    ],
    ids=lambda v: None if isinstance(v, str) else json.dumps(v)[:60],
)
def test_malformed_field_is_refused_naming_tensor_and_field(
    tmp_path: Path, tiny_native: Path, header: dict[str, Any], message: str
) -> None:
    root = single_file(tmp_path / "c", tiny_native / "config.json", shard_bytes(header, bytes(2)))
    assert safetensors_refuses(root / "model.safetensors") != any(case in message for case in SAFETENSORS_ACCEPTS)
    with pytest.raises(model_errors.CheckpointError, match=r"^model.safetensors: " + message) as exc:
        read_inventory(root)
    assert exc.value.kind == "malformed_header"
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    ("literal", "reason"), [(b"-0", "-0"), (b"2.0e0", "not a list"), (b"1" + b"0" * 20, "21 digits")]
)
def test_numbers_safetensors_does_not_read_as_sizes_are_refused(
    tmp_path: Path, tiny_native: Path, literal: bytes, reason: str
) -> None:
    raw = b'{"a":{"dtype":"U8","shape":[' + literal + b'],"data_offsets":[0,0]}}'
    root = single_file(tmp_path / "c", tiny_native / "config.json", shard_bytes(raw))
    assert safetensors_refuses(root / "model.safetensors")
    assert inventory_refusal(root, reason).kind == "malformed_header"


# --- the index file ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("index", "message"),
    [
        (b"[]", r"not a safetensors index: the top level is a list, not an object"),
        (b'{"metadata": {}}', r"not a safetensors index: no weight_map"),
        (b'{"weight_map": []}', r"weight_map is a list, not an object"),
        (b'{"weight_map": {}}', r"weight_map lists no tensor"),
        (b'{"weight_map": {"x": 3}}', r"weight_map\['x'\] is an integer, not a shard file name"),
        (b'{"weight_map": {"x": ["a.safetensors"]}}', r"weight_map\['x'\] is a list, not a shard file name"),
        (b'{"weight_map": {"x": "a.safetensors", "x": "b.safetensors"}}', r"not valid JSON \(duplicate key 'x'\)"),
        (b'{"metadata": [], "weight_map": {"x": "a.safetensors"}}', r"metadata is a list, not an object"),
        (
            b'{"metadata": {"total_size": "12"}, "weight_map": {"x": "a.safetensors"}}',
            r"metadata.total_size is '12', not a non-negative integer",
        ),
        (
            b'{"metadata": {"total_size": -1}, "weight_map": {"x": "a.safetensors"}}',
            r"metadata.total_size is -1, not a non-negative integer",
        ),
        (
            b'{"metadata": {"total_size": true}, "weight_map": {"x": "a.safetensors"}}',
            r"metadata.total_size is True, not a non-negative integer",
        ),
        (
            b'{"weight_map": {"x": "a.safetensors"}, "n": ' + b"9" * 4_400 + b"}",
            r"not valid JSON \(integer of 4400 digits",
        ),
        (b'{"weight_map": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", r"not valid JSON \(nested more than"),
    ],
    ids=lambda v: v[:40].decode() if isinstance(v, bytes) else None,
)
def test_malformed_index_names_the_file_and_the_field(index: bytes, message: str) -> None:
    with pytest.raises(model_errors.CheckpointError, match=rf"^{INDEX_NAME}: {message}") as exc:
        load_index(index, INDEX_NAME)
    assert exc.value.kind == "malformed_header"
    assert "\n" not in str(exc.value)


def test_malformed_index_through_the_cli(tiny_native: Path, tmp_path: Path) -> None:
    src = native_copy(tiny_native, tmp_path / "src")
    index = json.loads((src / INDEX_NAME).read_text())
    index["metadata"]["total_size"] = "many"
    (src / INDEX_NAME).write_text(json.dumps(index))
    assert_one_line_exit(cli("plan", str(src)), code_of("malformed_header"), INDEX_NAME, "metadata.total_size")


def test_a_valid_index_gives_its_weight_map() -> None:
    raw = b'{"metadata": {"total_size": 4, "format": "pt"}, "weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}'
    assert load_index(raw, INDEX_NAME) == {"x": "a.safetensors", "y": "b.safetensors"}


# --- check uses the same rule -----------------------------------------------------------------
def test_check_refuses_a_gap_with_the_inventorys_rule(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    shard = "model-00001-of-00001.safetensors"
    (out / shard).write_bytes(shard_bytes({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 3, 5)}, bytes(5)))
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 4}, "weight_map": {"a": shard, "b": shard}}))
    report = run_checks(out)
    failed = report.failures[0]
    assert (failed.name, report.exit_code) == ("index", code_of("index_check"))
    assert f"{shard}: data bytes 2..3 before tensor b belong to no tensor" in failed.reason


def test_the_inventory_check_and_the_loader_refuse_one_malformed_header_alike(
    tiny_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """The first tensor of a converted shard dropped from its header (and from the index):
    its bytes belong to no tensor. All three read headers through the one parser
    (model/safetensors_header.py), so all three give the same one-line malformed_header.
    Before it, the loader read the index its own way and said missing_key instead."""
    out = Path(shutil.copytree(tiny_pair[1], tmp_path / "converted"))
    index = json.loads((out / INDEX_NAME).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    text, data = header_text(out / shard)
    header = json.loads(text)
    first = min((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])
    del header[first]
    (out / shard).write_bytes(shard_bytes(header, data))
    del index["weight_map"][first]
    (out / INDEX_NAME).write_text(json.dumps(index))

    with pytest.raises(model_errors.CheckpointError) as by_inventory:
        read_inventory(out)
    assert by_inventory.value.kind == "malformed_header"
    with pytest.raises(model_errors.CheckpointError) as by_loader:
        load_converted(out, "cpu")
    assert by_loader.value.kind == "malformed_header"
    said = str(by_inventory.value)
    assert said.startswith(f"{shard}: data bytes 0..") and "belong to no tensor" in said and "\n" not in said
    assert str(by_loader.value) == said
    report = run_checks(out)
    assert (report.failures[0].name, report.failures[0].reason) == ("index", said)


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


# --- a path that exists but is not a regular file is named as such, not as missing --------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "model-00001-of-00005.safetensors"])
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_source_file_that_is_not_a_regular_file_is_named_so(
    name: str,
    kind: str,
    tiny_native: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A FIFO or directory in place of config.json, the index or a shard was reported as
    missing ("does not exist", "no config.json", "neither ... found")."""
    src = tmp_path / "src"
    shutil.copytree(tiny_native, src)
    (src / name).unlink()
    (src / name).mkdir() if kind == "directory" else os.mkfifo(src / name)
    code, line = run_one_line(monkeypatch, capsys, "plan", str(src))
    assert code == {"config.json": 18}.get(name, 11)
    assert line == f"error: {src / name}: is a {kind}, not a regular file"
