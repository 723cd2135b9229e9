"""The exit-code table (convert/exit_codes.py): every kind of every error family has its row,
the documented codes stay what users' CI scripts depend on, and every raise names a kind its
family has."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import dsv4
from dsv4.convert import errors as convert_errors
from dsv4.convert.exit_codes import EXIT_CODES, INTERNAL_ERROR, code_of, exit_code
from dsv4.mapping import errors as mapping_errors
from dsv4.model import config
from dsv4.model import errors as model_errors
from dsv4.model.presets import preset_config
from dsv4.model.safetensors_header import tensors_from_header

ROOT = Path(dsv4.__file__).resolve().parent  # the repository: the package is its root folder
EXIT_CODES_DOC = ROOT / "docs" / "exit-codes.md"  # README links it
CHECK_DOC = ROOT / "docs" / "check.md"  # `check`'s table: each check and its code


def families() -> dict[str, type[model_errors.DSV4Error]]:
    modules = (model_errors, mapping_errors, convert_errors)
    return {
        c.__name__: c
        for m in modules
        for c in vars(m).values()
        if isinstance(c, type) and issubclass(c, model_errors.DSV4Error) and c is not model_errors.DSV4Error
    }


def test_every_kind_has_its_own_row() -> None:
    kinds = [k for family in families().values() for k in family.KINDS]
    assert len(kinds) == len(set(kinds)), "a kind alone names the failure: no two families share one"
    assert set(kinds) == set(EXIT_CODES)


def test_an_error_family_refuses_a_kind_it_does_not_have() -> None:
    try:
        convert_errors.CheckError("x", kind="missing_shard")
    except ValueError as exc:
        assert "CheckError has no kind 'missing_shard'" in str(exc)
    else:
        raise AssertionError("CheckError took a CheckpointError's kind")


def test_every_raise_names_a_kind_its_family_has() -> None:
    known = families()
    unknown = []
    for file in sorted(p for d in ("model", "mapping", "convert", "scripts") for p in (ROOT / d).rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            kind = next((k.value for k in node.keywords if k.arg == "kind"), None)
            if name not in known:
                continue
            if kind is None:
                unknown.append(f"{file.relative_to(ROOT)}:{node.lineno}: {name} without a kind")
            elif isinstance(kind, ast.Constant) and kind.value not in known[name].KINDS:
                unknown.append(f"{file.relative_to(ROOT)}:{node.lineno}: {name} kind {kind.value!r}")
    assert unknown == []


def test_an_exception_that_is_not_a_refusal_is_an_internal_error() -> None:
    assert exit_code(KeyError("x")) == INTERNAL_ERROR == 1
    assert exit_code(model_errors.OutOfMemoryError("", kind="out_of_memory")) == 3


def test_the_codes_are_the_documented_ones() -> None:
    # a sample across the families, as the README's table has them since they were introduced
    named = {
        "missing_shard": 11,
        "malformed_header": 17,
        "malformed_config": 18,
        "unsupported_layout": 35,
        "source_not_found": 19,
        "dead_rule": 24,
        "uncovered_key": 31,
        "output_locked": 47,
        "overwrite_refused": 48,
        "dtype_mismatch": 54,
        "smoke_output": 55,
        "batch_failed": 66,
        "quant_carry": 82,
        "smoke_failed": 84,
        "native_parity": 85,
    }
    assert {kind: code_of(kind) for kind in named} == named


def test_distinct_failures_have_distinct_codes() -> None:
    # merged from test_convert.py::test_distinct_exit_codes_for_distinct_failures (its four
    # classes: the first two and the output's) and test_inventory.py::test_each_failure_has_its_own_exit_code
    # (the inventory's nine): every one of them pairwise distinct
    classes = [
        "missing_shard",
        "truncated_shard",
        "index_mismatch",
        "duplicate_tensor",
        "unknown_dtype",
        "unsafe_shard_path",
        "malformed_header",
        "missing_config",
        "source_not_found",
        "output_exists",
        "write_failed",
    ]
    codes = [code_of(c) for c in classes]
    assert len(set(codes)) == len(codes)


def test_every_code_appears_in_the_docs() -> None:
    section = EXIT_CODES_DOC.read_text()  # the page is the section: "# Exit codes" and its table
    documented = {int(n) for n in re.findall(r"\b(\d{1,3})\b", section)}
    # `check`'s table: each row ends with its code(s), "| 71 |" or "| 76 / 77 / 78 / 79 |"
    check_rows = re.findall(r"\| ([\d /]+) \|$", CHECK_DOC.read_text(), re.M)
    check_table = {int(n) for row in check_rows for n in row.split(" / ")}
    missing = sorted({code for code in EXIT_CODES.values() if code not in documented | check_table})
    assert missing == []


def test_every_code_has_its_meaning_in_the_docs() -> None:
    """Issue 28: 50 (`smoke --features` with NaN) was documented only as the bound of the
    range "50-55", never with its meaning. A code counts here where it stands alone (its
    meaning follows it), not as a range's bound."""
    section = EXIT_CODES_DOC.read_text()  # the page is the section
    explained = {int(n) for n in re.findall(r"(?<![\d-])(\d{1,3})(?![\d-])", section)}
    rows = re.findall(r"\| ([\d /]+) \|$", CHECK_DOC.read_text(), re.M)
    check_table = {int(n) for row in rows for n in row.split(" / ")}
    assert sorted({code for code in EXIT_CODES.values() if code not in explained | check_table}) == []


def test_an_error_carries_the_file_and_tensor_it_names_as_fields() -> None:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    try:
        tensors_from_header(header, "model-00001-of-00002.safetensors", 100, 112)
    except model_errors.CheckpointError as exc:
        assert exc.fields() == {"kind": "malformed_header", "path": "model-00001-of-00002.safetensors", "tensor": "b"}
        assert str(exc).startswith("model-00001-of-00002.safetensors: tensor b:")
    else:
        raise AssertionError("overlapping tensors were accepted")


def test_a_config_error_carries_its_field() -> None:
    try:
        config.ModelConfig.from_dict({**preset_config("tiny"), "hidden_size": "256"})
    except model_errors.CheckpointError as exc:
        assert exc.fields() == {"kind": "malformed_config", "path": "config.json", "field": "hidden_size"}
    else:
        raise AssertionError("a string hidden_size was accepted")
