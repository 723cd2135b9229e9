"""DeepSeek's own fp8 (`quant_method: fp8`, block 128x128): the draft served as it is.

vLLM's DeepseekV4FP8Config gives every linear an FP8 block scheme and the routed experts the
method of the checkpoint's expert storage (MXFP4 for FP4 experts, FP8 for FP8 ones); what the
native checkpoint stores in bf16 (the router, the embedding, the head) is not quantised. So
each module takes the scheme its native storage already is, and the tensors as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsv4.convert.schemes.base import (
    FP4_EXPERTS,
    FP8_BLOCK,
    PACKED_FP4,
    UNQUANTISED,
    Decision,
    ErrorFactory,
    LayerMap,
    Scheme,
    TargetMethod,
    part_tensors,
)
from dsv4.model.native import Layout

METHOD = "fp8"
# An FP8 config with a list of layer names left unquantised would keep native names (carrying
# it) and change which draft layer is quantised (serving beside it): neither is supported.
NAME_LISTS = ("modules_to_not_convert", "ignored_layers")
# DeepSeek fp8 with NVFP4 experts (ModelOpt's experts beside FP8 linears): not this entry's
MIXED_EXPERTS = "moe_quant_algo"
STORED: dict[str, Scheme] = {"F8_E4M3": FP8_BLOCK, PACKED_FP4: FP4_EXPERTS}


def refuse_named_layers(qc: Mapping[str, Any], where: str, error: ErrorFactory, doing: str) -> None:
    """A DeepSeek fp8 config that names modules cannot be `doing` (carried, served beside)."""
    named = [k for k in NAME_LISTS if qc.get(k)]
    if named:
        raise error(
            f"{where}: quantization_config.{named[0]} lists native module names; {doing} is not supported",
            path=where,
            field=f"quantization_config.{named[0]}",
        )


def decide(
    qc: Mapping[str, Any] | None, layers: LayerMap, native: Layout, where: str, error: ErrorFactory
) -> list[Decision]:
    assert qc is not None  # the registry gives this entry only configs of its method
    refuse_named_layers(qc, where, error, "serving a draft beside it")
    if qc.get(MIXED_EXPERTS) is not None:
        raise error(
            f"{where}: quantization_config.{MIXED_EXPERTS} is {qc[MIXED_EXPERTS]!r}: experts quantised apart from "
            "the FP8 linears are not a scheme this converter knows",
            path=where,
            field=f"quantization_config.{MIXED_EXPERTS}",
        )
    out = []
    for module, parts in layers.parts.items():
        weight = part_tensors(parts[0], native).get(f"{parts[0]}.weight")
        scheme = STORED.get(weight[0], UNQUANTISED) if weight is not None else UNQUANTISED
        out.append(
            Decision(module, layers.kinds[module], parts, scheme, f"{METHOD}: as the native checkpoint stores it")
        )
    return out


ENTRY = TargetMethod(METHOD, "DeepSeek fp8 (block 128x128)", decide)
