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
from .releases import VLLM_COMMON, VLLM_LOADERS, Cuts, cuts_for, pick
from .wheels import PINNED, Wheel

# the pinned release's cuts per loader (what --serve-with runs; releases.py has every release's)
VLLM_CUTS: dict[str, Cuts] = {
    name: cuts for name in VLLM_LOADERS if (cuts := cuts_for(VLLM_LOADERS, name, PINNED["vllm"])) is not None
}


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
        "get_tensor_model_parallel_rank": lambda: 0,
    }
    common = pick(VLLM_COMMON, wheel.version)
    for member in {**common, **files}:
        names = [*common.get(member, []), *files.get(member, [])]
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

        def modules(self) -> Iterator[Any]:
            # no RoutedExperts with a fused-shared-expert loader to redirect the expert
            # mapping to (vLLM 0.34.0 fused_moe/routed_experts.py:1184-1188)
            return iter(())

    model = type(cls_name, (ns[cls_name], StandIn), {})()
    model.config = cfg
    model.quant_config = quant
    if cls_name == "DSparkDeepseekV4ForCausalLM":
        stages = len(config["dspark_target_layer_ids"])
        # vLLM 0.34.0's XPU class builds a confidence head unless the config turns it off (xpu/dspark.py:112-117)
        head = types.SimpleNamespace() if config.get("enable_confidence_head", True) else None
        model.model = types.SimpleNamespace(layers=[stand_in_layer() for _ in range(stages)], confidence_head=head)
    else:
        start, n = config["num_hidden_layers"], config["num_nextn_predict_layers"]
        model.model = types.SimpleNamespace(
            layers={str(start + i): stand_in_layer() for i in range(n)}, mtp_start_layer_idx=start, num_mtp_layers=n
        )
    # nvidia/mtp.py:308-310, nvidia/dspark.py:362-364, with sequence parallelism off (one GPU)
    model.pad_shared_expert = getattr(quant, "weight_block_size", None) is not None
    return model


def verify_vllm(wheel: Wheel, loader: str, draft: Path, expected_dir: Path) -> Report:
    spec = cuts_for(VLLM_LOADERS, loader, wheel.version)
    if spec is None:
        return Report(loader, absent=f"vLLM {wheel.version}")
    config = json.loads((draft / "config.json").read_text())
    # XPU_OUT's names are the pinned release's parameters; this release's may differ (spec.renames)
    expected = {spec.param_name(n): t for n, t in read_tensors(expected_dir)}
    if spec.added:
        fed = dict(read_tensors(draft))
        expected.update({p: torch.cat([fed[n] for n in names]) for p, names in spec.added_params(fed).items()})
    droppable, shared = table_facts(load_table("xpu_dspark" if loader.endswith("dspark") else "xpu"), config)
    shared_params = {spec.param_name(n) for n in shared}
    recorder = Recorder()
    completeness = [True]
    ns = vllm_namespace(wheel, spec.cuts, recorder, completeness)
    model = vllm_model(ns, spec.cls, config, expected, recorder)

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
