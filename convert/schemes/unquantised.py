"""No quantization_config on the target: vLLM builds every draft layer unquantised, so every
draft module takes a bf16 weight (dequantised from the native FP8 or FP4, exactly)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsv4.convert.schemes.base import UNQUANTISED, Decision, ErrorFactory, LayerMap, TargetMethod
from dsv4.model.native import Layout


def decide(
    qc: Mapping[str, Any] | None, layers: LayerMap, native: Layout, where: str, error: ErrorFactory
) -> list[Decision]:
    why = "no quantization_config: no layer quantised"
    return [Decision(m, layers.kinds[m], parts, UNQUANTISED, why) for m, parts in layers.parts.items()]


ENTRY = TargetMethod(None, "no quantization_config, every layer bf16", decide)
