"""config.json of DeepSeek V4.1 releases, nested as V4.1 writes it (model/config_v41.py): the
model under `text_config`, the vision tower under `vision_config`, `quantization_config` (with
the experts' dtype) at the top level. model/presets.py serves them as the `v41` variant.

Where the numbers come from. No V4.1 checkpoint was read by this project: `_FLASH_V41` is the
V4.1-Flash config.json as a third party transcribed it (mlx-lm's deepseek_v41 test fixture,
which names the pinned revision deepseek-ai/DeepSeek-V4.1-Flash@dba1be0a; rms_norm_eps 1e-20
is as written there). Only the fields the drafter's layout reads (model/native.py) shape a
synthetic checkpoint; the others (engram, kv/index sources, candidates) are carried as written
so that the runtimes' own config classes read a release-like file. `_TINY_V41` is this
project's own, small enough for a CPU test.
"""

from __future__ import annotations

import copy
from typing import Any

_QUANTIZATION: dict[str, Any] = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}

_FLASH_TEXT: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "hidden_size": 5120,
    "moe_intermediate_size": 2304,
    "num_hidden_layers": 40,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "attention_bias": False,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 65536,
    },
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "sliding_window": 128,
    # one entry per main layer, then one 0 per DSpark stage (43 entries)
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "compress_rope_theta": 160000,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
}

_FLASH_VISION: dict[str, Any] = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 32,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "intermediate_size": 2816,
    "patch_size": 14,
    "rope_theta": 10000,
    "downsample_ratio": 3,
    "max_image_tokens": 1024,
    "min_pixels": 295936,
    "max_wh_ratio": None,
}


def _release(text: dict[str, Any], vision: dict[str, Any], image_token_id: int) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": image_token_id,
        "quantization_config": copy.deepcopy(_QUANTIZATION),
        "text_config": copy.deepcopy(text),
        "vision_config": copy.deepcopy(vision),
    }


_FLASH_V41 = _release(_FLASH_TEXT, _FLASH_VISION, 129264)

# Tiny V4.1: tiny's dims (model/presets.py: every linear's dims multiples of 32, so the 32x32 scale
# grids are whole), three stages on three main layers, stages of 4 routed experts (top 3) beside the
# main model's 8 (top 2), so a draft sized by n_routed_experts or num_experts_per_tok is caught, and
# a 2-layer tower (a gate.bias_vl per stage). The main layers compress nothing and the features that
# name main layers (kv/index sources, candidates, engram) are off, as SGLang's V4.1 config class
# defaults them (configs/deepseek_v41.py:43-61).
_TINY_TEXT: dict[str, Any] = {
    **_FLASH_TEXT,
    "vocab_size": 512,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 2,
    "rms_norm_eps": 1e-06,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 16,
    "compress_ratios": [0, 0, 0, 0, 0, 0],
    "kv_source_layer_ids": [],
    "index_source_layer_ids": [],
    "index_n_heads": 2,
    "index_head_dim": 64,
    "index_topk": 16,
    "candidate_source_layer_id": -1,
    "candidate_topk_blocks": 0,
    "candidate_block_size": 0,
    "engram_layer_ids": [],
    "engram_num_embeddings": [],
    "engram_max_ngram_size": 1,
    "engram_vocab_size": 0,
    "engram_n_heads": 0,
    "engram_head_dim": 0,
    "engram_compressed_vocab_size": 0,
    "dspark_noise_token_id": 500,
    "dspark_target_layer_ids": [0, 1, 2],
    "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 3,
}
_TINY_VISION: dict[str, Any] = {
    **_FLASH_VISION,
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 2,
    "intermediate_size": 128,
}
_TINY_V41 = _release(_TINY_TEXT, _TINY_VISION, 505)

V41_PRESETS: dict[str, dict[str, Any]] = {"flash": _FLASH_V41, "tiny": _TINY_V41}
