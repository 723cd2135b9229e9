"""vLLM's draft loaders cut out of its wheel and run against XPU_OUT's parameters."""

from __future__ import annotations

import json
import re
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from dsv4.mapping.table import Table, expand, load_table

from .cut import cut
from .recording import Recorder, RecordingParam, Report, attrs, read_tensors, run_loader
from .wheels import Wheel

V4 = "vllm/models/deepseek_v4/"
# What every vLLM loader run below needs besides its own class, each the wheel's own code:
# the expert mapping and the spec-layer test.
VLLM_COMMON = {
    "vllm/model_executor/models/utils.py": ["get_spec_layer_idx_from_weight_name"],
    "vllm/model_executor/layers/fused_moe/layer.py": ["fused_moe_make_expert_params_mapping"],
    "vllm/model_executor/layers/fused_moe/routed_experts.py": [
        "RoutedExperts.make_expert_params_mapping",
        "RoutedExperts.build_expert_params_mapping",
    ],
    "vllm/distributed/eplb/eplb_state.py": ["EplbState.build_initial_global_physical_to_logical_map"],
    "vllm/utils/math_utils.py": ["cdiv"],
}
# platform -> (file, the names cut out of it) for the draft model class; the entry's class
# is the one whose load_weights runs.
VLLM_CUTS: dict[str, dict[str, Any]] = {
    "vllm-xpu-mtp": {
        "class": "DeepSeekV4MTP",
        "cuts": {
            V4 + "xpu/mtp.py": [
                "_EXPERT_SCALE_RE",
                "DeepSeekV4MTP.load_weights",
                "DeepSeekV4MTP.finalize_mega_moe_weights",
                "DeepSeekV4MTP._rewrite_spec_layer_name",
            ],
            V4 + "xpu/model.py": ["make_deepseek_v4_expert_params_mapping"],
        },
    },
    "vllm-nvidia-mtp": {
        "class": "DeepSeekV4MTP",
        "cuts": {
            V4 + "nvidia/mtp.py": [
                "_EXPERT_SCALE_RE",
                "DeepSeekV4MTP.load_weights",
                "DeepSeekV4MTP._to_spec_layer_name",
                "DeepSeekV4MTP._rewrite_spec_layer_name",
            ],
            V4 + "nvidia/model.py": [
                "make_deepseek_v4_expert_params_mapping",
                "DeepseekV4Model._pad_shared_expert_weight",
            ],
        },
    },
    "vllm-amd-mtp": {
        "class": "DeepSeekV4MTP",
        "cuts": {
            V4 + "amd/mtp.py": [
                "_EXPERT_SCALE_RE",
                "DeepSeekV4MTP.load_weights",
                "DeepSeekV4MTP._rewrite_spec_layer_name",
            ],
        },
    },
    "vllm-xpu-dspark": {
        "class": "DSparkDeepseekV4ForCausalLM",
        "cuts": {
            V4 + "xpu/dspark.py": [
                "_EXPERT_SCALE_RE",
                "DSparkDeepseekV4ForCausalLM.load_weights",
                "DSparkDeepseekV4ForCausalLM._finalize_moe",
                "DSparkDeepseekV4ForCausalLM._remap_dspark_name",
            ],
            V4 + "xpu/model.py": ["make_deepseek_v4_expert_params_mapping"],
        },
    },
    # the NVIDIA class also feeds every stage's wkv into model.context_wkv_proj
    # (nvidia/dspark.py:72-86, 483, 514-518) and keeps the confidence head (:176-180, 584-585)
    "vllm-nvidia-dspark": {
        "class": "DSparkDeepseekV4ForCausalLM",
        "cuts": {
            V4 + "nvidia/dspark.py": [
                "_EXPERT_SCALE_RE",
                "_CONTEXT_WKV_RE",
                "_duplicate_context_wkv_weights",
                "DSparkDeepseekV4ForCausalLM.load_weights",
                "DSparkDeepseekV4ForCausalLM._remap_dspark_name",
            ],
            V4 + "nvidia/model.py": [
                "make_deepseek_v4_expert_params_mapping",
                "DeepseekV4Model._pad_shared_expert_weight",
            ],
            "vllm/model_executor/models/utils.py": ["extract_layer_index"],
        },
    },
    "vllm-amd-dspark": {
        "class": "DSparkDeepseekV4ForCausalLM",
        "cuts": {
            V4 + "amd/dspark.py": [
                "_EXPERT_SCALE_RE",
                "DSparkDeepseekV4ForCausalLM.load_weights",
                "DSparkDeepseekV4ForCausalLM._remap_dspark_name",
            ],
        },
    },
}
# the loaders whose parameters only --serve-with builds (vllm_layer): XPU_OUT, the XPU
# layout, holds no NVIDIA context_wkv_proj nor confidence head
SERVE_ONLY = ("vllm-nvidia-dspark", "vllm-amd-dspark")


def stand_in_layer() -> Any:
    moe = types.SimpleNamespace(
        use_mega_moe=False,
        use_native_mega_moe=False,
        n_redundant_experts=0,  # no EPLB (nvidia/dspark.py:463)
        finalize_mega_moe_weights=lambda: None,
        experts=types.SimpleNamespace(has_fused_shared_experts=False),
    )
    return types.SimpleNamespace(ffn=moe, mtp_block=types.SimpleNamespace(ffn=moe))


class _Logger:
    def __getattr__(self, _name: str) -> Callable[..., None]:
        return lambda *a, **k: None


def vllm_namespace(
    wheel: Wheel, files: dict[str, list[str]], recorder: Recorder, completeness: list[bool]
) -> dict[str, Any]:
    """The module globals the cut-out code runs in: the wheel's functions, the stubs."""
    import typing
    from collections.abc import Callable as _Callable

    ns: dict[str, Any] = {
        "__name__": "cut_out_vllm",
        "re": re,
        "torch": torch,
        "typing": typing,
        "Callable": _Callable,
        "logger": _Logger(),
        "default_weight_loader": recorder.load,
        "is_mtp_completeness_check_enabled": lambda: completeness[0],
        "get_tensor_model_parallel_world_size": lambda: 1,
    }
    for member in {**VLLM_COMMON, **files}:
        names = [*VLLM_COMMON.get(member, []), *files.get(member, [])]
        cut(wheel.source(member), f"{wheel.path.name}/{member}", names, ns)
    return ns


def vllm_model(
    ns: dict[str, Any], cls_name: str, config: dict[str, Any], params: Iterable[str], recorder: Recorder
) -> Any:
    """The cut-out class mixed with a stand-in holding what its load_weights reads."""
    cfg = attrs(config)
    quant = attrs(config.get("quantization_config") or {})

    class StandIn:
        def named_parameters(self) -> Iterator[tuple[str, RecordingParam]]:
            for p in params:
                yield p, RecordingParam(p, recorder)

    model = type(cls_name, (ns[cls_name], StandIn), {})()
    model.config = cfg
    model.quant_config = quant
    if cls_name == "DSparkDeepseekV4ForCausalLM":
        stages = len(config["dspark_target_layer_ids"])
        model.model = types.SimpleNamespace(layers=[stand_in_layer() for _ in range(stages)])
    else:
        start, n = config["num_hidden_layers"], config["num_nextn_predict_layers"]
        model.model = types.SimpleNamespace(
            layers={str(start + i): stand_in_layer() for i in range(n)}, mtp_start_layer_idx=start, num_mtp_layers=n
        )
        # nvidia/mtp.py:308-310, with sequence parallelism off (one GPU)
        model.pad_shared_expert = getattr(quant, "weight_block_size", None) is not None
    return model


def verify_vllm(wheel: Wheel, loader: str, draft: Path, expected_dir: Path) -> Report:
    spec = VLLM_CUTS[loader]
    config = json.loads((draft / "config.json").read_text())
    expected = dict(read_tensors(expected_dir))
    droppable, shared_params = table_facts(load_table("xpu_dspark" if loader.endswith("dspark") else "xpu"), config)
    recorder = Recorder()
    completeness = [True]
    ns = vllm_namespace(wheel, spec["cuts"], recorder, completeness)
    model = vllm_model(ns, spec["class"], config, expected, recorder)

    def load(weights: Iterable[tuple[str, torch.Tensor]], first: bool) -> Any:
        completeness[0] = first
        return model.load_weights(weights)

    return run_loader(loader, load, recorder, draft, expected, droppable, shared_params)


def table_facts(table: Table, config: dict[str, Any]) -> tuple[Callable[[str], bool], set[str]]:
    """From the xpu table: which fed names the runtime may drop (the [copy] sources and the
    [skip] rules on the draft's own mtp.* names) and the shared parameters (the [copy]
    targets, {L} bound to each MTP layer num_hidden_layers + i)."""
    copies = [r for r in table.rules if r.op == "copy"]
    allowed = [
        rx
        for r in table.rules
        if r.op == "copy" or (r.op == "skip" and r.sources[0].startswith("mtp."))
        for rx in r.source_regexes
    ]
    layers = range(config["num_hidden_layers"], config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 1))
    shared = {expand(r.target, {"L": n}) for r in copies for n in layers}
    return (lambda name: any(rx.match(name) for rx in allowed)), shared
