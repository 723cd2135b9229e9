"""Test inputs for the serving proof until the converter writes the routes itself: tiny
compressed-tensors target configs as llm-compressor writes them, and a `--target draft`
output rewritten by the tensor-name contract of the overlay and bf16 routes (FP8 linears:
weight kept + weight_scale F32 = 2^e; FP4 experts: weight_packed U8 / weight_scale U8 byte
copies; bf16: the native weights dequantised, wo_a kept FP8-block), with the
--hf-overrides value each route launches with."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.quantization import preset_name_to_scheme
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4.model.reference import fp4_weight, fp8_weight

# preset -> the format llm-compressor writes it in (compressed_tensors/config/format.py)
TARGETS = {
    "W4A16": "pack-quantized",
    "NVFP4A16": "nvfp4-pack-quantized",
    "FP8_BLOCK": "float-quantized",
    "MXFP4A16": "mxfp4-pack-quantized",
}
# the draft layer's modules as vLLM names them for the quant config (shards of the fused
# ones included: compressed-tensors matches fused layers shard by shard)
LINEARS = (
    r"(e_proj|h_proj|attn\.(fused_wqa_wkv|wq_a|wkv|wq_b|wo_a|wo_b)"
    r"|ffn\.shared_experts\.(gate_up_proj|down_proj|w[123]))"
)
# the routed experts' probe names: w1/w2/w3 on NVIDIA, gate/up/down_proj on XPU and AMD
EXPERTS = r"ffn\.experts\.\d+\.(w[123]|gate_proj|up_proj|down_proj)"


def group(preset: str, targets: list[str]) -> dict[str, Any]:
    scheme = preset_name_to_scheme(preset, targets).model_dump()
    scheme["format"] = TARGETS[preset]
    return scheme


def target_config(preset: str) -> dict[str, Any]:
    """A target's config.json with one scheme on every Linear, the head ignored."""
    return {
        "model_type": "deepseek_v4",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": TARGETS[preset],
            "quantization_status": "compressed",
            "config_groups": {"group_0": group(preset, ["Linear"])},
            "ignore": ["lm_head"],
        },
    }


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(root / shard, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _write(draft: Path, out: Path, tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True)
    shutil.copy(draft / "config.json", out / "config.json")
    save_file(tensors, out / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def overlay_draft(draft: Path, out: Path) -> Path:
    src, dst = _tensors(draft), {}
    for name, t in src.items():
        base, _, leaf = name.rpartition(".")
        if leaf == "scale":
            fp4 = src[base + ".weight"].dtype == torch.int8
            dst[base + ".weight_scale"] = t.view(torch.uint8) if fp4 else t.float()
        elif leaf == "weight" and t.dtype == torch.int8:
            dst[base + ".weight_packed"] = t.view(torch.uint8)
        else:
            dst[name] = t
    return _write(draft, out, dst)


def bf16_draft(draft: Path, out: Path) -> Path:
    src, dst = _tensors(draft), {}
    for name, t in src.items():
        base, _, leaf = name.rpartition(".")
        if leaf == "scale" and base.endswith(".wo_a"):
            dst[base + ".weight_scale"] = t.float()
        elif leaf == "scale":
            continue
        elif base + ".scale" in src and not base.endswith(".wo_a"):
            scale = src[base + ".scale"]
            w = fp4_weight(t, scale) if t.dtype == torch.int8 else fp8_weight(t, scale, (128, 128))
            dst[name] = w.to(torch.bfloat16)
        else:
            dst[name] = t
    return _write(draft, out, dst)


def overlay_overrides(target: dict[str, Any], layer: int, experts: str = "MXFP4A16") -> dict[str, Any]:
    """The target's config + FP8-block linears and MXFP4 experts (FP8-block for Base's FP8
    experts) anchored on the draft layer,
    the draft layer added to every transform's ignore (a transform wraps a layer whatever
    the quantisation groups say)."""
    qc = copy.deepcopy(target["quantization_config"])
    at = rf"re:^model\.layers\.{layer}\."
    for transform in ((qc.get("transform_config") or {}).get("config_groups") or {}).values():
        for args in transform["apply"]:
            args["ignore"] = [*args.get("ignore", []), f"{at}.*"]
    qc["config_groups"]["dsv4_mtp_linear"] = group("FP8_BLOCK", [f"{at}{LINEARS}$"])
    qc["config_groups"]["dsv4_mtp_experts"] = group(experts, [f"{at}{EXPERTS}$"])
    return {"quantization_config": qc}


def bf16_overrides(target: dict[str, Any], layer: int) -> dict[str, Any]:
    qc = copy.deepcopy(target["quantization_config"])
    at = rf"re:^model\.layers\.{layer}\."
    qc["ignore"] = [*qc["ignore"], f"{at}(?!attn\\.wo_a$){LINEARS}$", f"{at}{EXPERTS}$"]
    qc["config_groups"]["dsv4_mtp_wo_a"] = group("FP8_BLOCK", [rf"{at}attn\.wo_a$"])
    return {"quantization_config": qc}


def dspark_overlay_draft(draft: Path, out: Path) -> Path:
    """The overlay tensors, and config.json's quantization_config a compressed-tensors one
    of the draft's own: vLLM builds a DSpark draft from it, its groups matched against the
    draft's quant prefixes as they are (no mapper, no fused-shard expansion)."""
    overlay_draft(draft, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "config_groups": {
            "dsv4_draft_linear": group("FP8_BLOCK", [rf"re:^model\.(main_proj|layers\.\d+\.{LINEARS})$"]),
            "dsv4_draft_experts": group("MXFP4A16", [rf"re:^model\.layers\.\d+\.{EXPERTS}$"]),
        },
        "ignore": [],
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
