"""DeepSeek V4.1's config.json (model_type `deepseek_v41`), as the one validator
(model/config.py) reads it.

The file nests the text model under `text_config` and the vision tower under `vision_config`,
with `quantization_config` at the top level. Both runtimes flatten it before reading a field,
and this module does so the same way (vLLM 0.33.0 transformers_utils/configs/deepseek_v41.py:
34-40 sets every text_config key but model_type on the top level, :46-50 takes expert_dtype
from quantization_config when the top level has none, :52 vision_n_layers from
vision_config.num_hidden_layers, default 0; SGLang 0.5.23 configs/deepseek_v41.py:23-40, whose
top level wins over text_config as vLLM's `super().__init__(**kwargs)` does). Only the
flattened dict is validated; config.json itself is written to a draft byte for byte.

What V4.1's drafter is to this tool (mapping/README.md#drafter-families): DSpark only (vLLM
config/speculative.py:1471-1486 refuses "method":"mtp" on a V4.1 target), FP4 experts and MXFP8
linears, i.e. weight_block_size [32, 32] with UE8M0 scales (vLLM deepseek_v41/nvidia/model.py:
1501-1513 registers `weight_scale` only for [32, 32] beside fp4 experts; modelopt.py:2316-2330
loads a [ceil(out/32), in/32] scale grid and asserts uint8 or float8_e8m0fnu bytes), and stages
of `dspark_n_routed_experts` experts, top `dspark_num_experts_per_tok` (0: the main model's;
vLLM deepseek_v41/nvidia/model.py:136-144, nvidia/dspark.py:376-379).
"""

from __future__ import annotations

from typing import Any, Protocol

from dsv4.model.config_fields import describe, malformed, unsupported

V41_MODEL_TYPE = "deepseek_v41"
V41_BLOCK = (32, 32)  # quantization_config.weight_block_size: MXFP8's 32-input groups, 32 rows per scale row
V41_SCALE_FMT = "ue8m0"
V41_EXPERT_DTYPE = "fp4"
NESTED = ("text_config", "vision_config")


def flatten_v41(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """V4.1's nested config.json as one flat dict of the fields the validator reads."""
    text, vision = (raw.get(name, {}) for name in NESTED)  # absent: the fields sit on the top level
    for name, value in zip(NESTED, (text, vision), strict=True):
        if not isinstance(value, dict):
            raise malformed(where, name, f"{name} is {describe(value)}; expected an object")
    flat = {k: v for k, v in text.items() if k != "model_type"}
    flat.update((k, v) for k, v in raw.items() if k not in NESTED)
    quant = flat.get("quantization_config")
    if isinstance(quant, dict):
        if "expert_dtype" not in flat and "expert_dtype" in quant:
            flat["expert_dtype"] = quant["expert_dtype"]
        if quant.get("scale_fmt") != V41_SCALE_FMT:
            raise unsupported(
                where,
                "quantization_config.scale_fmt",
                f"quantization_config.scale_fmt is {describe(quant.get('scale_fmt'))}; a DeepSeek V4.1 draft is "
                f"read with {V41_SCALE_FMT!r} block scales only (vLLM modelopt.py:2324 asserts E8M0 bytes)",
            )
    tower = vision.get("num_hidden_layers", 0)
    if "vision_n_layers" in flat and flat["vision_n_layers"] != tower:
        raise malformed(
            where,
            "vision_n_layers",
            f"vision_n_layers is {describe(flat['vision_n_layers'])} but vision_config.num_hidden_layers is "
            f"{describe(tower)}: vLLM reads the latter, SGLang the former (configs/deepseek_v41.py:52; "
            "SGLang configs/deepseek_v41.py:31-35)",
        )
    flat["vision_n_layers"] = tower
    return flat


class DrafterFields(Protocol):
    """What check_v41 reads of a ModelConfig (model/config.py, which calls it: no import back)."""

    model_type: str
    weight_block_size: tuple[int, int]
    expert_dtype: str
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int

    @property
    def is_dspark(self) -> bool: ...

    @property
    def draft_routed_experts(self) -> int: ...


def check_v41(cfg: DrafterFields, where: str) -> None:
    """Refuse (35) a V4.1 config whose drafter this tool has no layout for, and (18) one whose
    draft expert counts contradict each other; a V4 config may not carry V4.1's draft expert
    counts, which vLLM's V4 DSpark ignores and SGLang's reads (deepseek_v4_dspark.py:565-578)."""
    if cfg.model_type != V41_MODEL_TYPE:
        for field in ("dspark_n_routed_experts", "dspark_num_experts_per_tok"):
            if getattr(cfg, field):
                raise unsupported(
                    where,
                    field,
                    f"{field} is {getattr(cfg, field)} in a {cfg.model_type!r} config: vLLM's V4 DSpark builds its "
                    "stages with the main model's experts, SGLang's with this count (a DeepSeek V4.1 field)",
                )
        return
    if not cfg.is_dspark:
        raise unsupported(
            where,
            "dspark_target_layer_ids",
            "a DeepSeek V4.1 config without dspark_* fields: V4.1's only drafter is DSpark (vLLM "
            "config/speculative.py:1471-1486 refuses an MTP draft for it)",
        )
    if cfg.weight_block_size != V41_BLOCK or cfg.expert_dtype != V41_EXPERT_DTYPE:
        raise unsupported(
            where,
            "quantization_config.weight_block_size",
            f"weight_block_size {list(cfg.weight_block_size)} with expert_dtype {cfg.expert_dtype!r}; a DeepSeek "
            f"V4.1 draft has MXFP8 linears, {list(V41_BLOCK)} blocks beside {V41_EXPERT_DTYPE!r} experts (vLLM "
            "deepseek_v41/nvidia/model.py:1501-1513)",
        )
    if cfg.dspark_num_experts_per_tok > cfg.draft_routed_experts:
        raise malformed(
            where,
            "dspark_num_experts_per_tok",
            f"dspark_num_experts_per_tok is {cfg.dspark_num_experts_per_tok}, more than the stages' "
            f"{cfg.draft_routed_experts} routed experts (dspark_n_routed_experts)",
        )
