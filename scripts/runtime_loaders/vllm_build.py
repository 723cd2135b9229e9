"""vLLM 0.33.0's compressed-tensors config, scheme choice and create_weights, cut out of the
wheel, building the draft layer's parameters beside a target (scripts/verify_runtimes.py's
docstring lists every cut and stub)."""

from __future__ import annotations

import contextlib
import copy
import enum
import re
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from .cut import cut, modules_in_place
from .vllm_build_cuts import (
    CTM_PACKAGE,
    IMPORTED_INSIDE,
    KERNEL_STAND_INS,
    MODELOPT_OVERRIDES,
    QUANT_CONFIG_CLASSES,
    VLLM_BUILD_CUTS,
)
from .wheels import Wheel

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


def _libraries() -> dict[str, Any]:
    """The libraries the cut-out files import: the real ones (compressed-tensors is vLLM's
    own dependency)."""
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

    return {
        "torch": torch,
        "re": re,  # the wheel imports `regex as re`; the stdlib's matches these patterns alike
        "math": __import__("math"),
        "Any": Any,
        "Callable": Callable,
        "Parameter": torch.nn.Parameter,
        "Module": torch.nn.Module,
        "nn": torch.nn,
        "Fraction": Fraction,
        "fnmatch": fnmatch,
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
    }


def _stubs(platform: str) -> dict[str, Any]:
    """vLLM's collaborators: one process, TP 1, no kernels (the docstring's list)."""

    def from_schemes(*_a: Any, **_k: Any) -> None:
        raise TransformOnDraft("the target's transform_config applies an online transform to this layer")

    vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(dtype=torch.bfloat16),
        kernel_config=types.SimpleNamespace(linear_backend="auto", moe_backend="auto"),
        lora_config=None,
    )
    stubs: dict[str, Any] = {
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
        "MLAAttention": type("MLAAttention", (), {}),
        # the (weight, activation) key pair resolve() returns (vllm/config/quantization.py:81-92)
        "QuantSpec": lambda weight=None, activation=None: types.SimpleNamespace(weight=weight, activation=activation),
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
    stubs.update({name: _Anything(name) for name in KERNEL_STAND_INS})
    no_backend = lambda **k: (None, None)  # noqa: E731 - (backend, experts class) selectors
    stubs.update(dict.fromkeys(("select_fp8_moe_backend", "select_nvfp4_moe_backend"), no_backend))
    stubs.update(dict.fromkeys(("select_wna16_moe_backend", "select_unquantized_moe_backend"), no_backend))
    stubs["is_global_sf_supported_for_nvfp4_backend"] = lambda _b: False
    stubs["is_flashinfer_moe_ep_backend"] = lambda _b: False
    stubs["CutlassExpertsMxfp4"] = types.SimpleNamespace(_supports_current_device=lambda: False)
    return stubs


def _compile_namespace(wheel: Wheel, platform: str) -> dict[str, Any]:
    ns: dict[str, Any] = {
        "__name__": "cut_out_vllm_build",
        "__package__": CTM_PACKAGE,  # the MoE dispatch's relative imports
        **_libraries(),
        **_stubs(platform),
    }
    # dataclass (WeightsMapper) looks its class's module up in sys.modules
    sys.modules.setdefault(ns["__name__"], types.ModuleType(ns["__name__"]))
    for member, names in VLLM_BUILD_CUTS.items():
        cut(wheel.source(member), f"{wheel.path.name}/{member}", names, ns)
        if member.endswith("fused_moe_method_base.py"):
            ns["FusedMoEMethodBase"].maybe_roundup_sizes = _no_roundup
    # module-level statements of modelopt.py the cut leaves out: the MoE method per config
    # (modelopt.py:725, 1199) and the v2 loader registration of the linear method's decorator
    # (modelopt.py:2559, linear.py:67-70)
    ns["ModelOptFp8Config"].FusedMoEMethodCls = ns["ModelOptFp8MoEMethod"]
    ns["ModelOptNvFp4Config"].FusedMoEMethodCls = ns["ModelOptNvFp4FusedMoE"]
    ns["WEIGHT_LOADER_V2_SUPPORTED"].append("ModelOptLinearMethod")
    return ns


def _no_roundup(_self: Any, hidden: int, intermediate: int, *_a: Any) -> tuple[int, int]:
    # FusedMoEMethodBase.maybe_roundup_sizes rounds the hidden size only for all2all
    # backends (fused_moe_method_base.py:96-100); one process has none
    return hidden, intermediate


@contextlib.contextmanager
def imports_from(ns: dict[str, Any], modules: list[str] = IMPORTED_INSIDE) -> Iterator[None]:
    """The `modules` (default: IMPORTED_INSIDE), each holding `ns`, while the cut-out code runs."""
    stand_ins = {}
    for name in modules:
        module = types.ModuleType(name)
        module.__dict__.update({k: v for k, v in ns.items() if not k.startswith("__")})
        module.__path__ = []  # a package, for the submodules
        stand_ins[name] = module
    with modules_in_place(stand_ins):
        yield


def effective_quantization_config(target_config: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The quantization_config vLLM builds the target (and so the MTP draft) with: a dict
    --hf-overrides value replaces the attribute wholesale (vllm/config/model.py:555-568,
    616-629, 691-692), and get_quant_config reads it from hf_config
    (model_loader/weight_utils.py:240)."""
    if overrides and "quantization_config" in overrides:
        return copy.deepcopy(overrides["quantization_config"])
    return copy.deepcopy(target_config.get("quantization_config") or {})


def quant_config_for(
    ns: dict[str, Any],
    quantization_config: dict[str, Any],
    target_quantization: dict[str, Any],
    platform: str,
    layout: str,
    draft_config: Any,
) -> Any:
    """The quant config the draft layers are built with: `quantization_config` parsed by the
    class vLLM picks for the target's effective `target_quantization` (config_class; a DSpark
    draft takes the target's method with its own dict, config/speculative.py:1564-1566).
    MTP: the target's object
    (from_config, then the target's model init: configure_quant_config with the V4 class's
    mapper and packed modules, model_loader/utils.py:93-94, 367-387; then AMD's draft
    re-keys model.mtp.{i}. entries, amd/mtp.py:301, quant_config.py:33-57). DSpark: built
    from the draft's own quantization_config (dspark/utils.py:115-117) for a draft class
    that has neither a mapper nor packed_modules_mapping (xpu/, nvidia/, amd/dspark.py: none), so
    configure_quant_config leaves it as parsed."""
    with imports_from(ns):
        qc = ns[config_class(ns, target_quantization)].from_config(quantization_config)
        if layout == "mtp":
            ns["configure_quant_config"](qc, ns["DeepseekV4ForCausalLM"])
            if platform == "amd":
                ns["align_mtp_quant_config"](qc, draft_config)
    return qc


def config_class(ns: dict[str, Any], quantization_config: dict[str, Any]) -> str:
    """The config class vLLM builds for `quantization_config`: the first ModelOpt class whose
    override_quantization_method claims it (config/model.py:1396-1435; modelopt.py:453-459 FP8,
    776-782 NVFP4), else the registry's class for its quant_method."""
    for name in MODELOPT_OVERRIDES:
        claimed = ns[name].override_quantization_method(quantization_config, None)
        if claimed is not None:
            return QUANT_CONFIG_CLASSES[claimed]
    return QUANT_CONFIG_CLASSES[quantization_config.get("quant_method")]
