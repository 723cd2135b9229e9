"""Shard headers and index files are read at least as strictly as the safetensors library
reads them: whatever it refuses, the inventory refuses first, before any tensor byte is
read, with one line naming the file and the tensor or field, and a documented exit code.

Each shard here is written byte by byte by the test (`shard_bytes`), independently of the
code under test, so the bytes on disk are exactly the case described."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from dsv4.convert import errors
from dsv4.convert.check import run_checks
from dsv4.convert.exit_codes import code_of
from dsv4.convert.inventory import read_inventory
from dsv4.model import errors as model_errors
from dsv4.model.checkpoint import INDEX_NAME, load_index
from dsv4.model.loader import load_converted
from dsv4.model.safetensors_header import MAX_HEADER, parse_header

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
    assert_one_line_exit(r, code_of(model_errors.MalformedHeaderError), MTP_SHARD, "duplicate key 'mtp.0.hnorm.weight'")
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
        r, code_of(model_errors.MalformedHeaderError), MTP_SHARD, "mtp.0.hnorm.weight", "mtp.0.enorm.weight", "overlap"
    )
    assert not (tmp_path / "out").exists()


def test_overlap_inside_another_tensor(tmp_path: Path, tiny_native: Path) -> None:
    a, b = entry("U8", [8], 0, 8), entry("U8", [2], 3, 5)
    root = single_file(tmp_path / "c", tiny_native / "config.json", shard_bytes({"a": a, "b": b}, bytes(8)))
    with pytest.raises(
        model_errors.MalformedHeaderError,
        match=r"model.safetensors: tensor b: data_offsets \[3, 5\] overlap tensor a's \[0, 8\]",
    ):
        read_inventory(root)


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
    with pytest.raises(
        model_errors.MalformedHeaderError,
        match=rf"{MTP_SHARD}: data bytes 512..1024 before tensor mtp.0.norm.weight belong to no tensor",
    ):
        read_inventory(src)


def test_data_section_must_start_at_zero(tmp_path: Path, tiny_native: Path) -> None:
    root = single_file(
        tmp_path / "c", tiny_native / "config.json", shard_bytes({"a": entry("U8", [2], 2, 4)}, bytes(4))
    )
    with pytest.raises(model_errors.MalformedHeaderError, match=r"data bytes 0..2 before tensor a belong to no tensor"):
        read_inventory(root)


def test_bytes_after_the_last_tensor_are_refused_as_safetensors_does(tmp_path: Path, tiny_native: Path) -> None:
    """safetensors refuses a file its tensors do not cover to the end (MetadataIncompleteBuffer)."""
    root = single_file(
        tmp_path / "c", tiny_native / "config.json", shard_bytes({"a": entry("U8", [2], 0, 2)}, bytes(3))
    )
    assert safetensors_refuses(root / "model.safetensors")
    with pytest.raises(
        model_errors.MalformedHeaderError,
        match=r"model.safetensors: data bytes 2..3 after the last tensor belong to no tensor",
    ):
        read_inventory(root)


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
    assert_one_line_exit(
        r, code_of(model_errors.MalformedHeaderError), "model.safetensors", f"{n:,}", f"{MAX_HEADER:,}-byte limit"
    )
    assert "truncated" not in r.stderr.lower()


def test_header_size_limit_is_safetensors_own_and_checked_before_reading() -> None:
    """safetensors' MAX_HEADER_SIZE is 100_000_000 bytes (not 100 MiB); a longer header is
    refused without reading it, one of that size is read."""
    assert MAX_HEADER == 100_000_000
    reads: list[int] = []

    def read(k: int) -> bytes:
        reads.append(k)
        return b"{}".ljust(k)

    with pytest.raises(model_errors.MalformedHeaderError, match="limit"):
        parse_header(struct.pack("<Q", MAX_HEADER + 1), read, "x.safetensors", 10**9)
    assert reads == []
    assert parse_header(struct.pack("<Q", MAX_HEADER), read, "x.safetensors", 10**9) == ({}, 8 + MAX_HEADER)
    assert reads == [MAX_HEADER]


def test_header_longer_than_the_file_is_still_a_truncated_shard(tmp_path: Path, tiny_native: Path) -> None:
    root = single_file(tmp_path / "c", tiny_native / "config.json", struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(model_errors.TruncatedShardError, match="header claims 1000 bytes but the file has 10"):
        read_inventory(root)


# --- JSON pathologies through the CLI ---------------------------------------------------------
def test_deeply_nested_header_exits_17_without_a_traceback(tmp_path: Path, tiny_native: Path) -> None:
    deep = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    root = single_file(tmp_path / "c", tiny_native / "config.json", shard_bytes(deep))
    assert_one_line_exit(
        cli("plan", str(root)), code_of(model_errors.MalformedHeaderError), "model.safetensors", "nested more than"
    )


def test_huge_integer_in_a_header_exits_17_without_a_traceback(tmp_path: Path, tiny_native: Path) -> None:
    huge = b'{"a":{"dtype":"U8","shape":[' + b"7" * 4_301 + b'],"data_offsets":[0,0]}}'
    root = single_file(tmp_path / "c", tiny_native / "config.json", shard_bytes(huge))
    assert_one_line_exit(
        cli("plan", str(root)), code_of(model_errors.MalformedHeaderError), "model.safetensors", "4301 digits"
    )


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
    with pytest.raises(model_errors.MalformedHeaderError, match=r"^model.safetensors: " + message) as exc:
        read_inventory(root)
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
    with pytest.raises(model_errors.MalformedHeaderError, match=reason):
        read_inventory(root)


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
    with pytest.raises(model_errors.MalformedHeaderError, match=rf"^{INDEX_NAME}: {message}") as exc:
        load_index(index, INDEX_NAME)
    assert "\n" not in str(exc.value)


def test_malformed_index_through_the_cli(tiny_native: Path, tmp_path: Path) -> None:
    src = native_copy(tiny_native, tmp_path / "src")
    index = json.loads((src / INDEX_NAME).read_text())
    index["metadata"]["total_size"] = "many"
    (src / INDEX_NAME).write_text(json.dumps(index))
    assert_one_line_exit(
        cli("plan", str(src)), code_of(model_errors.MalformedHeaderError), INDEX_NAME, "metadata.total_size"
    )


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
    assert (failed.name, report.exit_code) == ("index", code_of(errors.IndexCheckError))
    assert f"{shard}: data bytes 2..3 before tensor b belong to no tensor" in failed.reason


# --- one parser: the inventory, check and the loader refuse a header alike ---------------------
def test_the_inventory_check_and_the_loader_refuse_one_malformed_header_alike(
    tiny_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """The first tensor of a converted shard dropped from its header (and from the index):
    its bytes belong to no tensor. All three read headers through the one parser
    (model/safetensors_header.py), so all three give the same one-line MalformedHeaderError.
    Before it, the loader read the index its own way and said MissingKeyError instead."""
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

    with pytest.raises(model_errors.MalformedHeaderError) as by_inventory:
        read_inventory(out)
    with pytest.raises(model_errors.MalformedHeaderError) as by_loader:
        load_converted(out, "cpu")
    said = str(by_inventory.value)
    assert said.startswith(f"{shard}: data bytes 0..") and "belong to no tensor" in said and "\n" not in said
    assert str(by_loader.value) == said
    report = run_checks(out)
    assert (report.failures[0].name, report.failures[0].reason) == ("index", said)
