"""config.json goes through one validating loader (dsv4.model.config): every field the tool
uses has its type, sign, range and length checked, with bounds far above the released
models; the field is named in a one-line error; malformed is exit 18, unsupported 35; plan,
convert, check, smoke and the loader give the same config the same verdict.

Property (hypothesis): whatever config.json holds, the loader returns a valid ModelConfig or
raises malformed_config or unsupported_layout (one line, exit 18 or 35); never another
exception. Inputs: random JSON, and the released configs (model/presets.py) with values and
types mutated, keys dropped, junk added, and their JSON text damaged. Derandomized (the same
examples on every run, no example database), EXAMPLES per target."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hubserver import FakeHub, hub_env
from hubserver import run_cli as hub_cli
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dsv4.convert.check.run import run_checks
from dsv4.convert.exit_codes import exit_code
from dsv4.convert.pipeline import convert
from dsv4.convert.plan import plan_reverse
from dsv4.convert.sources.inventory import read_inventory
from dsv4.convert.synth import write_checkpoint
from dsv4.mapping.table import load_table
from dsv4.model import errors as model_errors
from dsv4.model import native as native_layout
from dsv4.model.config import ModelConfig, parse_config
from dsv4.model.errors import CheckpointError, DSV4Error
from dsv4.model.layout import target_layout
from dsv4.model.loader import load_converted
from dsv4.model.presets import EXPERT_DTYPE, PRESETS, preset_config

ADDRESS_SPACE = 4 << 30  # a CLI run that allocates without bound dies instead of swapping
CLI_TIMEOUT_S = 120


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`convert-dsv4 ARGS` in a subprocess with bounded memory and time."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    return subprocess.run(
        [sys.executable, "-m", "dsv4", *args], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, preexec_fn=limit
    )


def assert_one_line_error(r: subprocess.CompletedProcess[str], code: int, *named: str) -> None:
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    for text in named:
        assert text in r.stderr, r.stderr


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny instruct checkpoint with one MTP block (no main layers: plan reads headers only)."""
    return write_checkpoint(tmp_path_factory.mktemp("strict") / "native", preset="tiny")


@pytest.fixture(scope="module")
def converted(native: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(native, tmp_path_factory.mktemp("strict-out") / "xpu").out


def with_config(src: Path, dst: Path, text: str) -> Path:
    """A copy of checkpoint `src` whose config.json is `text`."""
    shutil.copytree(src, dst, copy_function=os.link)
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(text)
    return dst


def tiny_json(**changes: Any) -> str:
    return json.dumps({**preset_config("tiny"), **changes})


def block_size(value: Any) -> str:
    raw = preset_config("tiny")
    raw["quantization_config"]["weight_block_size"] = value
    return json.dumps(raw)


HUGE_INTEGER = "9" * 4301  # past Python's int-from-string limit of 4,300 digits
DEEP = "[" * 100_000 + "]" * 100_000

# (config.json text, exit code, what the one stderr line must say)
PATHOLOGIES = {
    "top-level-list": ("[1, 2]", 18, "the top level is [1, 2] (a list); expected a JSON object"),
    "nested-100000-deep": (tiny_json()[:-1] + f', "rope_scaling": {DEEP}}}', 18, "nested more than 64 levels deep"),
    "hidden-size-string": (tiny_json(hidden_size="256"), 18, 'hidden_size is "256" (a string); expected an integer'),
    "hidden-size-true": (tiny_json(hidden_size=True), 18, "hidden_size is true (a boolean); expected an integer"),
    "block-size-length-1": (
        block_size([128]),
        18,
        "quantization_config.weight_block_size has 1 entry; expected exactly 2",
    ),
    "block-size-with-0": (
        block_size([128, 0]),
        18,
        "quantization_config.weight_block_size[1] is 0; expected an integer in 1..",
    ),
    "integer-of-4301-digits": (tiny_json()[:-1] + f', "vocab_size": {HUGE_INTEGER}}}', 18, "integer of 4301 digits"),
    "num-nextn-10-million": (
        tiny_json(num_nextn_predict_layers=10_000_000),
        18,
        "num_nextn_predict_layers is 10000000; expected an integer in 0..16",
    ),
    # V4's MTP fields under V4.1's model_type: V4.1's only drafter is DSpark
    "v4.1": (tiny_json(model_type="deepseek_v41"), 35, "a DeepSeek V4.1 config without dspark_* fields"),
}


@pytest.mark.parametrize("case", PATHOLOGIES)
def test_plan_refuses_a_malformed_config_with_one_line_naming_it(native: Path, tmp_path: Path, case: str) -> None:
    text, code, said = PATHOLOGIES[case]
    ckpt = with_config(native, tmp_path / "ckpt", text)
    # plan names V4.1's drafter before the config loader reads its fields (tests/convert/test_drafters.py)
    expected = f"{ckpt}: holds a DeepSeek V4.1 DSpark" if case == "v4.1" else f"{ckpt}/config.json: {said}"
    assert_one_line_error(run_cli("plan", str(ckpt)), code, expected)


def test_num_nextn_beyond_the_blocks_present_names_the_config_field(native: Path, tmp_path: Path) -> None:
    ckpt = with_config(native, tmp_path / "ckpt", tiny_json(num_nextn_predict_layers=2))
    r = run_cli("plan", str(ckpt))
    assert_one_line_error(
        r, 35, f"{ckpt}/config.json: num_nextn_predict_layers = 2 but the shards hold 1 draft block(s) (mtp.0)"
    )
    assert "not in the checkpoint" not in r.stderr  # not a missing tensor


def test_a_hub_source_gets_the_same_verdict(native: Path, tmp_path: Path) -> None:
    files = {p.name: p.read_bytes() for p in native.iterdir()}
    with FakeHub() as hub:
        commit = hub.commit("org/listcfg", {**files, "config.json": b"[1, 2]"})
        r = hub_cli("plan", "org/listcfg", env=hub_env(hub, tmp_path / "hf"))
    assert_one_line_error(
        r, 18, f"org/listcfg/config.json@{commit[:12]}: the top level is [1, 2] (a list); expected a JSON object"
    )


def test_check_on_an_output_config_that_is_a_list_fails_the_config_check(converted: Path, tmp_path: Path) -> None:
    out = with_config(converted, tmp_path / "out", "[]")
    r = run_cli("check", str(out))
    assert_one_line_error(r, 75, f"{out}/config.json: the top level is [] (a list)")
    assert "FAIL config" in r.stdout and "SKIP layout" in r.stdout


@pytest.mark.slow
def test_smoke_on_an_output_config_that_is_a_list_exits_18(converted: Path, tmp_path: Path) -> None:
    out = with_config(converted, tmp_path / "out", "[]")
    assert_one_line_error(
        run_cli("smoke", str(out), "--device", "cpu"), 18, f"{out}/config.json: the top level is [] (a list)"
    )


# --- the same verdict everywhere -------------------------------------------------------
def plan_verdict(ckpt: Path) -> tuple[int, str]:
    try:
        assert read_inventory(ckpt).model_config is not None  # what planning validates (once)
    except model_errors.DSV4Error as exc:
        return exit_code(exc), str(exc)
    return 0, ""


def loader_verdict(ckpt: Path) -> tuple[int, str]:
    try:
        load_converted(ckpt, "cpu")
    except model_errors.DSV4Error as exc:
        return exit_code(exc), str(exc)
    return 0, ""


@pytest.mark.parametrize(
    "case", ["top-level-list", "hidden-size-string", "block-size-with-0", "num-nextn-10-million", "v4.1"]
)
def test_plan_check_and_loader_give_a_config_the_same_verdict(converted: Path, tmp_path: Path, case: str) -> None:
    text, code, said = PATHOLOGIES[case]
    out = with_config(converted, tmp_path / "out", text)
    verdict = plan_verdict(out)
    assert verdict[0] == code and verdict[1].startswith(f"{out}/config.json: ") and said in verdict[1]
    assert loader_verdict(out) == verdict
    result = {r.name: r for r in run_checks(out).results}
    assert (result["config"].status, result["config"].reason) == ("fail", verdict[1])


def test_loader_names_num_nextn_when_the_shards_hold_fewer_layers(converted: Path, tmp_path: Path) -> None:
    out = with_config(
        converted,
        tmp_path / "out",
        json.dumps({**json.loads((converted / "config.json").read_text()), "num_nextn_predict_layers": 3}),
    )
    with pytest.raises(
        model_errors.CheckpointError,
        match=r"num_nextn_predict_layers = 3 but the shards hold 1 draft block\(s\) \(model\.layers\.2\)",
    ) as raised:
        load_converted(out, "cpu")
    assert raised.value.kind == "unsupported_layout"


def test_reverse_plan_names_num_nextn_when_the_shards_hold_fewer_layers(converted: Path, tmp_path: Path) -> None:
    out = with_config(
        converted,
        tmp_path / "out",
        json.dumps({**json.loads((converted / "config.json").read_text()), "num_nextn_predict_layers": 2}),
    )
    with pytest.raises(
        model_errors.CheckpointError,
        match=r"config.json: num_nextn_predict_layers = 2 but the shards hold 1 draft block\(s\) \(model\.layers\.2\)",
    ) as raised:
        plan_reverse(read_inventory(out), load_table("xpu"))
    assert raised.value.kind == "unsupported_layout"


# --- the loader itself ------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("variant", ["instruct", "base"])
def test_the_released_configs_are_valid(name: str, variant: str) -> None:
    cfg = ModelConfig.from_dict(preset_config(name, variant))
    assert cfg.num_nextn_predict_layers == 1 and cfg.weight_block_size == (128, 128)


def tiny_with(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    raw = preset_config("tiny")
    edit(raw)
    return raw


def set_field(name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda raw: raw.__setitem__(name, value)


# (edit of the tiny config, error class, field named, message part)
REFUSALS = [
    (
        set_field("num_hidden_layers", -1),
        "malformed_config",
        "num_hidden_layers",
        "num_hidden_layers is -1; expected an integer in 1..1024",
    ),
    (
        set_field("vocab_size", 2**62),
        "malformed_config",
        "vocab_size",
        "vocab_size is 4611686018427387904; expected an integer in 1..16777216",
    ),
    (
        set_field("n_routed_experts", 1.0),
        "malformed_config",
        "n_routed_experts",
        "n_routed_experts is 1.0; expected an integer",
    ),
    (set_field("hc_eps", 0), "malformed_config", "hc_eps", "hc_eps is 0; expected a finite number > 0 and < 1"),
    (set_field("rope_theta", "1e4"), "malformed_config", "rope_theta", 'rope_theta is "1e4" (a string)'),
    (
        set_field("rope_theta", 2**64),
        "malformed_config",
        "rope_theta",
        "rope_theta is 18446744073709551616; expected a finite number > 0",
    ),
    (
        set_field("rms_norm_eps", float("nan")),
        "malformed_config",
        "rms_norm_eps",
        "rms_norm_eps is nan; expected a finite number",
    ),
    (
        set_field("norm_topk_prob", 1),
        "malformed_config",
        "norm_topk_prob",
        "norm_topk_prob is 1; expected true or false",
    ),
    (set_field("expert_dtype", 4), "malformed_config", "expert_dtype", "expert_dtype is 4; expected a string"),
    (
        set_field("quantization_config", []),
        "malformed_config",
        "quantization_config",
        "quantization_config is [] (a list); expected an object",
    ),
    (
        set_field("compress_ratios", [4, 128]),
        "malformed_config",
        "compress_ratios",
        "compress_ratios has 2 entries; expected one per main layer (num_hidden_layers = 2) and one per draft layer: "
        "3..18",
    ),
    (
        set_field("compress_ratios", [4, -128, 0]),
        "malformed_config",
        "compress_ratios[1]",
        "compress_ratios[1] is -128; expected an integer in 0..",
    ),
    (
        set_field("compress_ratios", "4,128,0"),
        "malformed_config",
        "compress_ratios",
        'compress_ratios is "4,128,0" (a string); expected a list of integers',
    ),
    (
        set_field("qk_rope_head_dim", 63),
        "malformed_config",
        "qk_rope_head_dim",
        "expected an even number <= head_dim (128)",
    ),
    (set_field("o_groups", 3), "malformed_config", "o_groups", "expected a divisor of num_attention_heads (4)"),
    (
        set_field("num_experts_per_tok", 9),
        "malformed_config",
        "num_experts_per_tok",
        "num_experts_per_tok is 9, more than n_routed_experts (8)",
    ),
    (lambda raw: raw.pop("hidden_size"), "malformed_config", "hidden_size", "lacks required field(s): hidden_size"),
    (
        set_field("model_type", "llama"),
        "unsupported_layout",
        "model_type",
        "model_type 'llama'; this tool converts 'deepseek_v4' and 'deepseek_v41' checkpoints only",
    ),
    (
        set_field("num_nextn_predict_layers", 0),
        "unsupported_layout",
        "num_nextn_predict_layers",
        "the checkpoint has no MTP draft layer",
    ),
    (set_field("n_shared_experts", 2), "unsupported_layout", "n_shared_experts", "n_shared_experts is 2"),
    (
        set_field("compress_ratios", [4, 128, 4]),
        "unsupported_layout",
        "compress_ratios",
        "the MTP layer has no compressor",
    ),
    (set_field("topk_method", "greedy"), "unsupported_layout", "topk_method", "topk_method 'greedy'"),
    (set_field("scoring_func", "sigmoid"), "unsupported_layout", "scoring_func", "scoring_func 'sigmoid'"),
    (set_field("expert_dtype", "mxfp6"), "unsupported_layout", "expert_dtype", "unknown expert_dtype 'mxfp6'"),
]


@pytest.mark.parametrize(
    ("edit", "kind", "field", "said"), REFUSALS, ids=[f"{r[2]}-{i}" for i, r in enumerate(REFUSALS)]
)
def test_each_refusal_names_its_field(
    edit: Callable[[dict[str, Any]], None],
    kind: str,
    field: str,
    said: str,
) -> None:
    with pytest.raises(DSV4Error) as caught:
        ModelConfig.from_dict(tiny_with(edit))
    assert caught.value.kind == kind
    assert caught.value.kind == kind and caught.value.field == field
    assert said in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(("raw", "kind"), [({"expert_dtype": None}, "fp4"), ({"expert_dtype": "fp8"}, "fp8")])
def test_absent_or_null_expert_dtype_means_fp4(raw: dict[str, Any], kind: str) -> None:
    assert ModelConfig.from_dict({**preset_config("tiny"), **raw}).expert_dtype == kind


def test_a_config_built_in_python_is_validated_too() -> None:
    cfg = ModelConfig.from_dict(preset_config("tiny"))
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers is 10000000") as raised:
        dataclasses.replace(cfg, num_nextn_predict_layers=10_000_000)
    assert raised.value.kind == "malformed_config"


@pytest.mark.parametrize("text", [b"\xff{}", b'{"a": 1, "a": 2}', b'{"hidden_size": NaN}', b"{", b"null"])
def test_parse_config_refuses_what_is_not_a_strict_json_object(text: bytes) -> None:
    with pytest.raises(CheckpointError) as caught:
        parse_config(text)
    assert caught.value.kind == "malformed_config"
    assert "\n" not in str(caught.value)


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


CONFIG_ERRORS = ("malformed_config", "unsupported_layout")  # exit 18 or 35


def load_or_refuse(load: Any, raw: Any) -> ModelConfig | model_errors.DSV4Error:
    """The loader's outcome; any exception other than its own fails the property."""
    try:
        cfg = load(raw)
    except model_errors.CheckpointError as exc:
        if exc.kind not in CONFIG_ERRORS:
            raise
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
    native_layout.mtp_layout(cfg, cfg.num_nextn_predict_layers - 1, with_emb_head=True)
    assert target_layout(cfg)


@FUZZ
@given(json_values)
def test_random_json_is_refused_or_valid(raw: Any) -> None:
    outcome = load_or_refuse(ModelConfig.from_dict, raw)
    assert (
        isinstance(outcome, model_errors.CheckpointError) and outcome.kind in CONFIG_ERRORS
    )  # random JSON never holds the required fields


@pytest.mark.slow
@FUZZ
@given(mutated_configs())
def test_mutated_released_configs_give_a_valid_config_or_its_error(raw: dict[str, Any]) -> None:
    outcome = load_or_refuse(ModelConfig.from_dict, raw)
    if isinstance(outcome, ModelConfig):
        assert_usable(outcome)


@pytest.mark.slow
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
