"""The compressed-tensors configs the converter writes for a draft: config groups naming only
the draft's modules (FP8 block linears, MXFP4 or FP8 block experts), each the library's preset
of that name, placed first in the target's config (the overlays) or alone (a DSpark draft's
own config). convert/schemes/compressed_tensors.py says why each route takes them.

A group's body is made by a `Body` (preset, targets, format): compressed-tensors' own preset
(`preset_body`), or, for the plan read without the library (ct_config.provisional), the
targets and format alone (`unread_body`): which module a group takes is decided by its targets,
and the scheme is the preset's, which the library's reading confirms (convert/verdict.py).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from typing import Any

from dsv4.convert.schemes.base import PACKED_FP4, LayerMap, part_tensors
from dsv4.convert.schemes.ct_config import FP8_BLOCK, METHOD, MXFP4A16
from dsv4.convert.schemes.ct_match import NEVER_QUANTISED, DraftModule, vllm_name
from dsv4.model.native import Layout

LINEAR_GROUP, EXPERTS_GROUP = "dsv4_draft_linears", "dsv4_draft_experts"
WO_A = "attn.wo_a"
# NVIDIA's DSpark only: every stage's wkv stacked (nvidia/dspark.py:142-150)
CONTEXT_WKV = DraftModule("model.context_wkv_proj", "linear")
Body = Callable[[str, list[str], str], dict[str, Any]]
# a draft group: its compressed-tensors preset (named as the scheme it is, ct_config.py), targets and format
Spec = tuple[str, list[str], str]


def is_dspark(layers: LayerMap) -> bool:
    return "model.main_proj" in layers.parts  # only DSpark builds main_proj (nvidia/dspark.py:115-121)


def storage(layers: LayerMap, module: str, native: Layout) -> str:
    """The dtype `module`'s first part stores its weight in."""
    part = layers.parts[module][0]
    return part_tensors(part, native)[f"{part}.weight"][0]


def alternation(items: list[str]) -> str:
    return "(" + "|".join(re.escape(i) for i in items) + ")" if len(items) > 1 else re.escape(items[0])


def layer_numbers(layers: LayerMap) -> list[str]:
    return sorted({m.split(".")[2] for m in layers.parts if m.startswith("model.layers.")}, key=int)


def preset_body(preset: str, targets: list[str], fmt: str) -> dict[str, Any]:
    from compressed_tensors.quantization import preset_name_to_scheme  # the optional [quant] extra

    group = preset_name_to_scheme(preset, targets).model_dump(mode="json", exclude_none=True)
    return {**group, "format": fmt}


def unread_body(preset: str, targets: list[str], fmt: str) -> dict[str, Any]:
    return {"targets": targets, "format": fmt}


def draft_specs(
    layers: LayerMap, native: Layout, *, anchor: str, linear_leaves: list[str] | None = None
) -> dict[str, Spec]:
    """Config groups naming only the draft's modules (`anchor` is the regex of their common
    prefix): FP8 block for its quantisable linears (or those of `linear_leaves`), MXFP4 for FP4
    routed experts, FP8 block for FP8 ones; expert targets cover the NVIDIA and the XPU/AMD
    probe names."""
    linears, experts = [], None
    for m in layers.parts:
        name = vllm_name(m)
        if NEVER_QUANTISED.search(name) or name.endswith(".head"):
            continue
        leaf = re.sub(r"^model\.(layers\.\d+\.)?", "", name)
        if layers.kinds[m] == "moe":
            experts = storage(layers, m, native)
        elif (linear_leaves is None or leaf in linear_leaves) and leaf not in linears:
            linears.append(leaf)
    if is_dspark(layers) and linear_leaves is None:  # the wkv layers' group: FP8 block, above
        linears.append(CONTEXT_WKV.name.removeprefix("model."))
    groups = {LINEAR_GROUP: (FP8_BLOCK, [f"re:^{anchor}{alternation(linears)}$"], "float-quantized")}
    if experts is not None and linear_leaves is None:
        preset, fmt = (MXFP4A16, "mxfp4-pack-quantized") if experts == PACKED_FP4 else (FP8_BLOCK, "float-quantized")
        probes = r"ffn\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
        groups[EXPERTS_GROUP] = (preset, [f"re:^{anchor}{probes}$"], fmt)
    return groups


def dspark_config(layers: LayerMap, native: Layout, body: Body = preset_body) -> tuple[dict[str, Any], dict[str, str]]:
    """A DSpark draft's own config (its layers, its main projection and NVIDIA's
    context_wkv_proj under one anchor), and its groups' presets by name."""
    specs = draft_specs(layers, native, anchor=rf"model\.(layers\.{alternation(layer_numbers(layers))}\.)?")
    groups = {name: body(*spec) for name, spec in specs.items()}
    own = {"quant_method": METHOD, "format": "mixed-precision", "config_groups": groups, "ignore": []}
    return own, {name: spec[0] for name, spec in specs.items()}


def overlaid(
    qc: Mapping[str, Any], layers: LayerMap, native: Layout, *, bf16: bool, body: Body = preset_body
) -> tuple[dict[str, Any], dict[str, str]]:
    """The target's config with the draft's groups first (so they win the name match), and the
    draft's layers in every transform's ignore; `bf16`: the draft's layers ignored instead,
    wo_a kept in an FP8 block group. Beside it the draft groups' presets by their names there."""
    out = copy.deepcopy(dict(qc))
    layer = rf"model\.layers\.{alternation(layer_numbers(layers))}\."
    if bf16:
        specs = draft_specs(layers, native, anchor=layer, linear_leaves=[WO_A])
        out["ignore"] = [*(out.get("ignore") or []), f"re:^{layer}(?!{re.escape(WO_A)}$)"]
    else:
        specs = draft_specs(layers, native, anchor=layer)
    taken = set(out["config_groups"])
    named = {_free(g, taken): spec for g, spec in specs.items()}
    out["config_groups"] = {name: body(*spec) for name, spec in named.items()} | out["config_groups"]
    for scheme in (out.get("transform_config") or {}).get("config_groups", {}).values():
        for args in scheme.get("apply", []):
            args["ignore"] = [*args.get("ignore", []), f"re:^{layer}"]
    return out, {name: spec[0] for name, spec in named.items()}


def _free(name: str, taken: set[str]) -> str:
    k = 0
    while (candidate := name if k == 0 else f"{name}_{k}") in taken:
        k += 1
    return candidate
