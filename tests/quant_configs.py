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
