"""vLLM 0.33.0's compressed-tensors config, scheme choice and create_weights, cut out of the
wheel, building the draft layer's parameters beside a target (scripts/verify_runtimes.py's
docstring lists every cut and stub)."""

from __future__ import annotations

import contextlib
import copy
import enum
import json
import re
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from .cut import cut
from .wheels import Wheel

L = "vllm/model_executor/layers/"
CT = L + "quantization/compressed_tensors/"
CTM = CT + "compressed_tensors_moe/"
# file -> names, cut in this order (a class's bases must be cut before it)
VLLM_BUILD_CUTS: dict[str, list[str]] = {
    "vllm/distributed/utils.py": ["ensure_divisibility", "divide"],
    "vllm/model_executor/utils.py": ["set_weight_attrs"],
    "vllm/model_executor/models/utils.py": ["WeightsMapper"],
    "vllm/model_executor/model_loader/utils.py": ["configure_quant_config"],
    "vllm/models/deepseek_v4/nvidia/model.py": [
        "_make_deepseek_v4_weights_mapper",
        "DeepseekV4ForCausalLM.hf_to_vllm_mapper",
        "DeepseekV4ForCausalLM.packed_modules_mapping",
    ],
    "vllm/models/deepseek_v4/quant_config.py": ["align_mtp_quant_config"],
    "vllm/model_executor/parameter.py": [
        "BasevLLMParameter",
        "_ColumnvLLMParameter",
        "RowvLLMParameter",
        "ModelWeightParameter",
        "GroupQuantScaleParameter",
        "ChannelQuantScaleParameter",
        "PerTensorScaleParameter",
        "PackedColumnParameter",
        "PackedvLLMParameter",
        "BlockQuantScaleParameter",
        "_adjust_shard_indexes_for_marlin",
        "_adjust_shard_indexes_for_packing",
    ],
    L + "quantization/utils/config_utils.py": ["find_matching_patterns", "is_equal_or_regex_match"],
    CT + "utils.py": [
        "STRATEGY_TO_PARAMETER_TYPE",
        "is_activation_quantization_format",
        "should_ignore_layer",
        "find_matched_target",
        "_find_first_match",
        "_match_fused_layer",
    ],
    CT + "transform/linear.py": ["get_linear_transform_schemes", "get_schemes_args", "get_layer_partition_names"],
    L + "quantization/utils/fp8_utils.py": [
        "validate_fp8_block_shape",
        "validate_fp8_block_shape_moe",
        "create_fp8_weight_parameter",
        "create_fp8_scale_parameter",
        "create_fp8_input_scale",
    ],
    L + "quantization/utils/marlin_utils.py": ["marlin_repeat_scales_on_all_ranks"],
    L + "quantization/base_config.py": ["QuantizationConfig.__init__", "QuantizationConfig.online_quantization_config", "resolve_quant_method"],
    L + "linear.py": [
        "WEIGHT_LOADER_V2_SUPPORTED",
        "adjust_block_scale_shard",
        "adjust_marlin_shard",
        "UnquantizedLinearMethod.__init__",
        "UnquantizedLinearMethod.create_weights",
        "LinearBase.__init__",
        "LinearBase.update_param_tp_status",
        "ReplicatedLinear.__init__",
        "ReplicatedLinear.weight_loader",
        "ColumnParallelLinear.__init__",
        "ColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch",
        "ColumnParallelLinear.weight_loader",
        "ColumnParallelLinear.weight_loader_v2",
        "MergedColumnParallelLinear.__init__",
        "MergedColumnParallelLinear.validate_shard_id",
        "MergedColumnParallelLinear.weight_loader_v2",
        "RowParallelLinear.__init__",
        "RowParallelLinear.weight_loader",
        "RowParallelLinear.weight_loader_v2",
    ],
    L + "fused_moe/routed_experts.py": [
        "FusedMoeWeightScaleSupported",
        "RoutedExperts.__init__",
        "RoutedExperts._get_quant_method",
        "RoutedExperts._get_fused_shared_expert_quantizer",
        "RoutedExperts._map_global_expert_id_to_local_expert_id",
        "RoutedExperts._to_scalar",
        "RoutedExperts._load_per_tensor_weight_scale",
        "RoutedExperts._load_model_weight_or_group_weight_scale",
        "RoutedExperts._load_per_channel_weight_scale",
        "RoutedExperts._get_hidden_dim",
        "RoutedExperts._narrow_expert_data_for_padding",
        "RoutedExperts._load_w13",
        "RoutedExperts._load_w2",
        "RoutedExperts._load_single_value",
        "RoutedExperts.weight_loader",
    ],
    L + "fused_moe/fused_moe_method_base.py": ["FusedMoEMethodBase.__init__"],
    L + "fused_moe/unquantized_fused_moe_method.py": [
        "UnquantizedFusedMoEMethod.__init__",
        "UnquantizedFusedMoEMethod.create_weights",
    ],
    CTM + "compressed_tensors_moe.py": ["CompressedTensorsMoEMethod.get_moe_method"],
    CTM + "compressed_tensors_moe_w8a8_fp8.py": [
        "CompressedTensorsW8A8Fp8MoEMethod.__init__",
        "CompressedTensorsW8A8Fp8MoEMethod.create_weights",
    ],
    CTM + "compressed_tensors_moe_w4a4_mxfp4.py": [
        "CompressedTensorsW4A4Mxfp4MoEMethod.__init__",
        "CompressedTensorsW4A4Mxfp4MoEMethod.create_weights",
    ],
    CTM + "compressed_tensors_moe_w4a4_nvfp4.py": [
        "CompressedTensorsW4A4Nvfp4MoEMethod.__init__",
        "CompressedTensorsW4A4Nvfp4MoEMethod.create_weights",
    ],
    CTM + "compressed_tensors_moe_wna16.py": [
        "CompressedTensorsWNA16MoEMethod.__init__",
        "CompressedTensorsWNA16MoEMethod._packed_dim",
        "CompressedTensorsWNA16MoEMethod.get_weight_shape",
        "CompressedTensorsWNA16MoEMethod.create_weights",
    ],
    CT + "schemes/compressed_tensors_w8a8_fp8.py": [
        "CompressedTensorsW8A8Fp8.__init__",
        "CompressedTensorsW8A8Fp8.get_min_capability",
        "CompressedTensorsW8A8Fp8.create_weights",
    ],
    CT + "schemes/compressed_tensors_wNa16.py": [
        "WNA16_SUPPORTED_TYPES_MAP",
        "WNA16_ZP_SUPPORTED_TYPES_MAP",
        "WNA16_SUPPORTED_BITS",
        "CompressedTensorsWNA16._kernel_backends_being_used",
        "CompressedTensorsWNA16.__init__",
        "CompressedTensorsWNA16.get_min_capability",
        "CompressedTensorsWNA16.create_weights",
    ],
    CT + "schemes/compressed_tensors_w4a4_nvfp4.py": [
        "CompressedTensorsW4A4Fp4.__init__",
        "CompressedTensorsW4A4Fp4.get_min_capability",
        "CompressedTensorsW4A4Fp4.create_weights",
    ],
    CT + "schemes/compressed_tensors_w4a4_mxfp4.py": [
        "CompressedTensorsW4A4Mxfp4.__init__",
        "CompressedTensorsW4A4Mxfp4.get_min_capability",
        "CompressedTensorsW4A4Mxfp4.create_weights",
    ],
    CT + "compressed_tensors.py": [
        "SPARSITY_CONFIG_NAME",
        "CompressedTensorsConfig.__init__",
        "CompressedTensorsConfig.get_name",
        "CompressedTensorsConfig.apply_vllm_mapper",
        "CompressedTensorsConfig.get_quant_method",
        "CompressedTensorsConfig._add_fused_moe_to_target_scheme_map",
        "CompressedTensorsConfig.from_config",
        "CompressedTensorsConfig._parse_sparsity_config",
        "CompressedTensorsConfig._quantization_scheme_map_from_config",
        "CompressedTensorsConfig._check_scheme_supported",
        "CompressedTensorsConfig._is_nvfp4_format",
        "CompressedTensorsConfig._is_mxfp4",
        "CompressedTensorsConfig._is_mxfp4_w4a8_fp8",
        "CompressedTensorsConfig._fp8_dynamic_input_key",
        "CompressedTensorsConfig._is_mxfp8",
        "CompressedTensorsConfig._is_static_tensor_w8a8",
        "CompressedTensorsConfig._is_dynamic_token_w8a8",
        "CompressedTensorsConfig._is_dynamic_token_w4a8_int",
        "CompressedTensorsConfig._is_fp8_w8a8",
        "CompressedTensorsConfig._is_fp8_w4a8",
        "CompressedTensorsConfig._is_fp8_w4a8_sm90",
        "CompressedTensorsConfig._is_fp8_w8a8_sm90",
        "CompressedTensorsConfig._is_fp8_w8a8_sm100",
        "CompressedTensorsConfig._is_fp8_w8a16",
        "CompressedTensorsConfig._is_wNa16_group_channel",
        "CompressedTensorsConfig._is_wNa8o8_int",
        "CompressedTensorsConfig._is_wNaM_int",
        "CompressedTensorsConfig._get_scheme_from_parts",
        "CompressedTensorsConfig.get_scheme",
        "CompressedTensorsConfig.get_scheme_dict",
        "CompressedTensorsLinearMethod.__init__",
        "CompressedTensorsLinearMethod.create_weights",
    ],
}
# the vLLM modules the cut-out functions import inside their bodies: while they run, each
# is a stand-in module holding the cut-out namespace (so `from vllm.x import Y` gets the
# wheel's Y cut out above, or its stub)
IMPORTED_INSIDE = [
    "vllm",
    "vllm.distributed",
    "vllm.platforms",
    "vllm.platforms.rocm",
    "vllm.model_executor",
    "vllm.model_executor.parameter",
    "vllm.model_executor.models",
    "vllm.model_executor.models.utils",
    "vllm.model_executor.layers",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
    "vllm.model_executor.layers.quantization",
    "vllm.model_executor.layers.quantization.online",
    "vllm.model_executor.layers.quantization.online.fp8",
    "vllm.model_executor.layers.quantization.online.moe_base",
    "vllm.model_executor.layers.quantization.compressed_tensors",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe",
    *(
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe." + m
        for m in (
            "compressed_tensors_moe_w8a8_fp8",
            "compressed_tensors_moe_w4a4_mxfp4",
            "compressed_tensors_moe_w4a4_nvfp4",
            "compressed_tensors_moe_wna16",
        )
    ),
]
CTM_PACKAGE = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"

# per platform: (whether the platform is XPU, is ROCm, its device capability; None on XPU,
# vllm/platforms/xpu.py get_device_capability) and the routed experts' checkpoint names:
# nvidia/model.py:435 passes ckpt_names=("w1", "w2", "w3"); xpu/model.py:722-731 and
# amd/model.py:749-763 keep FusedMoEFactory's default (fused_moe/layer.py:125)
PLATFORMS: dict[str, dict[str, Any]] = {
    "nvidia": {"xpu": False, "rocm": False, "capability": 90, "ckpt": ("w1", "w2", "w3")},
    "amd": {"xpu": False, "rocm": True, "capability": 94, "ckpt": ("gate_proj", "down_proj", "up_proj")},
    "xpu": {"xpu": True, "rocm": False, "capability": None, "ckpt": ("gate_proj", "down_proj", "up_proj")},
}


class _Logger:
    def __getattr__(self, _name: str) -> Callable[..., None]:
        return lambda *a, **k: None


class TransformOnDraft(Exception):
    """A target's transform_config wraps a draft layer (its weights would need rotating)."""


class _Anything:
    """A kernel, backend or key stand-in: any attribute, any call, another stand-in."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Anything:
        return _Anything(f"{self._name}.{attr}")

    def __call__(self, *a: Any, **k: Any) -> _Anything:
        return _Anything(f"{self._name}()")

    def __repr__(self) -> str:
        return self._name


def _platform(name: str) -> Any:
    p = PLATFORMS[name]
    cap = p["capability"]
    return types.SimpleNamespace(
        is_xpu=lambda: p["xpu"],
        is_rocm=lambda: p["rocm"],
        is_cuda_alike=lambda: not p["xpu"],
        is_cpu=lambda: False,
        use_sync_weight_loader=lambda: False,  # TPU only (parameter.py:57-60)
        get_device_capability=lambda: None if cap is None else types.SimpleNamespace(to_int=lambda: cap),
    )


_BUILT: dict[tuple[Path, str], dict[str, Any]] = {}


def build_namespace(wheel: Wheel, platform: str) -> dict[str, Any]:
    """The cut-out code's module globals: the wheel's code (VLLM_BUILD_CUTS) and the stubs,
    compiled once per wheel and platform (the classes hold no state a build leaves behind
    but CompressedTensorsWNA16's log-once set)."""
    key = (wheel.path, platform)
    if key not in _BUILT:
        _BUILT[key] = _compile_namespace(wheel, platform)
    return _BUILT[key]


def _compile_namespace(wheel: Wheel, platform: str) -> dict[str, Any]:
    from compressed_tensors import CompressionFormat
    from compressed_tensors.config import SparsityCompressionConfig
    from compressed_tensors.quantization import (
        ActivationOrdering,
        QuantizationArgs,
        QuantizationStrategy,
        QuantizationType,
    )
    from compressed_tensors.transform import TransformConfig, TransformLocation
    from compressed_tensors.utils import is_match

    def from_schemes(*_a: Any, **_k: Any) -> None:
        raise TransformOnDraft("the target's transform_config applies an online transform to this layer")

    vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(dtype=torch.bfloat16),
        kernel_config=types.SimpleNamespace(linear_backend="auto", moe_backend="auto"),
        lora_config=None,
    )
    ns: dict[str, Any] = {
        "__name__": "cut_out_vllm_build",
        "__package__": CTM_PACKAGE,  # the MoE dispatch's relative imports
        # libraries the files import (real)
        "torch": torch,
        "re": re,  # the wheel imports `regex as re`; the stdlib's matches these patterns alike
        "math": __import__("math"),
        "Any": Any,
        "Callable": Callable,
        "Parameter": torch.nn.Parameter,
        "Module": torch.nn.Module,
        "nn": torch.nn,
        "Fraction": Fraction,
        "MappingProxyType": types.MappingProxyType,
        "WeakValueDictionary": __import__("weakref").WeakValueDictionary,
        "dataclass": dataclass,
        "field": field,
        "replace": replace,
        "Enum": enum.Enum,
        "cast": lambda _t, v: v,
        "partial": __import__("functools").partial,
        "CompressionFormat": CompressionFormat,
        "SparsityCompressionConfig": SparsityCompressionConfig,
        "ActivationOrdering": ActivationOrdering,
        "QuantizationArgs": QuantizationArgs,
        "QuantizationStrategy": QuantizationStrategy,
        "QuantizationType": QuantizationType,
        "TransformConfig": TransformConfig,
        "TransformLocation": TransformLocation,
        "is_match": is_match,
        # vLLM collaborators (stubs): one process, TP 1, no kernels
        "logger": _Logger(),
        "init_logger": lambda _n: _Logger(),
        "get_tensor_model_parallel_rank": lambda: 0,
        "get_tensor_model_parallel_world_size": lambda: 1,
        "current_platform": _platform(platform),
        "get_current_vllm_config": lambda: vllm_config,
        "get_current_vllm_config_or_none": lambda: vllm_config,
        "envs": types.SimpleNamespace(VLLM_BATCH_INVARIANT=False),
        "PluggableLayer": torch.nn.Module,
        "QuantizeMethodBase": object,
        "CustomOp": object,
        "SupportsQuant": type("SupportsQuant", (), {}),
        "OnlineLinearBase": type("OnlineLinearBase", (), {}),
        "OnlineMoEMethodBase": type("OnlineMoEMethodBase", (), {}),
        "ParallelLMHead": type("ParallelLMHead", (), {}),
        "VocabParallelEmbedding": type("VocabParallelEmbedding", (), {}),
        "Attention": type("Attention", (), {}),
        "CompressedTensorsLinearTransformMethod": types.SimpleNamespace(from_schemes=from_schemes),
        "TransformTuple": lambda *a: a,
        "dispatch_unquantized_gemm": lambda _backend: None,
        "verify_group_size_divides_partition": lambda *a: None,
        "get_marlin_input_dtype": lambda _name: None,
        "rocm_aiter_ops": types.SimpleNamespace(is_linear_fp8_enabled=lambda: False),
        "scalar_types": _Anything("scalar_types"),
        "MPLinearLayerConfig": lambda **k: types.SimpleNamespace(**k),
        "MarlinLinearKernel": _Anything("MarlinLinearKernel"),
        "cdiv": lambda a, b: -(-a // b),
        "on_gfx950": lambda: False,  # MI300 (gfx942): not the FlyDSL W4A16 MoE path (compressed_tensors_moe.py:103-114)
    }
    for kernel_or_key in (
        "init_fp8_linear_kernel",
        "init_nvfp4_linear_kernel",
        "init_mxfp4_linear_kernel",
        "choose_mp_linear_kernel",
        "expose_input_quant_key",
        "GroupShape",
        "QuantKey",
        "ScaleDesc",
        "create_fp8_quant_key",
        "kFp8StaticTensorSym",
        "kFp8DynamicTokenSym",
        "kFp8StaticChannelSym",
        "kFp8Static128BlockSym",
        "kFp8Dynamic128Sym",
        "kMxfp4Dynamic",
        "kNvfp4Static",
        "kNvfp4Dynamic",
        "kInt4Static32GroupScale",
        "kInt4StaticGroupScale",
        "kInt8StaticGroupScale",
        "select_fp8_moe_backend",
        "select_nvfp4_moe_backend",
        "select_mxfp4_moe_backend",
        "select_wna16_moe_backend",
        "select_unquantized_moe_backend",
        "is_global_sf_supported_for_nvfp4_backend",
        "is_flashinfer_moe_ep_backend",
        "check_moe_marlin_supports_config",
        "Mxfp4MoeBackend",
        "WNA16MoEBackend",
        "UnquantizedMoeBackend",
        "MarlinExperts",
        "XPUExpertsMxFp4",
    ):
        ns[kernel_or_key] = _Anything(kernel_or_key)
    ns["select_fp8_moe_backend"] = ns["select_nvfp4_moe_backend"] = lambda **k: (None, None)
    ns["select_wna16_moe_backend"] = ns["select_unquantized_moe_backend"] = lambda **k: (None, None)
    ns["is_global_sf_supported_for_nvfp4_backend"] = lambda _b: False
    ns["is_flashinfer_moe_ep_backend"] = lambda _b: False
    ns["CutlassExpertsMxfp4"] = types.SimpleNamespace(_supports_current_device=lambda: False)
    # dataclass (WeightsMapper) looks its class's module up in sys.modules
    sys.modules.setdefault(ns["__name__"], types.ModuleType(ns["__name__"]))
    for member, names in VLLM_BUILD_CUTS.items():
        cut(wheel.source(member), f"{wheel.path.name}/{member}", names, ns)
        if member.endswith("fused_moe_method_base.py"):
            ns["FusedMoEMethodBase"].maybe_roundup_sizes = _no_roundup
    return ns


def _no_roundup(_self: Any, hidden: int, intermediate: int, *_a: Any) -> tuple[int, int]:
    # FusedMoEMethodBase.maybe_roundup_sizes rounds the hidden size only for all2all
    # backends (fused_moe_method_base.py:96-100); one process has none
    return hidden, intermediate


@contextlib.contextmanager
def imports_from(ns: dict[str, Any], modules: list[str] = IMPORTED_INSIDE) -> Iterator[None]:
    """The `modules` (default: IMPORTED_INSIDE), each holding `ns`, while the cut-out code runs."""
    saved = {k: sys.modules.get(k) for k in modules}
    for name in modules:
        module = types.ModuleType(name)
        module.__dict__.update({k: v for k, v in ns.items() if not k.startswith("__")})
        module.__path__ = []  # a package, for the submodules
        sys.modules[name] = module
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def effective_quantization_config(target_config: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The quantization_config vLLM builds the target (and so the MTP draft) with: a dict
    --hf-overrides value replaces the attribute wholesale (vllm/config/model.py:555-568,
    616-629, 691-692), and get_quant_config reads it from hf_config
    (model_loader/weight_utils.py:240)."""
    if overrides and "quantization_config" in overrides:
        return copy.deepcopy(overrides["quantization_config"])
    return copy.deepcopy(target_config.get("quantization_config") or {})


def quant_config_for(ns: dict[str, Any], quantization_config: dict[str, Any], platform: str, layout: str, draft_config: Any) -> Any:
    """The CompressedTensorsConfig the draft layers are built with. MTP: the target's object
    (from_config, then the target's model init: configure_quant_config with the V4 class's
    mapper and packed modules, model_loader/utils.py:93-94, 367-387; then AMD's draft
    re-keys model.mtp.{i}. entries, amd/mtp.py:301, quant_config.py:33-57). DSpark: built
    from the draft's own quantization_config (dspark/utils.py:115-117) for a draft class
    that has neither a mapper nor packed_modules_mapping (xpu/dspark.py: none), so
    configure_quant_config leaves it as parsed."""
    with imports_from(ns):
        qc = ns["CompressedTensorsConfig"].from_config(quantization_config)
        if layout == "mtp":
            ns["configure_quant_config"](qc, ns["DeepseekV4ForCausalLM"])
            if platform == "amd":
                ns["align_mtp_quant_config"](qc, draft_config)
    return qc


def describe(qc: Any) -> dict[str, Any]:
    return {"ignore": list(qc.ignore), "targets": list(qc.target_scheme_map)}


def load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
