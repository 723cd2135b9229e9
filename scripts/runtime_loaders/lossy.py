"""A draft's re-expressed tensors as the serving proof holds them: a computed tensor whose weight
was rebuilt to measure it (conversion.json "serve" -> "tensors" -> NAME with "max_abs_error" and
"rel_rms_error" of its module's rebuilt weight against the native one) has no native bytes to equal:
every lossy one (a match-target --allow-lossy requantisation, "exact": false) and the exact ones
that hold a weight in another format (FP4 experts re-blocked into FP8, a weight dequantised to
bf16, recorded 0.0). Each is held instead to what the record says: a lossy one to its error, an
exact one to none (its module decodes to the native values).

The module's leaves are decoded as the converter's own held-draft loader decodes them
(convert/route_load.py: compressed-tensors' decompressors) and measured against the native weight
dequantised in bf16 (the dtype the converter measured in, convert/requant.py) by the converter's own
measure (convert/transform_ops.py): the same operations on the same bytes, so the figures agree to
rounding; a tensor whose bytes changed since gives another error and fails.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv4.convert.route_load import decoded
from dsv4.convert.schemes.base import module_of
from dsv4.convert.served import MEASURED
from dsv4.convert.transform_ops import measure
from dsv4.model.config import ModelConfig
from dsv4.model.quantized import dequant_block, dequant_packed
from dsv4.model.record import CONVERSION_RECORD
from dsv4.model.storage import FP4, held_linear

REL_TOLERANCE = 1e-6  # a recomputation of the converter's own measurement: equal up to float rounding


@dataclass(frozen=True)
class LossyCheck:
    """A draft module's lossy tensors: the error measured now, and the tensors whose record disagrees."""

    max_abs_error: float
    rel_rms_error: float
    off_record: list[str]  # "NAME: measured X, recorded Y"


def measured_record(draft: Path) -> dict[str, dict[str, Any]]:
    """The computed tensors conversion.json records a measured error of (name -> its record); none
    without one."""
    path = draft / CONVERSION_RECORD
    if not path.is_file():
        return {}
    tensors = (json.loads(path.read_text()).get("serve") or {}).get("tensors") or {}
    return {name: entry for name, entry in tensors.items() if all(k in entry for k in MEASURED)}


def _native_weight(weight: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    if weight.dtype == torch.int8:  # packed FP4, E8M0 per 32 inputs
        return dequant_packed(weight, scale, FP4, torch.bfloat16)
    return dequant_block(weight, scale, cfg.weight_block_size, torch.bfloat16)


def check_module(
    module: str,
    held: dict[str, torch.Tensor],
    native: dict[str, torch.Tensor],
    record: dict[str, dict[str, Any]],
    cfg: ModelConfig,
) -> LossyCheck:
    """Draft module `module` (its tensors `held`, by leaf) decoded and measured against the native
    weight and scale in `native`, each of its leaves in `record` compared with that measurement."""
    form = held_linear(module, _dtypes(held))
    weight, scale = native[f"{module}.weight"], native[f"{module}.scale"]
    cols = weight.shape[1] * (2 if weight.dtype == torch.int8 else 1)
    group = None if form is None else form.group_of(cols, {leaf: tuple(t.shape) for leaf, t in held.items()})
    if form is None or group is None:  # no form holds these dtypes, or the scale groups no whole inputs
        said = {leaf: (_dtypes(held)[leaf], list(t.shape)) for leaf, t in held.items()}
        return LossyCheck(math.inf, math.inf, [f"{module}: {said} is no held form of a [.., {cols}] linear"])
    off = []
    measured = measure(_native_weight(weight, scale, cfg), decoded(form, held, cfg, group))
    for leaf in held:
        entry = record.get(f"{module}.{leaf}")
        if entry is None:
            continue
        for key in MEASURED:
            now, then = getattr(measured, key), entry.get(key)
            if not isinstance(then, float | int) or not math.isclose(now, then, rel_tol=REL_TOLERANCE, abs_tol=0.0):
                off.append(f"{module}.{leaf}: {key} measured {now:.6g}, recorded {then}")
    return LossyCheck(measured.max_abs_error, measured.rel_rms_error, off)


def _dtypes(held: dict[str, torch.Tensor]) -> dict[str, str]:
    from dsv4.model.dtypes import SAFETENSORS_NAMES

    return {leaf: SAFETENSORS_NAMES[t.dtype] for leaf, t in held.items()}


def modules_of(names: set[str]) -> dict[str, list[str]]:
    """The draft modules behind tensor names, and their names."""
    out: dict[str, list[str]] = {}
    for name in sorted(names):
        out.setdefault(module_of(name), []).append(name)
    return out
