"""The bundled DSpark draft model (DeepSeek-V4-Flash-0731, spec 04): its config fields, its
layout (spec 04 §4.2's 98 parameters), its forward (spec 04 §4.3: non-causal block attention,
the Markov head's greedy sampler) against an independent reference reading the native
checkpoint, and its strict loading."""

from __future__ import annotations

import pytest
import torch

from dsv4.convert.dtypes import nbytes
from dsv4.convert.presets import preset_config
from dsv4.model.config import ConfigFieldError, ModelConfig, UnsupportedConfig
from dsv4.model.dspark import DSparkDraft
from dsv4.model.layout import target_layout
from dsv4.model.mtp import quant_layer_names
from spec02 import spec_layout

DSPARK_0731 = {  # spec 04 §4.1
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [40, 41, 42],
    "dspark_markov_rank": 256,
}


def config_0731() -> dict:
    """0731's config.json as far as the model reads it: Flash's, expert_dtype fp4,
    compress_ratios with one 0 per stage after the main layers (46 entries), the four
    dspark_* fields, num_nextn_predict_layers kept at 1."""
    raw = preset_config("flash", "instruct")
    raw["compress_ratios"] = raw["compress_ratios"][:43] + [0, 0, 0]
    raw.update(DSPARK_0731)
    return raw


def spec04_layout(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Spec 04 §4.2 transcribed: the model-level rows, then per stage s the 29 `mtp_block.`
    rows of spec 02 §2.2 under `model.layers.{s}.`."""
    H, V, n, R, T = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult, cfg.dspark_markov_rank, len(cfg.dspark_target_layer_ids)
    out = {
        "model.embed_tokens.weight": ("BF16", (V, H)),
        "lm_head.weight": ("BF16", (V, H)),
        "model.main_proj.weight": ("F8_E4M3", (H, T * H)),
        "model.main_proj.weight_scale_inv": ("F8_E8M0", (H // 128, T * H // 128)),
        "model.main_norm.weight": ("BF16", (H,)),
        "model.norm.weight": ("BF16", (H,)),
        "model.hc_head_fn": ("F32", (n, n * H)),
        "model.hc_head_base": ("F32", (n,)),
        "model.hc_head_scale": ("F32", (1,)),
        "model.markov_head.markov_w1.weight": ("BF16", (V, R)),
        "model.markov_head.markov_w2.weight": ("BF16", (V, R)),
    }
    block = f"model.layers.{cfg.num_hidden_layers}.mtp_block."
    block_rows = {k[len(block) :]: v for k, v in spec_layout(cfg).items() if k.startswith(block)}
    assert len(block_rows) == 29
    for s in range(3):
        out.update({f"model.layers.{s}.{k}": v for k, v in block_rows.items()})
    return out


# --- config (spec 04 §4.1) ----------------------------------------------------------------
def test_the_0731_config_is_a_dspark_config_of_three_stages():
    cfg = ModelConfig.from_dict(config_0731())
    assert cfg.is_dspark and cfg.dspark_stages == 3
    assert (cfg.dspark_block_size, cfg.dspark_noise_token_id, cfg.dspark_markov_rank) == (5, 128799, 256)
    assert cfg.dspark_target_layer_ids == (40, 41, 42)
    assert not ModelConfig.from_dict(preset_config("flash")).is_dspark


@pytest.mark.parametrize("absent", sorted(DSPARK_0731))
def test_a_dspark_config_lacking_one_field_is_refused_naming_it(absent):
    raw = config_0731()
    del raw[absent]
    with pytest.raises(ConfigFieldError, match=rf"^lacks {absent}: a DSpark config has all of") as info:
        ModelConfig.from_dict(raw)
    assert info.value.field == absent


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dspark_target_layer_ids", [40, 41, 43], r"dspark_target_layer_ids\[2\] is 43; expected an integer in 0\.\.42"),
        ("dspark_target_layer_ids", [40, 41, 41], r"names layer 41 twice; expected distinct main layers"),
        ("dspark_target_layer_ids", [], r"dspark_target_layer_ids has 0 entries; expected 1\.\.16"),
        ("dspark_target_layer_ids", "40,41,42", r"dspark_target_layer_ids is \"40,41,42\" \(a string\)"),
        ("dspark_target_layer_ids", [40, True, 42], r"dspark_target_layer_ids\[1\] is true \(a boolean\)"),
        ("dspark_block_size", 0, r"dspark_block_size is 0; expected an integer in 1\.\."),
        ("dspark_block_size", 5.0, r"dspark_block_size is 5\.0; expected an integer"),
        ("dspark_noise_token_id", 129280, r"dspark_noise_token_id is 129280; expected an integer in 0\.\.129279"),
        ("dspark_markov_rank", -1, r"dspark_markov_rank is -1; expected an integer in 1\.\."),
        ("dspark_markov_rank", None, r"dspark_markov_rank is null; expected an integer"),
        ("n_mtp_layers", 2, r"n_mtp_layers is 2 but dspark_target_layer_ids has 3 entries: the stage counts disagree"),
        ("compress_ratios", [0, 0] + [4, 128] * 20 + [4] + [0], r"compress_ratios has 44 entries; expected one per main layer \(num_hidden_layers = 43\) and one per DSpark stage \(3\): 46"),
    ],
)
def test_malformed_dspark_fields_are_refused_naming_the_field(field, value, message):
    raw = config_0731()
    raw[field] = value
    with pytest.raises(ConfigFieldError, match=message) as info:
        ModelConfig.from_dict(raw)
    assert info.value.field.split("[")[0] == field
    assert not isinstance(info.value, UnsupportedConfig), "malformed, not unsupported"


def test_an_n_mtp_layers_that_agrees_is_accepted():
    raw = config_0731()
    raw["n_mtp_layers"] = 3
    assert ModelConfig.from_dict(raw).dspark_stages == 3


def test_v41_is_refused_with_its_own_message():
    raw = config_0731()
    raw["model_type"] = "deepseek_v41"
    with pytest.raises(UnsupportedConfig, match=r"model_type 'deepseek_v41' \(DeepSeek V4\.1: vLLM 0\.33\.0 has no XPU draft model for it"):
        ModelConfig.from_dict(raw)


# --- layout (spec 04 §4.2) ----------------------------------------------------------------
def test_the_0731_layout_is_exactly_the_98_parameters_of_spec_04():
    cfg = ModelConfig.from_dict(config_0731())
    layout = target_layout(cfg)
    assert len(layout) == 98
    assert layout == spec04_layout(cfg)
    assert sum(nbytes(d, s) for d, s in layout.values()) == 12_980_953_116


def test_the_meta_state_dict_is_the_layout():
    cfg = ModelConfig.from_dict(config_0731())
    with torch.device("meta"):
        state = DSparkDraft(cfg).state_dict()
    assert len(state) == 98
    assert state["model.main_proj.weight"].dtype == torch.float8_e4m3fn
    assert state["model.main_proj.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    assert state["model.layers.2.ffn.experts.routed_experts.w13_weight"].dtype == torch.uint8
    assert not any(".mtp_block." in k or k.startswith("model.layers.4") for k in state)


def test_every_dspark_linear_carries_its_vllm_quantisation_name():
    with torch.device("meta"):
        model = DSparkDraft(ModelConfig.from_dict(config_0731()))
    names = set(quant_layer_names(model).values())
    for s in range(3):
        L = f"model.layers.{s}"
        assert {f"{L}.attn.fused_wqa_wkv", f"{L}.attn.wq_b", f"{L}.attn.wo_a", f"{L}.attn.wo_b", f"{L}.ffn.gate",
                f"{L}.ffn.shared_experts.gate_up_proj", f"{L}.ffn.shared_experts.down_proj", f"{L}.ffn.experts"} <= names  # fmt: skip
    assert {"model.embed_tokens", "model.main_proj", "lm_head", "model.markov_head.markov_w1", "model.markov_head.markov_w2"} <= names
    assert len(names) == 5 + 3 * 8
