"""The strict JSON parser refuses what safetensors refuses, and fails only with its own error."""

import pytest

from dsv4.model.strictjson import MAX_DEPTH, StrictJSONError, loads


def test_a_valid_document_parses_as_json_does():
    assert loads(b'{"a": [1, 2.5, {"b": null}], "c": true, "d": "x"}') == {
        "a": [1, 2.5, {"b": None}],
        "c": True,
        "d": "x",
    }


@pytest.mark.parametrize(
    "raw, reason",
    [
        ('{"w": 1, "w": 2}', "duplicate key 'w'"),
        ('{"x": {"w": 1, "w": 1}}', "duplicate key 'w'"),
        ("[" * 100_000 + "]" * 100_000, f"nested more than {MAX_DEPTH} levels deep"),
        ("[" * 100_000, f"nested more than {MAX_DEPTH} levels deep"),
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"nested more than {MAX_DEPTH} levels deep"),
        ("9" * 4301, "integer of 4301 digits"),
        ("-" + "9" * 21, "integer of 21 digits"),
        ('{"x": NaN}', "NaN is not JSON"),
        ("[Infinity]", "Infinity is not JSON"),
        ("1e999", "overflows a double"),
        (b"\xff{}", "not UTF-8"),
        ("{} {}", "not valid JSON"),
        ('{"a": }', "not valid JSON"),
    ],
)
def test_what_safetensors_refuses_is_one_strict_json_error(raw, reason):
    with pytest.raises(StrictJSONError) as info:
        loads(raw)
    assert reason in str(info.value)
    assert "\n" not in str(info.value)


def test_the_nesting_limit_itself_is_allowed():
    doc = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads(doc) is not None


def test_the_largest_unsigned_64_bit_integer_is_allowed():
    assert loads(str(2**64 - 1)) == 2**64 - 1
