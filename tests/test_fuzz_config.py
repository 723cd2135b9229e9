"""Property: whatever config.json holds, the validating loader returns a valid ModelConfig or
raises MalformedConfigError or UnsupportedLayoutError (one line, exit 18 or 35); never
another exception. Inputs: random JSON, and the released configs (model/presets.py) with
values and types mutated, keys dropped, junk added, and their JSON text damaged.

Derandomized (the same examples on every run, no example database), EXAMPLES per target."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dsv4.convert.exit_codes import exit_code
from dsv4.model import errors as model_errors
from dsv4.model import native
from dsv4.model.config import ModelConfig
from dsv4.model.layout import target_layout
from dsv4.model.presets import EXPERT_DTYPE, PRESETS, preset_config

EXAMPLES = 300
FUZZ = settings(
    max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

RELEASED = [preset_config(name, variant) for name in sorted(PRESETS) for variant in ("instruct", "base")]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 3, 16, 17, 127, 128, 1024, 10_000_000, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "fp4",
            "fp8",
            "mxfp6",
            "sqrtsoftplus",
            "sigmoid",
            "noaux_tc",
            "greedy",
            "deepseek_v4",
            "deepseek_v41",
            "256",
            "",
        ]
    ),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)),
    max_leaves=12,
)


def numeric_nudge(value: Any) -> st.SearchStrategy[Any]:
    """Values near a released one: off by one, negated, zero, scaled, as a float or a string."""
    if type(value) is int:
        return st.sampled_from(
            [value - 1, value + 1, -value, 0, value * 1000, float(value), str(value), [value], value > 0]
        )
    if type(value) is float and math.isfinite(value):
        return st.sampled_from([-value, 0.0, value * 1e300, float("nan"), float("inf"), int(value), str(value)])
    return json_values


@st.composite
def mutated_configs(draw: st.DrawFn) -> dict[str, Any]:
    raw = json.loads(json.dumps(draw(st.sampled_from(RELEASED))))  # a deep copy
    keys = sorted(raw)
    for _ in range(draw(st.integers(0, 4))):
        action = draw(st.sampled_from(["nudge", "retype", "drop", "junk", "block", "ratios"]))
        key = draw(st.sampled_from(keys))
        if action == "nudge" and key in raw:
            raw[key] = draw(numeric_nudge(raw[key]))
        elif action == "retype":
            raw[key] = draw(json_values)
        elif action == "drop":
            raw.pop(key, None)
        elif action == "junk":
            raw[draw(st.text(max_size=10))] = draw(json_values)
        elif action == "block" and isinstance(raw.get("quantization_config"), dict):
            raw["quantization_config"]["weight_block_size"] = draw(
                st.one_of(json_values, st.lists(st.integers(-2, 300), max_size=4))
            )
        elif action == "ratios":
            n = raw.get("num_hidden_layers", 0) if type(raw.get("num_hidden_layers")) is int else 0
            raw["compress_ratios"] = draw(
                st.lists(
                    st.sampled_from([0, 4, 128, -4, 2**40]), min_size=max(0, min(n, 64) - 1), max_size=min(n, 64) + 2
                )
            )
    return raw


CONFIG_ERRORS = (model_errors.MalformedConfigError, model_errors.UnsupportedLayoutError)  # exit 18 or 35


def load_or_refuse(load: Any, raw: Any) -> ModelConfig | model_errors.DSV4Error:
    """The loader's outcome; any exception other than its own fails the property."""
    try:
        cfg = load(raw)
    except CONFIG_ERRORS as exc:
        assert str(exc) and "\n" not in str(exc), repr(exc)
        assert exit_code(exc) in (18, 35)
        event(f"refused {exit_code(exc)}")
        return exc
    event("accepted")
    return cfg


def assert_usable(cfg: ModelConfig) -> None:
    """A config the loader accepts is one the tool can lay out: the native draft layout and
    the bundled model's (meta-device) target layout build without error."""
    assert 1 <= cfg.num_nextn_predict_layers <= 16 and cfg.expert_dtype in EXPERT_DTYPE.values()
    native.mtp_layout(cfg, cfg.num_nextn_predict_layers - 1, with_emb_head=True)
    assert target_layout(cfg)


@FUZZ
@given(json_values)
def test_random_json_is_refused_or_valid(raw: Any) -> None:
    outcome = load_or_refuse(ModelConfig.from_dict, raw)
    assert isinstance(outcome, CONFIG_ERRORS)  # random JSON never holds the required fields


@FUZZ
@given(mutated_configs())
def test_mutated_released_configs_give_a_valid_config_or_its_error(raw: dict[str, Any]) -> None:
    outcome = load_or_refuse(ModelConfig.from_dict, raw)
    if isinstance(outcome, ModelConfig):
        assert_usable(outcome)


@FUZZ
@given(mutated_configs(), st.data())
def test_damaged_config_json_text_gives_a_valid_config_or_its_error(raw: dict[str, Any], data: st.DataObject) -> None:
    text = bytearray(json.dumps(raw, allow_nan=True).encode())  # NaN / Infinity appear as such
    for _ in range(data.draw(st.integers(0, 3))):
        at = data.draw(st.integers(0, len(text)))
        cut = data.draw(st.integers(0, 3))
        text[at : at + cut] = data.draw(
            st.binary(max_size=3) | st.sampled_from([b"[", b"{", b'"', b"9" * 30, b"NaN", b"\xff", b", "])
        )
    outcome = load_or_refuse(ModelConfig.from_json, bytes(text))
    if isinstance(outcome, ModelConfig):
        assert_usable(outcome)


def test_the_mutations_reach_both_outcomes() -> None:
    """The generator is not so hostile that nothing passes, nor so tame that nothing fails."""
    seen: set[str] = set()

    @settings(max_examples=100, derandomize=True, database=None, deadline=None)
    @given(mutated_configs())
    def probe(raw: dict[str, Any]) -> None:
        seen.add(type(load_or_refuse(ModelConfig.from_dict, raw)).__name__)

    probe()
    assert "ModelConfig" in seen and seen - {"ModelConfig"}
