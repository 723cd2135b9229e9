"""The exit-code table (convert/exit_codes.py): every error class of the tool has its row, and
the documented codes stay what users' CI scripts depend on."""

from __future__ import annotations

import re
from pathlib import Path

from dsv4.convert import errors as convert_errors
from dsv4.convert.exit_codes import EXIT_CODES, code_of
from dsv4.convert.inventory import tensors_from_header
from dsv4.mapping import errors as mapping_errors
from dsv4.model import config
from dsv4.model import errors as model_errors
from dsv4.model.presets import preset_config

README = Path(__file__).resolve().parents[2] / "README.md"


def error_classes() -> set[type]:
    modules = (model_errors, mapping_errors, convert_errors, config)
    return {
        c
        for m in modules
        for c in vars(m).values()
        if isinstance(c, type) and issubclass(c, model_errors.DSV4Error) and c.__module__ == m.__name__
    }


def test_every_error_class_has_its_own_row() -> None:
    assert error_classes() == set(EXIT_CODES)


def test_the_codes_are_the_documented_ones() -> None:
    # a sample across the families, as the README's table has them since they were introduced
    named = {
        model_errors.MissingShardError: 11,
        model_errors.MalformedHeaderError: 17,
        model_errors.MalformedConfigError: 18,
        config.ConfigFieldError: 18,
        config.UnsupportedConfig: 35,
        model_errors.UnsupportedLayoutError: 35,
        model_errors.SourceNotFoundError: 19,
        mapping_errors.DeadRuleError: 24,
        convert_errors.UncoveredKeyError: 31,
        convert_errors.OutputLockedError: 47,
        convert_errors.OverwriteRefusedError: 48,
        model_errors.DtypeMismatchError: 54,
        model_errors.SmokeCheckError: 55,
        convert_errors.BatchFailedError: 66,
        convert_errors.QuantCarryError: 82,
        convert_errors.SmokeFailedError: 84,
        convert_errors.NativeParityError: 85,
    }
    assert {cls: code_of(cls) for cls in named} == named


def test_distinct_failures_have_distinct_codes() -> None:
    # merged from test_convert.py::test_distinct_exit_codes_for_distinct_failures (its four
    # classes: the first two and the output's) and test_inventory.py::test_each_failure_has_its_own_exit_code
    # (the inventory's nine): every one of them pairwise distinct
    classes = [
        model_errors.MissingShardError,
        model_errors.TruncatedShardError,
        model_errors.IndexMismatchError,
        model_errors.DuplicateTensorError,
        model_errors.UnknownDtypeError,
        model_errors.UnsafeShardPathError,
        model_errors.MalformedHeaderError,
        model_errors.MissingConfigError,
        model_errors.SourceNotFoundError,
        convert_errors.OutputExistsError,
        convert_errors.WriteFailedError,
    ]
    codes = [code_of(c) for c in classes]
    assert len(set(codes)) == len(codes)


def test_every_code_appears_in_the_readme() -> None:
    text = README.read_text()
    section = text[text.index("## Exit codes") :]
    section = section[: section.index("\n## ", 4)]
    documented = {int(n) for n in re.findall(r"\b(\d{1,3})\b", section)}
    # `check`'s table: each row ends with its code(s), "| 71 |" or "| 76 / 77 / 78 / 79 |"
    check_table = {int(n) for row in re.findall(r"\| ([\d /]+) \|$", text, re.M) for n in row.split(" / ")}
    missing = sorted({code for code in EXIT_CODES.values() if code not in documented | check_table})
    assert missing == []


def test_an_error_carries_the_file_and_tensor_it_names_as_fields() -> None:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    try:
        tensors_from_header(header, "model-00001-of-00002.safetensors", 100, 112)
    except model_errors.MalformedHeaderError as exc:
        assert exc.fields() == {"path": "model-00001-of-00002.safetensors", "tensor": "b"}
        assert str(exc).startswith("model-00001-of-00002.safetensors: tensor b:")
    else:
        raise AssertionError("overlapping tensors were accepted")


def test_a_config_error_carries_its_field() -> None:
    try:
        config.ModelConfig.from_dict({**preset_config("tiny"), "hidden_size": "256"})
    except config.ConfigFieldError as exc:
        assert exc.fields() == {"field": "hidden_size"}
    else:
        raise AssertionError("a string hidden_size was accepted")
