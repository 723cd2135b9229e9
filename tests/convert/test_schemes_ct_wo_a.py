"""A compressed-tensors target under which the draft's wo_a would not be FP8 block (vLLM's V4
O-projection reads it through its FP8 kernel) is refused naming the field that does it: the
ignore list that covers it, or the group that gives it another scheme, so the user knows
which part of the target's config to change."""

from __future__ import annotations

from functools import partial

import pytest

from dsv4.convert.errors import PlanError
from dsv4.convert.inmemory import bundled_plan
from dsv4.convert.plan import Plan
from dsv4.convert.schemes import registry
from dsv4.convert.schemes.base import layer_map
from dsv4.convert.synth import write_checkpoint
from dsv4.model.native import standalone_draft_layout
from tests.quant_configs import serving_target

WHERE = "t/config.json"


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    return bundled_plan(write_checkpoint(tmp_path_factory.mktemp("wo-a") / "src", preset="tiny", seed=0))


def refusal(plan: Plan, qc: dict, route: str) -> PlanError:
    config = {**plan.config, "quantization_config": qc}
    n = config["num_hidden_layers"]
    with pytest.raises(PlanError) as caught:
        registry.serve_plan(
            config,
            layer_map(plan),
            standalone_draft_layout(plan.model_config),
            WHERE,
            partial(PlanError, kind="quant_carry"),
            route=route,
            allow_lossy=True,
        )
    assert f"the draft's model.layers.{n}.attn.wo_a would be" in str(caught.value)
    return caught.value


@pytest.mark.parametrize("route", ["auto", "overlay", "bf16", "match-target"])
def test_an_ignore_that_covers_the_drafts_layer_is_named(plan: Plan, route: str) -> None:
    """Fails before: the refusal named quantization_config as a whole."""
    n = plan.config["num_hidden_layers"]
    err = refusal(plan, serving_target("W4A16", ["lm_head", rf"re:.*layers\.{n}\..*"]), route)
    assert str(err).endswith("(it runs wo_a through its FP8 kernel): quantization_config.ignore covers it")
    assert err.field == "quantization_config.ignore"


def test_a_group_that_makes_wo_a_int4_is_named(plan: Plan) -> None:
    err = refusal(plan, serving_target("W4A16", ["lm_head"], fp8_wo_a=False), "match-target")
    assert "cannot read on nvidia and xpu" in str(err)
    assert err.field == "quantization_config.config_groups.group_0"
    assert str(err).endswith(": quantization_config.config_groups.group_0 gives it that scheme")
