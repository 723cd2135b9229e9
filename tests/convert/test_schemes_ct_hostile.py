"""Hostile compressed-tensors targets: each refused with one line naming the field at fault,
through the caller's error factory, all of them together in a few seconds (a regular
expression that backtracks without bound is stopped after a second, not run to its end)."""

from __future__ import annotations

import sys
import time
from functools import partial
from typing import Any

import pytest

from dsv4.convert.errors import CheckError, PlanError
from dsv4.convert.inmemory import bundled_plan
from dsv4.convert.plan import Plan
from dsv4.convert.schemes import registry
from dsv4.convert.schemes.base import layer_map
from dsv4.convert.synth import write_checkpoint
from dsv4.model.native import standalone_draft_layout
from tests.quant_configs import preset_group, serving_target

G = "quantization_config.config_groups.group_0"
W4 = serving_target("W4A16", ["lm_head"], fp8_wo_a=False)


def with_group(**changes: Any) -> dict[str, Any]:
    group = {**W4["config_groups"]["group_0"], **changes}
    return {**W4, "config_groups": {"group_0": {k: v for k, v in group.items() if v is not None}}}


def with_weights(**changes: Any) -> dict[str, Any]:
    return with_group(weights={**W4["config_groups"]["group_0"]["weights"], **changes})


HOSTILE: dict[str, tuple[Any, str, str]] = {
    "unknown-method": ({"quant_method": "awq-ish"}, "quantization_config.quant_method", "is not a quantisation method"),
    "not-an-object": ("compressed-tensors", "quantization_config", "is str, expected an object"),
    "unknown-format": (
        {**W4, "format": "zip-quantized"},
        "quantization_config.format",
        "is not a compressed-tensors format",
    ),
    "unknown-group-format": (with_group(format="int3-packed"), f"{G}.format", "is not a compressed-tensors format"),
    "unknown-key": ({**W4, "bogus": 1}, "quantization_config.bogus", "is not a compressed-tensors field"),
    "no-groups": ({**W4, "config_groups": {}}, "quantization_config.config_groups", "non-empty"),
    "group-without-targets": (with_group(targets=None), f"{G}.targets", "expected a list of strings"),
    "empty-targets": (with_group(targets=[]), f"{G}.targets", "is empty"),
    "targets-a-string": (with_group(targets="Linear"), f"{G}.targets", "is str, expected a list"),
    "weights-a-list": (with_group(weights=[4]), f"{G}.weights", "is list, expected an object"),
    "weights-wrong-type": (with_weights(num_bits="four"), f"{G}.weights.num_bits", "is not valid"),
    "weights-unknown-field": (with_weights(bitz=4), f"{G}.weights.bitz", "is not valid"),
    "unknown-strategy": (with_weights(strategy="diagonal"), f"{G}.weights.strategy", "is not valid"),
    "group-actorder": (with_weights(actorder="group"), f"{G}.weights.actorder", "is not valid"),
    "int3": (with_weights(num_bits=3), f"{G}.weights", "is not symmetric int4/int8"),
    "fp8-block-64": (
        {
            **W4,
            "config_groups": {
                "group_0": {
                    **preset_group("FP8_BLOCK", ["Linear"], "float-quantized"),
                    "weights": {
                        **preset_group("FP8_BLOCK", ["Linear"], "float-quantized")["weights"],
                        "block_structure": [64, 64],
                    },
                }
            },
        },
        f"{G}.weights.block_structure",
        "is not [128, 128]",
    ),
    "nvfp4-with-int8-input": (
        {
            **W4,
            "config_groups": {
                "group_0": {
                    **preset_group("NVFP4A16", ["Linear"], "nvfp4-pack-quantized"),
                    "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
                }
            },
        },
        f"{G}.input_activations",
        "must be NVFP4",
    ),
    "output-activations": (
        with_group(output_activations={"num_bits": 8, "type": "int"}),
        f"{G}.output_activations",
        "is set",
    ),
    "ignore-a-string": ({**W4, "ignore": "lm_head"}, "quantization_config.ignore", "expected a list of strings"),
    "bad-regex": ({**W4, "ignore": ["re:(unclosed"]}, "quantization_config.ignore[0]", "is not a regular expression"),
    "regex-bomb": ({**W4, "ignore": ["re:^([a-z0-9_.]+)+!"]}, "quantization_config.ignore[0]", "took more than 1 s"),
    "huge-pattern": (
        with_group(targets=["re:" + "a" * 100_000]),
        f"{G}.targets[0]",
        "100000-character regular expression",
    ),
    "one-shard-ignored": ({**W4, "ignore": ["layers.43.attn.wkv"]}, "quantization_config.ignore", "some shards of"),
    "experts-split-by-groups": (
        {
            **W4,
            "config_groups": {
                "group_0": preset_group("MXFP4A16", [r"re:.*experts\.\d+\.(w1|gate_proj)$"], "mxfp4-pack-quantized"),
                "group_1": W4["config_groups"]["group_0"],
            },
        },
        "quantization_config.config_groups",
        "get different schemes",
    ),
    "quantised-head": (with_group(targets=["Linear", r"re:.*\.head$"]), f"{G}.targets", "quantises the draft's head"),
    "bad-transform": (
        {**W4, "transform_config": {"config_groups": {"v": {"type": "hadamard", "apply": [{"location": "input"}]}}}},
        "quantization_config.transform_config.config_groups.v.apply.0.targets",
        "is not valid",
    ),
}


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    return bundled_plan(write_checkpoint(tmp_path_factory.mktemp("hostile") / "d", preset="tiny", seed=0))


FACTORIES = {"plan": partial(PlanError, kind="quant_carry"), "check": partial(CheckError, kind="serve_mismatch")}


@pytest.mark.parametrize(
    ("factory", "names"),
    [(FACTORIES["plan"], list(HOSTILE)), (FACTORIES["check"], ["unknown-format", "huge-pattern", "one-shard-ignored"])],
    ids=["plan-error-all", "check-error-some"],
)
def test_every_hostile_config_is_refused_in_one_line_naming_its_field(
    plan: Plan, factory: Any, names: list[str]
) -> None:
    """The refusal is raised through the caller's factory (a plan's PlanError, `check`'s CheckError)."""
    native = standalone_draft_layout(plan.model_config)
    start = time.monotonic()
    wrong = []
    for name in names:
        qc, field, said = HOSTILE[name]
        config = {**plan.config, "num_hidden_layers": 43, "quantization_config": qc}
        try:
            # match-target: the target's own groups meet the draft (an overlay's would win the experts)
            registry.serve_plan(
                config, layer_map(plan), native, "t/config.json", factory, route="match-target", allow_lossy=True
            )
        except (PlanError, CheckError) as exc:
            message = str(exc)
            ok = type(exc) is factory.func and exc.field == field and said in message
            ok = ok and "\n" not in message and message.startswith("t/config.json: ") and len(message) < 400
            if not ok:
                wrong.append(f"{name}: {type(exc).__name__} field={exc.field!r}: {message[:300]}")
        else:
            wrong.append(f"{name}: not refused")
    assert not wrong, "\n".join(wrong)
    assert len(HOSTILE) >= 15 and time.monotonic() - start < 6  # the bomb costs its one second, the rest little


def test_a_compressed_tensors_target_without_the_library_is_refused_naming_the_extra(
    plan: Plan, monkeypatch: pytest.MonkeyPatch
) -> None:
    # compressed-tensors is the optional `quant` extra: its models read the target's arguments
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)
    config = {**plan.config, "quantization_config": W4}
    native = standalone_draft_layout(plan.model_config)
    with pytest.raises(PlanError) as refused:
        registry.serve_plan(config, layer_map(plan), native, "t/config.json", FACTORIES["plan"])
    assert refused.value.field == "quantization_config.quant_method"
    assert str(refused.value) == (
        "t/config.json: quantization_config.quant_method is 'compressed-tensors': reading it needs the "
        "compressed-tensors library (pip install 'dsv4-convert[quant]')"
    )
