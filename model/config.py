"""DeepSeek V4 model configuration: the config.json fields the MTP draft depends on."""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_nextn_predict_layers: int
    vocab_size: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    rope_theta: float
    norm_topk_prob: bool = True
    scoring_func: str = "sqrtsoftplus"
    expert_dtype: str = "fp4"  # absent in Flash's first revision: absent means fp4
    num_hash_layers: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    compress_ratios: tuple[int, ...] = ()
    weight_block_size: tuple[int, int] = (128, 128)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in names}
        if "compress_ratios" in values:
            values["compress_ratios"] = tuple(values["compress_ratios"])
        quant = raw.get("quantization_config") or {}
        if "weight_block_size" in quant:
            values["weight_block_size"] = tuple(quant["weight_block_size"])
        if values.get("expert_dtype") is None:
            values.pop("expert_dtype", None)
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in values]
        if missing:
            raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.hidden_size

    @property
    def hc_mix(self) -> int:
        """Rows of an hc_{attn,ffn}_fn: n_hc pre, n_hc post, n_hc*n_hc comb."""
        return (2 + self.hc_mult) * self.hc_mult

    def mtp_layer_index(self, i: int) -> int:
        """vLLM numbers MTP block i as decoder layer L = num_hidden_layers + i."""
        return self.num_hidden_layers + i
