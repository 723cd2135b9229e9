"""What a transform's computation gives (convert/transforms.py runs it): its tensors, and
the rebuilt weight's error against the native one; the block sizes the transforms share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsv4.model.storage import FP4

if TYPE_CHECKING:
    import torch

CT_FP8_BLOCK = (128, 128)  # compressed-tensors' FP8_BLOCK weights' block_structure (quant_scheme.py:447-454)
FP4_GROUP = FP4.scale_block[1] if FP4.scale_block else 0  # inputs per E8M0 scale of a native FP4 weight


@dataclass(frozen=True)
class Measured:
    """A computed weight, read back as its scheme reads it, against the native dequantised one:
    the max absolute difference and the RMS difference over the native weight's RMS."""

    max_abs_error: float
    rel_rms_error: float

    @property
    def exact(self) -> bool:
        return self.max_abs_error == 0.0


@dataclass(frozen=True)
class Computed:
    tensors: dict[str, torch.Tensor]  # leaf ("" for a transform of one output) -> the tensor
    measured: Measured | None  # None: no weight was rebuilt (a scale's decoding)
