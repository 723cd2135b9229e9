"""What each runtime release's draft loaders are cut from: the one table of the differences
between releases (files, names, the parameter names the release's model gives)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


def release(version: str) -> tuple[int, ...]:
    """A release's sort key: vLLM's and SGLang's releases are all MAJOR.MINOR.PATCH."""
    return tuple(int(part) for part in version.split("."))


@dataclass(frozen=True)
class Cuts:
    """One loader in one range of releases: the class whose load_weights runs, and the names
    cut out of each wheel file (cut.cut's syntax); `renames`: (regex, replacement) turning the
    parameter names of the pinned release's model (XPU_OUT's) into this release's; `added`:
    (regex over DRAFT's tensor names, replacement) the parameters this release's model has
    beyond XPU_OUT's, holding those tensors as they are (several matching one parameter: one
    after the other along dim 0, in the draft's stage order, as MergedColumnParallelLinear
    stacks its shards)."""

    cls: str
    cuts: dict[str, list[str]]
    renames: tuple[tuple[str, str], ...] = field(default=())
    added: tuple[tuple[str, str], ...] = field(default=())

    def param_name(self, name: str) -> str:
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        return name

    def added_params(self, draft_names: Iterable[str]) -> dict[str, list[str]]:
        """parameter -> the DRAFT tensors it holds, in stage order, for the parameters `added` names."""
        held: dict[str, list[str]] = {}
        for name in sorted(draft_names, key=_stage_order):
            for pattern, replacement in self.added:
                if re.fullmatch(pattern, name):
                    held.setdefault(re.sub(pattern, replacement, name), []).append(name)
        return held


def _stage_order(name: str) -> list[tuple[int, int | str]]:
    # mtp.10.* after mtp.9.*
    return [(0, int(part)) if part.isdigit() else (1, part) for part in name.split(".")]


def pick(ranges: list[tuple[str, Any]], version: str) -> Any:
    """The entry of `ranges` ((first release, entry), oldest first) holding for `version`:
    the last whose first release is not newer; None before the first."""
    held = None
    for first, entry in ranges:
        if release(first) <= release(version):
            held = entry
    return held


def cuts_for(table: dict[str, list[tuple[str, Cuts]]], loader: str, version: str) -> Cuts | None:
    """`loader`'s cuts in `version` (None: that release has no such loader)."""
    return pick(table[loader], version)


V4 = "vllm/models/deepseek_v4/"
V4_BEFORE_022 = "vllm/model_executor/models/"  # one deepseek_v4(_mtp).py before the per-platform split
VLLM_UTILS = V4_BEFORE_022 + "utils.py"
FUSED_MOE = "vllm/model_executor/layers/fused_moe/"
_EPLB_AND_CDIV = {
    "vllm/distributed/eplb/eplb_state.py": ["EplbState.build_initial_global_physical_to_logical_map"],
    "vllm/utils/math_utils.py": ["cdiv"],
}
# What every vLLM loader run needs besides its own class, each the wheel's own code: the
# spec-layer test and the expert mapping. The spec-layer test lived in deepseek_v2.py until
# 0.26.0 moved it to models/utils.py; the expert mapping was FusedMoE's until 0.24.0 made it
# RoutedExperts' (0.25.0 split out build_expert_params_mapping).
VLLM_COMMON: list[tuple[str, dict[str, list[str]]]] = [
    (
        "0.20.0",
        {
            V4_BEFORE_022 + "deepseek_v2.py": ["get_spec_layer_idx_from_weight_name"],
            FUSED_MOE + "layer.py": ["FusedMoE.make_expert_params_mapping", "fused_moe_make_expert_params_mapping"],
            **_EPLB_AND_CDIV,
        },
    ),
    (
        "0.24.0",
        {
            V4_BEFORE_022 + "deepseek_v2.py": ["get_spec_layer_idx_from_weight_name"],
            FUSED_MOE + "layer.py": ["fused_moe_make_expert_params_mapping"],
            FUSED_MOE + "routed_experts.py": ["RoutedExperts.make_expert_params_mapping"],
            **_EPLB_AND_CDIV,
        },
    ),
    (
        "0.25.0",
        {
            V4_BEFORE_022 + "deepseek_v2.py": ["get_spec_layer_idx_from_weight_name"],
            FUSED_MOE + "layer.py": ["fused_moe_make_expert_params_mapping"],
            FUSED_MOE + "routed_experts.py": [
                "RoutedExperts.make_expert_params_mapping",
                "RoutedExperts.build_expert_params_mapping",
            ],
            **_EPLB_AND_CDIV,
        },
    ),
    (
        "0.26.0",
        {
            VLLM_UTILS: ["get_spec_layer_idx_from_weight_name"],
            FUSED_MOE + "layer.py": ["fused_moe_make_expert_params_mapping"],
            FUSED_MOE + "routed_experts.py": [
                "RoutedExperts.make_expert_params_mapping",
                "RoutedExperts.build_expert_params_mapping",
            ],
            **_EPLB_AND_CDIV,
        },
    ),
]
# Before 0.24.0 the routed experts' parameters were the FusedMoE's own, ffn.experts.w13_* (its
# expert mapping, FusedMoE.make_expert_params_mapping, names them so: 0.23.0
# fused_moe/layer.py:1367-1370); 0.24.0 moved them under ffn.experts.routed_experts.
_EXPERTS_BEFORE_024 = ((r"\.experts\.routed_experts\.", ".experts."),)


def _mtp(file: str, *names: str, model: str | None = None, renames: tuple[tuple[str, str], ...] = ()) -> Cuts:
    """A DeepSeekV4MTP loader of `file` with its helpers `names` (finalize_mega_moe_weights,
    which load_weights ends with until 0.34.0; NVIDIA's _to_spec_layer_name from 0.32.0); `model`:
    the file holding make_deepseek_v4_expert_params_mapping."""
    cuts = {file: ["_EXPERT_SCALE_RE", "DeepSeekV4MTP.load_weights", "DeepSeekV4MTP._rewrite_spec_layer_name", *names]}
    if model is not None:
        cuts[model] = ["make_deepseek_v4_expert_params_mapping"]
    return Cuts("DeepSeekV4MTP", cuts, renames)


def _with(cuts: Cuts, file: str, *names: str) -> Cuts:
    """`cuts` with `names` of `file` added."""
    return Cuts(cuts.cls, {**cuts.cuts, file: [*cuts.cuts.get(file, []), *names]}, cuts.renames, cuts.added)


_FINALIZE = "DeepSeekV4MTP.finalize_mega_moe_weights"
_MTP_BEFORE_022 = _mtp(
    V4_BEFORE_022 + "deepseek_v4_mtp.py", _FINALIZE, model=V4_BEFORE_022 + "deepseek_v4.py", renames=_EXPERTS_BEFORE_024
)
_NVIDIA_MODEL = V4 + "nvidia/model.py"
_PAD = "DeepseekV4Model._pad_shared_expert_weight"  # in nvidia/model.py from 0.24.0
_NVIDIA_MTP_022 = _mtp(V4 + "nvidia/mtp.py", _FINALIZE, model=_NVIDIA_MODEL, renames=_EXPERTS_BEFORE_024)
_NVIDIA_MTP_024 = _with(_mtp(V4 + "nvidia/mtp.py", _FINALIZE, model=_NVIDIA_MODEL), _NVIDIA_MODEL, _PAD)
# 0.29.0-0.32.0: load_weights ends by process_weights_after_loading, which finalizes (nvidia/mtp.py:509-518 in 0.30.0)
_AFTER_LOADING = "DeepSeekV4MTP.process_weights_after_loading"
_NVIDIA_MTP_029 = _with(_NVIDIA_MTP_024, V4 + "nvidia/mtp.py", _AFTER_LOADING)
_TO_SPEC = "DeepSeekV4MTP._to_spec_layer_name"
_NVIDIA_MTP_032 = _with(_NVIDIA_MTP_029, V4 + "nvidia/mtp.py", _TO_SPEC)
_NVIDIA_MTP = _with(_mtp(V4 + "nvidia/mtp.py", _TO_SPEC, model=_NVIDIA_MODEL), _NVIDIA_MODEL, _PAD)
_AMD_MTP = _mtp(V4 + "amd/mtp.py")
_XPU_MTP = _mtp(V4 + "xpu/mtp.py", _FINALIZE, model=V4 + "xpu/model.py")
# 0.23.0's XPU MoE held its norm and gate in ffn.norm_gate (xpu/mtp.py:286-290, 438-442)
_XPU_MTP_023 = _mtp(
    V4 + "xpu/mtp.py",
    _FINALIZE,
    model=V4 + "xpu/model.py",
    renames=(
        (r"\.ffn_norm\.weight$", ".ffn.norm_gate.norm.weight"),
        (r"\.ffn\.gate\.weight$", ".ffn.norm_gate.gate.weight"),
        (r"\.ffn\.gate\.e_score_correction_bias$", ".ffn.norm_gate.e_score_correction_bias"),
        *_EXPERTS_BEFORE_024,
    ),
)


def _added(cuts: Cuts, added: tuple[tuple[str, str], ...]) -> Cuts:
    return Cuts(cuts.cls, cuts.cuts, cuts.renames, added)


_DSPARK_FINALIZE = "DSparkDeepseekV4ForCausalLM._finalize_moe"
_DSPARK_AFTER = (_DSPARK_FINALIZE, "DSparkDeepseekV4ForCausalLM.process_weights_after_loading")


def _dspark(file: str, *names: str) -> Cuts:
    return Cuts(
        "DSparkDeepseekV4ForCausalLM",
        {file: ["_EXPERT_SCALE_RE", "DSparkDeepseekV4ForCausalLM.load_weights", *names]},
    )


_XPU_DSPARK = _with(
    _dspark(V4 + "xpu/dspark.py", "DSparkDeepseekV4ForCausalLM._remap_dspark_name"),
    V4 + "xpu/model.py",
    "make_deepseek_v4_expert_params_mapping",
)
# a DSpark class that keeps the confidence head loads the draft's into model.confidence_head.*,
# a parameter the pinned XPU layout (XPU_OUT) has not
_CONFIDENCE_HEAD = ((r"mtp\.\d+\.(confidence_head\..*)", r"model.\1"),)
_NVIDIA_DSPARK_025 = _with(
    _with(
        _dspark(V4 + "nvidia/dspark.py", "DSparkDeepseekV4ForCausalLM._remap_dspark_name"),
        _NVIDIA_MODEL,
        "make_deepseek_v4_expert_params_mapping",
        _PAD,
    ),
    VLLM_UTILS,
    "extract_layer_index",
)
# from 0.31.0 the NVIDIA class also feeds every stage's wkv into model.context_wkv_proj, one
# shard per stage (nvidia/dspark.py:72-86, 142-150, 483, 514-518 in 0.33.0)
_NVIDIA_DSPARK = _with(_NVIDIA_DSPARK_025, V4 + "nvidia/dspark.py", "_CONTEXT_WKV_RE", "_duplicate_context_wkv_weights")
_CONTEXT_WKV = (
    (r"mtp\.\d+\.attn\.wkv\.weight", "model.context_wkv_proj.weight"),
    (r"mtp\.\d+\.attn\.wkv\.scale", "model.context_wkv_proj.weight_scale_inv"),
)
_AMD_DSPARK = _dspark(V4 + "amd/dspark.py", "DSparkDeepseekV4ForCausalLM._remap_dspark_name")
# loader -> (first release, its cuts there), oldest first: each holds until the next entry;
# a release older than the first has no such loader. --serve-with runs the pinned release's.
VLLM_LOADERS: dict[str, list[tuple[str, Cuts]]] = {
    "vllm-xpu-mtp": [
        ("0.23.0", _XPU_MTP_023),
        ("0.24.0", _XPU_MTP),
        ("0.34.0", _mtp(V4 + "xpu/mtp.py", model=V4 + "xpu/model.py")),
    ],
    "vllm-nvidia-mtp": [
        ("0.20.0", _MTP_BEFORE_022),
        ("0.22.0", _NVIDIA_MTP_022),
        ("0.24.0", _NVIDIA_MTP_024),
        ("0.29.0", _NVIDIA_MTP_029),
        ("0.32.0", _NVIDIA_MTP_032),
        ("0.33.0", _NVIDIA_MTP),
    ],
    "vllm-amd-mtp": [
        ("0.20.0", _MTP_BEFORE_022),
        ("0.22.0", _mtp(V4 + "amd/mtp.py", renames=_EXPERTS_BEFORE_024)),
        ("0.24.0", _AMD_MTP),
    ],
    "vllm-xpu-dspark": [
        ("0.26.0", _with(_XPU_DSPARK, V4 + "xpu/dspark.py", _DSPARK_FINALIZE)),
        # 0.34.0's XPU class keeps the confidence head (xpu/dspark.py:112-117, 337-345, 427-435),
        # which 0.33.0's dropped
        ("0.34.0", _added(_XPU_DSPARK, _CONFIDENCE_HEAD)),
    ],
    # NVIDIA's DSpark class is in 0.25.0 and later; its load_weights ends by _finalize_moe
    # until 0.33.0 (through process_weights_after_loading in 0.29.0-0.32.0, nvidia/dspark.py:569-570
    # in 0.31.0); it keeps the confidence head from 0.28.0 (:140-144 there)
    "vllm-nvidia-dspark": [
        ("0.25.0", _with(_NVIDIA_DSPARK_025, V4 + "nvidia/dspark.py", _DSPARK_FINALIZE)),
        ("0.28.0", _added(_with(_NVIDIA_DSPARK_025, V4 + "nvidia/dspark.py", _DSPARK_FINALIZE), _CONFIDENCE_HEAD)),
        ("0.29.0", _added(_with(_NVIDIA_DSPARK_025, V4 + "nvidia/dspark.py", *_DSPARK_AFTER), _CONFIDENCE_HEAD)),
        (
            "0.31.0",
            _added(_with(_NVIDIA_DSPARK, V4 + "nvidia/dspark.py", *_DSPARK_AFTER), _CONFIDENCE_HEAD + _CONTEXT_WKV),
        ),
        ("0.33.0", _added(_NVIDIA_DSPARK, _CONFIDENCE_HEAD + _CONTEXT_WKV)),
    ],
    # AMD's keeps the confidence head from 0.31.0 (amd/dspark.py:126-130, 410-418, 480-481, 498 in 0.33.0)
    "vllm-amd-dspark": [
        ("0.26.0", _AMD_DSPARK),
        ("0.31.0", _added(_AMD_DSPARK, _CONFIDENCE_HEAD)),
    ],
}

SRT = "sglang/srt/"
_SGLANG_MODEL = SRT + "models/deepseek_v4.py"
_SGLANG_HELPERS = {
    SRT + "layers/moe/fused_moe_triton/layer.py": ["FusedMoE.make_expert_params_mapping"],
    SRT + "layers/utils/common.py": ["get_layer_id"],
    SRT + "model_loader/utils.py": ["maybe_executor_submit"],
}
_SGLANG_LOAD = ["DeepseekV4ForCausalLM.load_weights", "DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format"]


def _sglang_common(*names: str) -> dict[str, list[str]]:
    """What every SGLang loader run needs: DeepseekV4ForCausalLM.load_weights (NextN's is it
    with is_nextn=True) with the module-level helpers `names` it calls in that release, and
    the SGLANG_OPT_FP8_WO_A_GEMM flag it tests (at its default: sglang_runs.env_defaults)."""
    return {_SGLANG_MODEL: ["_FP8_WO_A_GEMM", *names, *_SGLANG_LOAD], **_SGLANG_HELPERS}


SGLANG_COMMON: list[tuple[str, dict[str, list[str]]]] = [
    ("0.5.12", _sglang_common()),
    ("0.5.16", _sglang_common("DEEPSEEK_V4_STACKED_PARAMS_MAPPING")),
    (
        "0.5.17",
        _sglang_common(
            "DEEPSEEK_V4_STACKED_PARAMS_MAPPING",
            "_dequant_fp8_wo_a_streaming",
            "_clone_if_runai_streamed_tensor",
        ),
    ),
    (
        "0.5.19",
        _sglang_common(
            "DEEPSEEK_V4_STACKED_PARAMS_MAPPING",
            "_dequant_fp8_wo_a_streaming",
            "_prepare_deepseek_v4_weights",
            "_fuse_deepseek_v4_wqkv_a_pair",
            "_clone_if_runai_streamed_tensor",
        ),
    ),
    (
        "0.5.22",
        _sglang_common(
            "DEEPSEEK_V4_STACKED_PARAMS_MAPPING",
            "_dequant_fp8_wo_a_streaming",
            "_prepare_deepseek_v4_weights",
            "_rename_quark_fp8_block_scales",
            "_fuse_deepseek_v4_wqkv_a_pair",
            "_clone_if_runai_streamed_tensor",
        ),
    ),
]
_NEXTN = Cuts(
    "DeepseekV4ForCausalLMNextN", {SRT + "models/deepseek_v4_nextn.py": ["DeepseekV4ForCausalLMNextN.load_weights"]}
)


def _sglang_dspark(*names: str) -> Cuts:
    return Cuts(
        "DeepseekV4ForCausalLMDSpark",
        {
            SRT + "models/deepseek_v4_dspark.py": [
                *names,
                "DeepseekV4ForCausalLMDSpark.load_weights",
                "DeepseekV4ForCausalLMDSpark._assert_confidence_head_loaded",
                "DeepseekV4ForCausalLMDSpark._remap_dspark_weight_name",
            ]
        },
    )


# 0.5.16's DSpark loader pairs every FP8 wo_a with its scale through deepseek_v4.py's
# _dequant_fp8_wo_a, whatever SGLANG_OPT_FP8_WO_A_GEMM says (deepseek_v4_dspark.py:771-773)
_SGLANG_DSPARK_016 = _with(_sglang_dspark(), _SGLANG_MODEL, "_dequant_fp8_wo_a")


SGLANG_LOADERS: dict[str, list[tuple[str, Cuts]]] = {
    "sglang-nextn": [("0.5.12", _NEXTN)],  # DeepseekV4ForCausalLMNextN is in every release from 0.5.12
    "sglang-dspark": [
        ("0.5.16", _SGLANG_DSPARK_016),
        ("0.5.17", _sglang_dspark()),
        ("0.5.21", _sglang_dspark("_dspark_stage_config")),
    ],
}
