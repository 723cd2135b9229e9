"""SGLang 0.5.23's choice of the draft's quantisation, cut out of its wheel: which method
ModelConfig._verify_quantization settles on for the draft directory's config.json, given
the --speculative-draft-model-quantization SGLang defaults to."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

from .cut import cut
from .vllm_build import _Anything, _Logger, imports_from
from .wheels import Wheel

Q = "sglang/srt/layers/quantization/"
# the classes whose override_quantization_method can change the detected method, each
# with the helpers it calls (the other registry entries keep the base's: None)
SGLANG_QUANT_CUTS: dict[str, list[str]] = {
    "sglang/srt/layers/modelopt_utils.py": ["_MODELOPT_QUANT_ALGO_TO_METHOD", "canonicalize_modelopt_quant_algo"],
    Q + "base_config.py": [
        "QuantizationConfig.override_quantization_method",
        "QuantizationConfig._modelopt_override_quantization_method",
    ],
    Q + "moe_wna16.py": [
        "MoeWNA16Config.get_name",
        "MoeWNA16Config.override_quantization_method",
        "MoeWNA16Config.is_moe_wna16_compatible",
    ],
    Q + "modelopt_quant.py": [
        "ModelOptFp8Config.override_quantization_method",
        "ModelOptMixedPrecisionConfig.override_quantization_method",
        "ModelOptFp4Config.override_quantization_method",
    ],
    Q + "petit.py": [
        "PetitNvFp4Config.get_name",
        "PetitNvFp4Config.override_quantization_method",
        "PetitNvFp4Config.is_petit_nvfp4_compatible",
    ],
    Q + "humming.py": ["HummingConfig.override_quantization_method"],
    Q + "awq/awq.py": [
        "AWQConfig.get_min_capability",
        "AWQMarlinConfig.TYPE_MAP",
        "AWQMarlinConfig.get_name",
        "AWQMarlinConfig.override_quantization_method",
        "AWQMarlinConfig.is_awq_marlin_compatible",
    ],
    Q + "gptq/gptq.py": [
        "check_marlin_format",
        "GPTQMarlinConfig.TYPE_MAP",
        "GPTQMarlinConfig.get_name",
        "GPTQMarlinConfig.override_quantization_method",
        "GPTQMarlinConfig.is_gptq_marlin_compatible",
    ],
    Q + "mlx.py": ["MlxQuantizationConfig.override_quantization_method"],
    Q + "__init__.py": ["BASE_QUANTIZATION_METHODS"],
    "sglang/srt/configs/model_config.py": [
        "REQUANTIZATION_METHODS",
        "unwrap_modelopt_quantization_config",
        "_quant_config_to_dict",
        "ModelConfig._verify_quantization",
        "ModelConfig._parse_quant_hf_config",
        "ModelConfig._find_quant_modelslim_config",
        "ModelConfig._parse_modelopt_quant_config",
    ],
}
# imported inside the cut-out code (base_config.py:233)
IMPORTED_INSIDE = ["sglang", "sglang.srt", "sglang.srt.configs", "sglang.srt.configs.model_config"]
# the registry's other classes: the base's override (returns None)
_PLAIN = [
    "Fp8Config",
    "MiniMaxM3Nvfp4Config",
    "BlockInt8Config",
    "NvFp4OnlineConfig",
    "W8A8Int8Config",
    "W8A8Fp8Config",
    "BitsAndBytesConfig",
    "GGUFConfig",
    "CompressedTensorsConfig",
    "W4AFp8Config",
    "QuarkConfig",
    "AutoRoundConfig",
    "ModelSlimConfig",
    "QuarkInt4Fp8Config",
    "Mxfp4W4A8Config",
    "Mxfp4Config",
]


def draft_quantization_default(target_cli: str | None, draft_cli: str | None) -> str | None:
    """--speculative-draft-model-quantization as SGLang resolves it: unset, the target's
    --quantization; "unquant", none (srt/arg_groups/serving_hook.py:676-709; written out
    here because it is a few lines inside a longer function that cannot be cut alone)."""
    chosen = target_cli if draft_cli is None else draft_cli
    return None if chosen == "unquant" else chosen


def sglang_namespace(wheel: Wheel) -> dict[str, Any]:
    ns: dict[str, Any] = {
        "__name__": "cut_out_sglang_quant",
        "json": json,
        "Path": Path,
        "Optional": Any,
        "logger": _Logger(),
        "is_hip": lambda: False,  # CUDA (the ROCm-only branches stay closed)
        "get_platform": lambda: types.SimpleNamespace(is_sm100=False),
        "is_qwen3_5_mtp_draft": lambda _cfg: False,
        "ABC": object,
        # one CUDA H200 (capability 9.0): the marlin kernels' support checks pass
        "_is_cuda": True,
        "_is_hip": False,
        "get_device_capability": lambda: (9, 0),
        "check_marlin_supported": lambda **_k: True,
        "scalar_types": _Anything("scalar_types"),
        "Literal": Any,
        "TypeAlias": Any,
    }
    for member, names in SGLANG_QUANT_CUTS.items():
        if member.endswith("__init__.py"):
            for name in _PLAIN:
                ns[name] = type(name, (ns["QuantizationConfig"],), {})
        cut(wheel.source(member), f"{wheel.path.name}/{member}", names, ns)
        if member.endswith("base_config.py"):  # ModelOpt's intermediate base adds nothing to the override
            ns["ModelOptQuantConfig"] = ns["QuantizationConfig"]
    # the CUDA branch of the registry (srt/layers/quantization/__init__.py:91-96)
    ns["QUANTIZATION_METHODS"] = {**ns["BASE_QUANTIZATION_METHODS"], "mxfp4": ns["Mxfp4Config"]}
    return ns


def sglang_draft_quantization(
    wheel: Wheel, draft: Path, target_cli: str | None = None, draft_cli: str | None = None
) -> tuple[str | None, list[str]]:
    """The quantisation SGLang builds the draft with (ModelConfig._verify_quantization on the
    draft directory's config.json, is_draft_model=True) and the error it raises, if any."""
    ns = sglang_namespace(wheel)
    model_config = ns["ModelConfig"]()
    config = json.loads((draft / "config.json").read_text())
    model_config.hf_config = types.SimpleNamespace(quantization_config=config.get("quantization_config"))
    model_config.model_path = str(draft)
    model_config.is_draft_model = True
    quantization = draft_quantization_default(target_cli, draft_cli)
    model_config.quantization = quantization
    model_config.is_draft_quantization_explicit = draft_cli is not None
    try:
        with imports_from(ns, IMPORTED_INSIDE):
            model_config._verify_quantization()
    except ValueError as exc:
        return None, [f"{draft / 'config.json'}: ValueError: {exc}"]
    return model_config.quantization, []
