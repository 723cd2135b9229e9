"""A computed weight's error measured a block of rows at a time (convert/transform_ops.py
`Errors`) is the whole-tensor formula's: max |difference| equal, the relative RMS within 1e-6
(fp64 sums of fp32 blocks against fp32 means); and the bf16 dequantisation made by blocks is the
whole weight's, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.convert import transform_ops
from dsv4.convert.planned import Transform
from dsv4.model.dtypes import TORCH_DTYPES
from dsv4.model.quantized import FP8

REL = 1e-6


def whole(native: torch.Tensor, rebuilt: torch.Tensor) -> tuple[float, float]:
    """The measurement over the whole weight at once, as conversion.json's fields define it."""
    a, b = native.float(), rebuilt.float()
    diff = torch.where(a.isnan() & b.isnan(), 0.0, (a - b).abs())
    diff = torch.where(diff.isnan(), torch.inf, diff)
    size = torch.where(a.isnan(), 0.0, a).pow(2).mean().sqrt().item()
    rms = diff.pow(2).mean().sqrt().item()
    return diff.max().item(), rms / size if size else rms


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transform_ops, "BLOCK_VALUES", 64 * 7)  # 7 rows of 64 a block, the last one ragged


def weights() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    native = torch.randn(300, 64, generator=g) * 3
    rebuilt = (native + torch.randn(300, 64, generator=g) * 1e-3).bfloat16()
    agreed, against = native.clone(), rebuilt.clone()
    agreed[5, 3] = against[5, 3] = math.nan  # NaN on both sides agrees
    one_sided = rebuilt.clone()
    one_sided[299, 63] = math.nan  # NaN against a number: an infinite error
    return {"close": (native, rebuilt), "nan-agrees": (agreed, against), "nan-one-side": (native, one_sided)}


@pytest.mark.parametrize("case", ["close", "nan-agrees", "nan-one-side"])
def test_the_blockwise_error_is_the_whole_tensor_formulas(small_blocks: None, case: str) -> None:
    native, rebuilt = weights()[case]
    got = transform_ops.measure(native, rebuilt)
    want_max, want_rel = whole(native, rebuilt)
    assert got.max_abs_error == want_max
    if math.isinf(want_rel):
        assert got.rel_rms_error == want_rel
    else:
        assert got.rel_rms_error == pytest.approx(want_rel, rel=REL) and want_rel > 0


def _native(dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if dtype == "fp8":  # 300 rows: two whole 128-row scale blocks and a ragged one
        weight = torch.randint(0, 256, (300, 256), generator=g, dtype=torch.uint8).view(FP8)
        scale = torch.randint(120, 135, (3, 2), generator=g, dtype=torch.uint8)
    else:  # packed e2m1, one E8M0 scale per 32 inputs
        weight = torch.randint(-128, 128, (300, 64), generator=g, dtype=torch.int8)
        scale = torch.randint(120, 135, (300, 4), generator=g, dtype=torch.uint8)
    return weight, scale.view(TORCH_DTYPES["F8_E8M0"])


@pytest.mark.parametrize("dtype", ["fp8", "fp4"])
def test_the_bf16_dequantisation_by_blocks_is_the_whole_weights_bit_for_bit(small_blocks: None, dtype: str) -> None:
    weight, scale = _native(dtype)
    transform = Transform("dequant_bf16", (), (), True, (128, 128))
    got = transform_ops.OPS["dequant_bf16"]([weight, scale], transform, "w")
    want = transform_ops.native_dequantised(weight, scale, transform, torch.bfloat16)
    assert got.tensors[""].view(torch.int16).equal(want.view(torch.int16))
    assert got.measured is not None and got.measured.max_abs_error == 0.0  # exact in bf16 (NaN codes agree)
    assert (got.measured.max_abs_error, got.measured.rel_rms_error) == pytest.approx(
        whole(transform_ops.native_dequantised(weight, scale, transform, torch.float32), want), rel=REL, nan_ok=True
    )
