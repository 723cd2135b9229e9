"""Property-based tests: random and mutated records go into the parsers that read them, and
the only outcomes allowed are a valid result or one of the tool's own errors (a DSV4Error
subclass, one line). Accepted input must also be right, not merely parsed.

Targets: `check`'s reading of conversion.json (the sizes and checksums checks), the
converter's read_record, and batch manifests (load_manifest, TOML text). Each runs a fixed
number of examples, derandomized, so CI is reproducible and fast."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from dsv4.convert.batch import Manifest, load_manifest
from dsv4.convert.check import _Context, check_checksums, check_index, check_readable, check_sizes
from dsv4.convert.output import read_record
from dsv4.convert.pipeline import convert
from dsv4.convert.sizes import MAX_SHARD_SIZE
from dsv4.model.errors import DSV4Error

EXAMPLES = 200
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)

# any JSON value, NaN and infinities included (json.dumps writes them; strict JSON refuses them)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def one_line_own_error(exc: BaseException) -> None:
    assert isinstance(exc, DSV4Error), f"{type(exc).__name__}: {exc}"
    assert "\n" not in str(exc) and str(exc), repr(exc)
    outcome(f"refused: {type(exc).__name__}")


def outcome(what: str) -> None:
    if currently_in_test_context():  # --hypothesis-show-statistics shows the spread
        event(what)


def mutate_text(text: str, data: st.DataObject) -> str:
    """Insert, delete or replace a few characters anywhere in `text`."""
    chars = list(text)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        at = data.draw(st.integers(0, len(chars)), label="at")
        op = data.draw(st.sampled_from(["insert", "delete", "replace"]), label="op")
        new = data.draw(st.sampled_from(list('{}[]",:0-9. \n\\ae=#') + ["NaN", "1e999", "true", "null"]), label="text")
        if op == "insert" or not chars:
            chars.insert(at, new)
        elif op == "delete":
            del chars[min(at, len(chars) - 1)]
        else:
            chars[min(at, len(chars) - 1)] = new
    return "".join(chars)


# --- check: conversion.json ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def checked(tiny_native: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[_Context, dict[str, Any]]:
    """A converted checkpoint whose index and data were read once (the checks conversion.json
    feeds need them), and its true conversion.json."""
    out = tmp_path_factory.mktemp("fuzz-record") / "xpu"
    convert(tiny_native, out)
    ctx = _Context(out, fast=False, smoke=False, native=None, device="cpu", tokens=1, min_top1=1.0, max_rel_diff=0.0)
    check_index(ctx, {})
    check_readable(ctx, {})
    return ctx, json.loads((out / "conversion.json").read_text())


def check_record(ctx: _Context, raw: bytes) -> dict[str, Any] | None:
    """Run the checks that read conversion.json on `raw`; the record if both passed."""
    (ctx.root / "conversion.json").write_bytes(raw)
    ctx.record = None
    try:
        check_sizes(ctx, {})
        check_checksums(ctx, {})
    except Exception as exc:
        one_line_own_error(exc)
        return None
    outcome("accepted")
    return ctx.record.to_json() if ctx.record is not None else None  # the typed record (model/record.py), as JSON


def assert_accepted_record_is_true(ctx: _Context, record: dict[str, Any]) -> None:
    """Passing both checks means the record lists exactly the shards' tensors, right."""
    assert ctx.inv is not None
    assert set(record["tensors"]) == set(ctx.inv.tensors)
    for name, src in ctx.inv.tensors.items():
        entry = record["tensors"][name]
        assert (entry["file"], entry["nbytes"], entry["sha256"]) == (src.file, src.nbytes, ctx.hashes[name])


@FUZZ
@given(value=json_values)
def test_random_conversion_records(checked: tuple[_Context, dict[str, Any]], value: Any) -> None:
    ctx, _ = checked
    record = check_record(ctx, json.dumps(value).encode())
    assert record is None  # a random value is never a complete, true record


@FUZZ
@given(data=st.data())
def test_mutated_conversion_records(checked: tuple[_Context, dict[str, Any]], data: st.DataObject) -> None:
    ctx, true = checked
    record = json.loads(json.dumps(true))
    names = sorted(record["tensors"])
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        where = data.draw(
            st.sampled_from(["entry", "field", "drop field", "tensors", "top", "add tensor"]), label="where"
        )
        name = data.draw(st.sampled_from(names), label="tensor")
        field = data.draw(st.sampled_from(["file", "nbytes", "sha256", "other"]), label="field")
        value = data.draw(
            json_values | st.sampled_from([true["tensors"][name][f] for f in ("file", "nbytes", "sha256")]),
            label="value",
        )
        tensors = (
            record["tensors"] if isinstance(record["tensors"], dict) else {}
        )  # an earlier mutation may have replaced it
        if where == "entry":
            tensors[name] = value
        elif where == "field" and isinstance(tensors.get(name), dict):
            tensors[name][field] = value
        elif where == "drop field" and isinstance(tensors.get(name), dict):
            tensors[name].pop(field, None)
        elif where == "tensors":
            record["tensors"] = value
        elif where == "add tensor":
            tensors[data.draw(st.text(max_size=20), label="new name")] = value
        elif where == "top":
            record[data.draw(st.sampled_from(["tool", "table", "source", "fingerprint"]), label="key")] = value
    text = json.dumps(record, indent=2)
    if data.draw(st.booleans(), label="edit the text"):
        text = mutate_text(text, data)
    accepted = check_record(ctx, text.encode("utf-8", "surrogatepass"))
    if accepted is not None:
        assert_accepted_record_is_true(ctx, accepted)


@FUZZ
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_read_record_takes_any_bytes(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    path = tmp_path_factory.getbasetemp() / "any-record.json"
    path.write_bytes(raw)
    record = read_record(path)
    assert record is None or isinstance(record, dict)


# --- batch manifests ----------------------------------------------------------------------------
VALID_MANIFEST = """\
target = "xpu"
sources = [
  "deepseek-ai/DeepSeek-V4-Flash",
  "deepseek-ai/DeepSeek-V4-Pro@main",
  { repo = "deepseek-ai/DeepSeek-V4-Flash-Base", revision = "0123abc" },
]

[output]
dir = "converted"
name = "{name}-{target}"
repo = "my-org/{name}-MTP-{target}"
private = true

[options]
max_shard_size = 5_000_000_000
check = true
"""


def toml_value(value: Any) -> str:
    """`value` as a TOML value (inline tables and arrays)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


manifest_words = st.sampled_from(
    [
        "org/a",
        "org/b@v2",
        "org/a@",
        "@v1",
        "a/b/c",
        "org/a@../x",
        "{name}-{target}",
        "{org}-{revision}",
        "{name:>99999999}",
        "{name.upper}",
        "{org.x}",
        "{0}",
        "{",
        "..",
        ".",
        "x/y",
        "xpu",
        "../../x",
        "",
        " ",
    ]
)
manifest_values = st.recursive(
    manifest_words
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=10)
    | st.sampled_from([5_000_000_000, 0, -1, 2**63, 2**63 - 1]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["repo", "revision", "dir", "name", "x"]) | st.text(max_size=6), inner, max_size=3
        )
    ),
    max_leaves=10,
)
manifests = st.fixed_dictionaries(
    {},
    optional={
        # mostly plausible values, so that some manifests get past the first checks
        "target": st.just("xpu") | manifest_values,
        "sources": st.lists(
            st.sampled_from(["org/a", "org/b@v2", "org/a@v3", {"repo": "org/c", "revision": "abc"}]) | manifest_values,
            max_size=4,
        )
        | manifest_values,
        "output": st.dictionaries(
            st.sampled_from(["dir", "name", "repo", "private", "colour"]), manifest_values, max_size=4
        )
        | manifest_values,
        "options": st.dictionaries(
            st.sampled_from(["max_shard_size", "check", "speed"]),
            st.sampled_from([1, 10**9, True]) | manifest_values,
            max_size=2,
        )
        | manifest_values,
        "extra": manifest_values,
    },
)


def load(tmp_path_factory: pytest.TempPathFactory, text: str) -> Manifest | None:
    path = tmp_path_factory.getbasetemp() / "fuzz-manifest.toml"
    path.write_text(text, encoding="utf-8")
    try:
        manifest = load_manifest(path)
    except Exception as exc:
        one_line_own_error(exc)
        return None
    assert_manifest_is_sound(manifest)
    outcome("accepted")
    return manifest


def assert_manifest_is_sound(m: Manifest) -> None:
    assert isinstance(m.target, str) and m.sources
    assert isinstance(m.max_shard_size, int) and 0 < m.max_shard_size <= MAX_SHARD_SIZE
    assert [s.key for s in m.sources] == sorted({s.key for s in m.sources})
    for s in m.sources:
        assert s.output.parent == m.out_dir and s.output.name not in ("", ".", "..")
        assert s.push_repo is None or s.push_repo.count("/") == 1


@FUZZ
@given(manifest=manifests)
def test_random_manifests(tmp_path_factory: pytest.TempPathFactory, manifest: dict[str, Any]) -> None:
    load(tmp_path_factory, "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in manifest.items()))


@FUZZ
@given(data=st.data())
def test_mutated_manifests(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    load(tmp_path_factory, mutate_text(VALID_MANIFEST, data))


# values near the valid ones: templates with format tricks, sizes at the edges, odd sources
PLAUSIBLE = [
    "{name}-{revision}",
    "{org}_{name}",
    "{name.upper}",
    "{org.x}",
    "{name:>99999999}",
    "{name!r}",
    "{0}",
    "{{name}}",
    "x/{name}",
    "org/{name}",
    1,
    2**63 - 1,
    2**63,
    0,
    True,
    "org/a@v9",
    {"repo": "org/d"},
    {"repo": "org/e@x"},
    [],
]


@FUZZ
@given(data=st.data())
def test_manifests_with_values_replaced(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    manifest = tomllib.loads(VALID_MANIFEST)
    for _ in range(data.draw(st.integers(1, 2), label="replacements")):
        section = data.draw(st.sampled_from([None, "output", "options", "sources"]), label="section")
        value = data.draw(st.sampled_from(PLAUSIBLE) | manifest_values, label="value")
        if section is None:
            manifest[data.draw(st.sampled_from(["target", "sources", "output", "options", "x"]), label="key")] = value
        elif section == "sources" and isinstance(manifest.get("sources"), list) and manifest["sources"]:
            manifest["sources"][data.draw(st.integers(0, len(manifest["sources"]) - 1), label="at")] = value
        elif isinstance(manifest.get(section), dict):
            keys = ["dir", "name", "repo", "private"] if section == "output" else ["max_shard_size", "check"]
            manifest[section][data.draw(st.sampled_from(keys), label="key")] = value
    load(tmp_path_factory, "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in manifest.items()))


def test_the_valid_manifest_the_mutations_start_from_loads(tmp_path_factory: pytest.TempPathFactory) -> None:
    manifest = load(tmp_path_factory, VALID_MANIFEST)
    assert manifest is not None and len(manifest.sources) == 3


def test_the_true_record_the_mutations_start_from_passes(checked: tuple[_Context, dict[str, Any]]) -> None:
    ctx, true = checked
    accepted = check_record(ctx, json.dumps(true).encode())
    assert accepted is not None
    assert_accepted_record_is_true(ctx, accepted)
