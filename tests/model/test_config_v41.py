"""DeepSeek V4.1's nested config.json through the one validator (model/config_v41.py): flattened
as vLLM 0.33.0 and SGLang 0.5.23 flatten it, and each field this tool has no drafter layout for,
or that contradicts another, refused in one line naming it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dsv4.model.config import ModelConfig
from dsv4.model.errors import CheckpointError
from dsv4.model.native import standalone_draft_layout
from dsv4.model.presets import preset_config


def test_the_text_config_is_read_with_the_top_level_winning_and_the_tower_from_vision_config() -> None:
    raw = preset_config("tiny", "v41")
    raw["rope_theta"] = 20000  # a top-level field wins over text_config's, as in both runtimes
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.hidden_size, cfg.rope_theta, cfg.expert_dtype, cfg.vision_n_layers) == (256, 20000, "fp4", 2)
    assert (cfg.weight_block_size, cfg.draft_routed_experts, cfg.dspark_num_experts_per_tok) == ((32, 32), 4, 3)
    assert cfg.is_v41 and cfg.dspark_stages == 3


def test_the_flash_v41_replica_has_the_2401_draft_tensors_third_parties_count() -> None:
    layout = standalone_draft_layout(ModelConfig.from_dict(preset_config("flash", "v41")))
    assert len([n for n in layout if n.startswith("mtp.")]) == 2401


def _edit(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = raw
        for p in parents:
            node = node[p]
        node[leaf] = value

    return edit


REFUSED = {
    "scale-fmt": (_edit("quantization_config.scale_fmt", "fp32"), "unsupported_layout", 'scale_fmt is "fp32"'),
    "block-128": (
        _edit("quantization_config.weight_block_size", [128, 128]),
        "unsupported_layout",
        "weight_block_size [128, 128] with expert_dtype 'fp4'; a DeepSeek V4.1 draft has MXFP8 linears",
    ),
    "fp8-experts": (_edit("quantization_config.expert_dtype", "fp8"), "unsupported_layout", "expert_dtype 'fp8'"),
    "towers-disagree": (
        _edit("text_config.vision_n_layers", 5),
        "malformed_config",
        "vision_n_layers is 5 but vision_config.num_hidden_layers is 2",
    ),
    "top-k-past-experts": (
        _edit("text_config.dspark_num_experts_per_tok", 5),
        "malformed_config",
        "dspark_num_experts_per_tok is 5, more than the stages' 4 routed experts",
    ),
    "no-dspark": (
        _edit("text_config.dspark_markov_rank", None),
        "malformed_config",
        "dspark_markov_rank is null",
    ),
    "text-config-list": (
        _edit("text_config", []),
        "malformed_config",
        "text_config is [] (a list); expected an object",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_v41_config_without_a_drafter_layout_is_refused_naming_the_field(case: str) -> None:
    edit, kind, said = REFUSED[case]
    raw = preset_config("tiny", "v41")
    edit(raw)
    with pytest.raises(CheckpointError) as caught:
        ModelConfig.from_dict(raw, "v41/config.json")
    assert caught.value.kind == kind and str(caught.value).startswith("v41/config.json: ") and said in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_v4_config_may_not_carry_v41_draft_expert_counts() -> None:
    raw = {**preset_config("tiny", "dspark"), "dspark_n_routed_experts": 4}
    with pytest.raises(CheckpointError, match="dspark_n_routed_experts is 4 in a 'deepseek_v4' config") as caught:
        ModelConfig.from_dict(raw)
    assert caught.value.kind == "unsupported_layout"
