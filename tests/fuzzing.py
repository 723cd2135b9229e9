"""What the property-based tests of records share (hypothesis): random and mutated records go into
the parsers that read them, and the only outcomes allowed are a valid result or one of the tool's
own errors (a DSV4Error subclass, one line). Accepted input must also be right, not merely parsed.

Used by tests/convert/test_check.py (`check`'s reading of conversion.json, the converter's
read_record) and tests/convert/test_batch.py (batch manifests: load_manifest, TOML text). Each runs
a fixed number of examples, derandomized, so CI is reproducible and fast."""

from __future__ import annotations

from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st

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
