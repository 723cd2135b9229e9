"""config.json of the released DeepSeek V4 models, plus a tiny one for tests.

Each preset is the complete field set of the released config.json (not only the fields
`ModelConfig` reads), so a synthetic checkpoint looks like the release to any tool that
reads its config. Base variants differ only in "expert_dtype" (mapping/README.md#config-fields).
"""

from __future__ import annotations

import copy
from typing import Any

from dsv4.model.presets_v41 import V41_PRESETS
from dsv4.model.storage import STORAGES

Variant = str  # a key of EXPERT_DTYPE

# Routed-expert storage per variant: each storage's release (model/storage.py: instruct stores FP4
# experts, Base is "FP8 mixed"), and dspark, an instruct release (DSpark-0731).
EXPERT_DTYPE: dict[str, str] = {s.release: s.name for s in STORAGES.values()}
EXPERT_DTYPE["dspark"] = EXPERT_DTYPE["instruct"]
EXPERT_DTYPE["vision"] = EXPERT_DTYPE["instruct"]  # V4-Flash-Vision-Exp: DSpark with a vision tower
EXPERT_DTYPE["v41"] = EXPERT_DTYPE["instruct"]  # DeepSeek V4.1 (model/presets_v41.py): FP4 experts
VARIANTS = tuple(EXPERT_DTYPE)  # what `synth --variant` accepts

# DeepSeek-V4-Pro's config.json, verbatim.
_PRO: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 1024,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 3072,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 61,
    "num_hash_layers": 3,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 16,
    "o_lora_rank": 1024,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "vocab_size": 129280,
    "compress_rope_theta": 160000,
    # one entry per main layer plus the MTP layer (last, 0: sliding window only)
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4] + [0],
    "expert_dtype": "fp4",
}

_FLASH: dict[str, Any] = {
    **_PRO,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "n_routed_experts": 256,
    "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.5,
    "index_topk": 512,
    "index_n_heads": 64,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0],
}

# Small enough for a CPU forward in the Triton interpreter, yet every dim under an FP8
# 128x128 block is a multiple of 128 and every FP4 input dim a multiple of 32, so the
# quantised layouts keep their full-size shape rules (no ragged blocks).
_TINY: dict[str, Any] = {
    **_FLASH,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "vocab_size": 512,
    "sliding_window": 16,
    "num_hash_layers": 1,
    "index_n_heads": 2,
    "index_head_dim": 64,
    "compress_ratios": [4, 128, 0],
}

PRESETS: dict[str, dict[str, Any]] = {"flash": _FLASH, "pro": _PRO, "tiny": _TINY}

# DeepSeek-V4-Flash-0731 (mapping/README.md#dspark-source-checkpoint): Flash with a three-stage DSpark drafter. It keeps
# "num_nextn_predict_layers": 1, and compress_ratios gains one 0 per stage (46 entries).
_FLASH_0731: dict[str, Any] = {
    **_FLASH,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0, 0, 0],
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [40, 41, 42],
    "dspark_markov_rank": 256,
}

# Tiny's DSpark sibling: three stages like the release, so stage 0, a middle stage and the
# last stage S-1 are all distinct; three target layers need three main layers.
_TINY_DSPARK: dict[str, Any] = {
    **_TINY,
    "num_hidden_layers": 3,
    "compress_ratios": [4, 128, 0, 0, 0, 0],
    "dspark_block_size": 5,
    "dspark_noise_token_id": 500,
    "dspark_target_layer_ids": [0, 1, 2],
    "dspark_markov_rank": 32,
}

# DeepSeek-V4-Pro-0813: V4-Pro's main model with a three-stage DSpark drafter on its last three
# layers. No release config.json was read here; its DSpark fields are those third-party copies
# give (vLLM's and mlx-vlm's test fixtures, an SGLang write-up quoting the release file):
# num_hidden_layers 61, dspark_target_layer_ids [58, 59, 60], dspark_markov_rank 512,
# dspark_noise_token_id 128799, dspark_block_size 5, num_nextn_predict_layers 1, and V4-Pro's
# hidden_size, heads, q_lora_rank, o_groups, experts and moe_intermediate_size. compress_ratios
# as one third-party copy gives it: V4-Pro's, but layers 58-60 all at ratio 4, then one 0 per
# stage (64 entries). Every other field is V4-Pro's.
_PRO_0813: dict[str, Any] = {
    **_PRO,
    "compress_ratios": [128, 128] + [4, 128] * 28 + [4, 4, 4] + [0, 0, 0],
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [58, 59, 60],
    "dspark_markov_rank": 512,
}

# Tiny's Pro-0813 sibling: tiny dims in Pro-0813's shape. Its main model opens with V4-Pro's two
# layers compressed at ratio 128 (what tells Pro's main model from Flash's, mapping/drafters.py);
# its three stages sit on the last three of five main layers, not on every layer as tiny 0731's
# do; its Markov rank is twice tiny 0731's, as 512 is 256's; and where Pro is wider than Flash
# (heads, output groups, experts, expert width) it is wider than tiny, so no Flash-sized count
# can hide in a table.
_TINY_PRO_0813: dict[str, Any] = {
    **_TINY_DSPARK,
    "num_hidden_layers": 5,
    "compress_ratios": [128, 128, 4, 4, 4, 0, 0, 0],
    "dspark_target_layer_ids": [2, 3, 4],
    "dspark_markov_rank": 64,
    "num_attention_heads": 8,
    "o_groups": 4,
    "n_routed_experts": 12,
    "moe_intermediate_size": 256,
}

# The DSpark release of each preset: flash V4-Flash-0731, pro V4-Pro-0813, and their tiny siblings
DSPARK_PRESETS: dict[str, dict[str, Any]] = {
    "flash": _FLASH_0731,
    "pro": _PRO_0813,
    "tiny": _TINY_DSPARK,
    "tiny-pro": _TINY_PRO_0813,
}

# Tiny's V4-Flash-Vision-Exp sibling: DSpark with a vision tower, which gives every router a
# gate.bias_vl (model/native.py); the tower's own size is no field this tool reads.
_TINY_VISION: dict[str, Any] = {**_TINY_DSPARK, "vision_n_layers": 2}
VISION_PRESETS: dict[str, dict[str, Any]] = {"tiny": _TINY_VISION}
PRESETS_OF_VARIANT = {"dspark": DSPARK_PRESETS, "vision": VISION_PRESETS, "v41": V41_PRESETS}  # else: PRESETS
DSPARK_FIELDS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")
# every preset name some variant has (what `synth --preset` accepts)
PRESET_NAMES = tuple(sorted({name for presets in (PRESETS, *PRESETS_OF_VARIANT.values()) for name in presets}))


def with_variant(config: dict[str, Any], variant: Variant) -> dict[str, Any]:
    """A deep copy of `config` with "expert_dtype" set as `variant` stores its experts. A
    DSpark config must carry its dspark_* fields already (a DSpark preset does)."""
    if variant not in EXPERT_DTYPE:
        raise ValueError(f"unknown variant {variant!r} (expected one of {', '.join(EXPERT_DTYPE)})")
    fields = {**config.get("text_config", {}), **config}  # V4.1 nests them (model/config_v41.py)
    if variant in PRESETS_OF_VARIANT and not all(f in fields for f in DSPARK_FIELDS):
        raise ValueError(
            f"variant {variant} needs a config with {', '.join(DSPARK_FIELDS)} "
            "(mapping/README.md#dspark-source-checkpoint)"
        )
    if variant == "vision" and not config.get("vision_n_layers"):
        raise ValueError("variant vision needs a config with vision_n_layers > 0 (a vision tower)")
    out = copy.deepcopy(config)
    # V4.1 states the experts' dtype in quantization_config (vLLM configs/deepseek_v41.py:46-50)
    quant = out.get("quantization_config") if variant == "v41" else None
    (quant if isinstance(quant, dict) else out)["expert_dtype"] = EXPERT_DTYPE[variant]
    return out


def preset_config(name: str, variant: Variant = "instruct") -> dict[str, Any]:
    """The full config.json of preset `name` for `variant` (a fresh copy: callers may edit it).
    The dspark variant is the preset's DSpark release (flash: V4-Flash-0731, pro: V4-Pro-0813;
    tiny-pro is tiny's Pro-0813 sibling and has no other variant), vision its
    V4-Flash-Vision-Exp release (tiny only), v41 its DeepSeek V4.1 release (model/presets_v41.py)."""
    presets = PRESETS_OF_VARIANT.get(variant, PRESETS)
    if name not in presets:
        raise ValueError(f"unknown preset {name!r} for variant {variant} (expected one of {', '.join(presets)})")
    return with_variant(presets[name], variant)
