"""The exact transforms' computations (convert/transforms.py lists them), and what every
transform shares: a native weight dequantised, and a rebuilt weight measured against it.

A native weight decodes with the bundled model's own dequantisation (model/quantized.py):
FP8 e4m3 times its block's scale, or an e2m1 code times its group's E8M0 scale. Both are
exact in bf16 when the scales are powers of two (an e4m3 or e2m1 value has at most 4
significant bits; bf16 has 8 and fp32's exponent range), and exact in fp32 always.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dsv4.convert.computed import CT_FP8_BLOCK, FP4_GROUP, Computed, Measured
from dsv4.convert.errors import PlanError
from dsv4.convert.planned import Transform
from dsv4.model.quantized import FP8, dequant_block, dequant_packed, scale_to_float
from dsv4.model.storage import FP4

E8M0_BIAS = 127
E8M0_NAN = 255  # the one E8M0 byte that is no power of two
FP4_MAX_OFFSET = 6  # log2 of e2m1's largest value 6, rounded up: 6 * 2^6 = 384 <= 448, e4m3's max
# e4m3 holds e2m1's smallest nonzero magnitudes (0.5, 1.5) times 2^-m down to 2^-9 (its least
# subnormal) with the two significant bits 1.5 needs: a group may sit up to 14 binades below the
# block's largest (0.5 * 2^(6-14) = 2^-9)
FP8_SPAN = 14


def native_dequantised(
    weight: torch.Tensor, scale: torch.Tensor, transform: Transform, dtype: torch.dtype
) -> torch.Tensor:
    """A native weight (FP8 e4m3 with block scales, or packed FP4 with E8M0 per 32) in `dtype`."""
    if weight.dtype == FP8:
        return dequant_block(weight, scale, transform.source_block, dtype)
    return dequant_packed(weight, scale, FP4, dtype)


# values per block of a weight's error measurement and of its bf16 dequantisation: a few MiB
# of F32 temporaries at a time, whatever the weight's size
BLOCK_VALUES = 1 << 20


class Errors:
    """The error of a rebuilt weight against the native one, summed over row blocks in one
    pass: max |difference| and the RMS of the difference over the RMS of the weight, each block
    in fp32, its sums in fp64 (`measured`: the same quantities as over the whole weight at
    once, to rounding). NaN where both hold NaN agrees; NaN against a number is an infinite
    error."""

    def __init__(self) -> None:
        self.max_abs, self.diff_sq, self.native_sq, self.count = 0.0, 0.0, 0.0, 0

    def add(self, native: torch.Tensor, rebuilt: torch.Tensor) -> None:
        a, b = native.float(), rebuilt.float()
        diff = torch.sub(a, b).abs_()
        nan = diff.isnan()
        if nan.any():  # rare: only then the masks
            diff = torch.where(a.isnan() & b.isnan(), 0.0, diff.masked_fill_(nan, torch.inf))
        if diff.numel():
            self.max_abs = max(self.max_abs, diff.max().item())
        self.diff_sq += diff.square_().sum(dtype=torch.float64).item()
        self.native_sq += a.square().nansum(dtype=torch.float64).item()  # a NaN of the weight counts 0
        self.count += a.numel()

    def measured(self) -> Measured:
        if not self.count:
            return Measured(0.0, math.nan)
        rms, size = math.sqrt(self.diff_sq / self.count), math.sqrt(self.native_sq / self.count)
        return Measured(self.max_abs, rms / size if size else rms)


def row_step(rows: int, cols: int, multiple: int = 1) -> int:
    """Rows per block of a [rows, cols] weight: about BLOCK_VALUES values, a multiple of `multiple`."""
    return max(multiple, BLOCK_VALUES // max(cols, 1) // multiple * multiple)


def measure(native: torch.Tensor, rebuilt: torch.Tensor) -> Measured:
    """The rebuilt weight against the native one (`Errors`), a block of rows at a time."""
    errors = Errors()
    flat_a, flat_b = native.reshape(-1, native.shape[-1]), rebuilt.reshape(-1, rebuilt.shape[-1])
    step = row_step(*flat_a.shape)
    for r in range(0, max(flat_a.shape[0], 1), step):
        errors.add(flat_a[r : r + step], flat_b[r : r + step])
    return errors.measured()


def _e8m0_to_f32(tensors: list[torch.Tensor], transform: Transform, where: str) -> Computed:
    return Computed({"": scale_to_float(tensors[0])}, None)


def _dequant_bf16(tensors: list[torch.Tensor], transform: Transform, where: str) -> Computed:
    """The native weight in bf16, dequantised and measured a block of rows at a time (whole
    scale blocks of an FP8 weight): its fp32 values cast as `native_dequantised` casts them."""
    weight, scale = tensors
    fp8 = weight.dtype == FP8
    rows, k = weight.shape[0], weight.shape[1] * (1 if fp8 else FP4.codes_per_byte)
    block = transform.source_block[0] if fp8 else 1  # rows per scale row
    out, errors = torch.empty((rows, k), dtype=torch.bfloat16), Errors()
    step = row_step(rows, k, block)
    for r in range(0, rows, step):
        native = native_dequantised(
            weight[r : r + step], scale[r // block : -(-(r + step) // block)], transform, torch.float32
        )
        out[r : r + step] = native  # round to nearest even, as Tensor.to(torch.bfloat16)
        errors.add(native, out[r : r + step])
    return Computed({"": out}, errors.measured())


def _blocks(x: torch.Tensor, per_block: int) -> torch.Tensor:
    """A [rows, groups] grid as [row blocks, 128, column blocks, groups per block], its ragged
    edges padded with zeros (groups of zero codes, which constrain nothing)."""
    bn = CT_FP8_BLOCK[0]
    rows, cols = -(-x.shape[0] // bn) * bn, -(-x.shape[1] // per_block) * per_block
    padded = torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]), value=0)
    return padded.view(rows // bn, bn, cols // per_block, per_block)


def _refuse_block(where: str, transform: Transform, r: int, c: int, why: str) -> PlanError:
    return PlanError(
        f"{where}: 128x128 block (row {r}, column {c}) of {transform.inputs[0].name}: {why}; refusing to "
        "requantise it inexactly",
        kind="inexact_transform",
        tensor=where,
    )


def _fp4_to_fp8_block(tensors: list[torch.Tensor], transform: Transform, where: str) -> Computed:
    """e2m1 x 2^s (per 32) -> e4m3 x 2^b (per 128x128 block) with b = s_max - 6 over the
    block's groups holding a nonzero code: exact when those groups' exponents span at most
    FP8_SPAN, checked for every block; a block that fails is refused, naming it."""
    packed, scale = tensors
    n = packed.shape[0]
    per_block = CT_FP8_BLOCK[1] // FP4_GROUP
    # a code is zero when its magnitude bits (0-2 of each nibble) are: 0 and -0
    nonzero = (packed.view(torch.uint8) & 0x77).ne(0).view(n, scale.shape[1], -1).any(-1)
    exps = scale.view(torch.uint8).int()
    nz, e = _blocks(nonzero.int(), per_block).bool(), _blocks(exps, per_block)
    s_max = torch.where(nz, e, -1).amax(dim=(1, 3))  # -1: no nonzero code in the block
    s_min = torch.where(nz, e, E8M0_NAN + 1).amin(dim=(1, 3))
    # a NaN scale makes its whole group NaN, zero codes too: no block scale can say that
    has_nan = e.eq(E8M0_NAN).any(dim=3).any(dim=1)
    bad = ((s_max - s_min > FP8_SPAN) & (s_max >= 0)) | has_nan
    if bad.any():
        r, c = (int(i) for i in bad.nonzero()[0])
        span = int(s_max[r, c] - s_min[r, c])
        raise _refuse_block(
            where,
            transform,
            r,
            c,
            "a group's E8M0 scale is NaN"
            if has_nan[r, c]
            else f"its E8M0 scale exponents span {span} binades over the groups with a nonzero code, more than "
            f"the {FP8_SPAN} an FP8 e4m3 block holds exactly",
        )
    # a block of zero codes only: any scale holds it (its groups' largest exponent, zero or not)
    ref = torch.where(s_max >= 0, s_max, e.amax(dim=(1, 3)))
    block_scale = torch.exp2((ref - FP4_MAX_OFFSET - E8M0_BIAS).float())
    # each group's scale relative to its block's, 2^(s - ref + 6), exact in fp32; 1 for a group
    # of zero codes (whose own exponent may be far from the block's: 0 x inf would be NaN)
    bn = CT_FP8_BLOCK[0]
    group_ref = ref.repeat_interleave(bn, dim=0)[:n].repeat_interleave(per_block, dim=1)[:, : exps.shape[1]]
    relative = torch.exp2(torch.where(nonzero, exps - group_ref + FP4_MAX_OFFSET, 0).float())
    weight = dequant_packed(packed, relative, FP4, torch.float32).to(FP8)
    rebuilt = dequant_block(weight, block_scale, CT_FP8_BLOCK, torch.float32)  # as vLLM's FP8-block layer reads it
    native = dequant_packed(packed, scale, FP4, torch.float32)
    return Computed({"weight": weight, "weight_scale": block_scale}, measure(native, rebuilt))


def _unit_scale(tensors: list[torch.Tensor], transform: Transform, where: str) -> Computed:
    return Computed({"": torch.ones(1, dtype=torch.float32)}, None)


OPS: dict[str, Callable[[list[torch.Tensor], Transform, str], Computed]] = {
    "e8m0_to_f32": _e8m0_to_f32,
    "unit_scale": _unit_scale,
    "dequant_bf16": _dequant_bf16,
    "fp4_to_fp8_block": _fp4_to_fp8_block,
}
