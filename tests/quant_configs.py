"""compressed-tensors quantization_config dicts for the tiny checkpoint (the schemes and the
regex-targeted config tests/convert/test_quant_config.py and tests/mapping/test_draft.py carry),
and a tiny native checkpoint carrying one."""

import json
from pathlib import Path
from typing import Any

from dsv4.convert.synth import write_checkpoint

INT4_GROUP = {
    "num_bits": 4,
    "type": "int",
    "symmetric": True,
    "strategy": "group",
    "group_size": 32,
    "dynamic": False,
    "observer": "minmax",
}


FP8_BLOCK = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "block",
    "block_structure": [128, 128],
    "dynamic": False,
    "observer": "static_minmax",
}


FP8_DYNAMIC = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "group",
    "group_size": 128,
    "dynamic": True,
    "observer": None,
}


def ct_config(groups: dict[str, tuple[list[str], dict, dict | None, str]], ignore: list[str]) -> dict[str, Any]:
    """A config.json quantization_config as llm-compressor writes one."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": {
            name: {
                "targets": targets,
                "weights": weights,
                "input_activations": acts,
                "output_activations": None,
                "format": fmt,
            }
            for name, (targets, weights, acts, fmt) in groups.items()
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.12.2",
    }


# int4 group-quantised routed experts, FP8 attention, projections and shared expert; the
# router gate and head stay unquantised; regexes over the native mtp.* / layers.* names.
REGEX = ct_config(
    {
        "group_0": ([r"re:^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]$"], INT4_GROUP, None, "pack-quantized"),
        "group_1": (
            [
                r"re:^(layers|mtp)\.\d+\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)$",
                r"re:^mtp\.\d+\.[eh]_proj$",
                r"re:^(layers|mtp)\.\d+\.ffn\.shared_experts\.w[123]$",
            ],
            FP8_BLOCK,
            FP8_DYNAMIC,
            "float-quantized",
        ),
        "group_2": ([r"re:^layers\.\d+\.attn\.indexer\.wq_b$"], FP8_BLOCK, None, "float-quantized"),  # main model only
    },
    ["head", r"re:.*ffn\.gate$"],
)


def native_with(tmp: Path, qc: dict[str, Any] | None) -> Path:
    native = write_checkpoint(tmp / "native", preset="tiny", main_layers="all")
    config = json.loads((native / "config.json").read_text())
    if qc is not None:
        config["quantization_config"] = qc
    (native / "config.json").write_text(json.dumps(config))
    return native


def preset_group(preset: str, targets: list[str], fmt: str) -> dict[str, Any]:
    """One config group of compressed-tensors' own preset `preset` (FP8_BLOCK, W4A16, NVFP4A16,
    NVFP4, MXFP4A16, MXFP4), as its QuantizationScheme serialises it."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return {**preset_name_to_scheme(preset, targets).model_dump(mode="json", exclude_none=True), "format": fmt}


FORMAT = {
    "FP8_BLOCK": "float-quantized",
    "W4A16": "pack-quantized",
    "NVFP4A16": "nvfp4-pack-quantized",
    "NVFP4": "nvfp4-pack-quantized",
    "MXFP4A16": "mxfp4-pack-quantized",
    "MXFP4": "mxfp4-pack-quantized",
}


def serving_target(preset: str, ignore: list[str], *, fp8_wo_a: bool = True, **extra: Any) -> dict[str, Any]:
    """A re-quantised DeepSeek V4 target's quantization_config: `preset` on every Linear, and
    (as a V4 target that runs must, its O-projection reading wo_a as FP8) an FP8 block group
    for wo_a first."""
    groups = {"wo_a": preset_group("FP8_BLOCK", [r"re:.*attn\.wo_a$"], "float-quantized")} if fp8_wo_a else {}
    groups["group_0"] = preset_group(preset, ["Linear"], FORMAT[preset])
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT[preset],
        "config_groups": groups,
        "ignore": ignore,
        **extra,
    }
