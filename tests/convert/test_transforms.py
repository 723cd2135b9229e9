"""The transforms a served draft's computed tensors are made by (convert/transforms.py), on
hand-made native tensors: the exact ones give the native weight back bit for bit when read
as the runtime's scheme reads them, and refuse (naming the tensor and block) where they
cannot; the lossy ones measure their error honestly."""

from __future__ import annotations

import pytest
import torch
from ct_read import ct_args, read_mxfp4, read_nvfp4, read_w4a16

from dsv4.convert.errors import PlanError
from dsv4.convert.exit_codes import code_of
from dsv4.convert.planned import PlannedTensor, Transform
from dsv4.convert.transforms import compute
from dsv4.model.reference import fp4_weight, fp8_weight

BLOCK = (128, 128)


def native(name: str, t: torch.Tensor, dtype: str) -> PlannedTensor:
    return PlannedTensor(name, dtype, tuple(t.shape), (), "copy", "test")


def pack(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [N, K] (0..15) as DeepSeek stores them: two a byte, the even index low."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)


def fp4_expert(n: int, k: int, exponents: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed FP4 weight [N, K/2] of random nonzero codes, its E8M0 scales the given
    unbiased exponents [N, K/32]."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(1, 16, (n, k), generator=gen, dtype=torch.uint8)
    codes[codes == 8] = 9  # -0 is a zero code: every group here holds nonzero codes
    return pack(codes), (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def run(name: str, tensors: list[torch.Tensor], dtypes: list[str], *, exact: bool = True, args=()):  # noqa: ANN001, ANN201
    inputs = tuple(native(f"mtp.0.w.in{i}", t, d) for i, (t, d) in enumerate(zip(tensors, dtypes, strict=True)))
    return compute(Transform(name, args, inputs, exact, BLOCK), tensors, "mtp.0.w.out")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """fp32 tensors equal bit for bit (a -0 is not a 0, a NaN is equal to the same NaN)."""
    return torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


def read_fp8_block(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """As vLLM's FP8-block layer reads a weight: e4m3 value times its 128x128 block's F32 scale."""
    s = scale.repeat_interleave(128, 0)[: weight.shape[0]].repeat_interleave(128, 1)[:, : weight.shape[1]]
    return weight.float() * s


@pytest.mark.parametrize("n,k", [(256, 256), (192, 96)])  # whole blocks, and ragged ones on both edges
def test_fp4_to_fp8_block_is_bit_exact_where_each_block_spans_at_most_14_binades(n: int, k: int) -> None:
    exps = torch.randint(-20, -6, (n, k // 32), generator=torch.Generator().manual_seed(1))
    exps[:128, :4] = -10
    exps[0, 0], exps[5, 2] = -1, -15  # block (0, 0) spans exactly 14: its extremes must both survive
    packed, scale = fp4_expert(n, k, exps)
    # the smallest codes (+-0.5) in the group 14 binades down: e4m3's least subnormals
    packed.view(torch.uint8)[5, 32:48] = 0x91
    out = run("fp4_to_fp8_block.weight", [packed, scale], ["I8", "F8_E8M0"])
    weight, block_scale = out.tensors["weight"], out.tensors["weight_scale"]
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == (n, k)
    assert block_scale.dtype == torch.float32 and block_scale.shape == (-(-n // 128), -(-k // 128))
    assert same_bits(read_fp8_block(weight, block_scale), fp4_weight(packed, scale))
    assert block_scale[0, 0] == 2.0 ** (-1 - 6)  # b = s_max - 6
    assert out.measured is not None and out.measured.max_abs_error == 0.0


def test_groups_of_zero_codes_do_not_widen_a_block() -> None:
    exps = torch.full((128, 4), -8)
    exps[3, 1] = -60  # 52 binades below the rest, but every code of the group is 0 or -0
    packed, scale = fp4_expert(128, 128, exps)
    packed.view(torch.uint8)[3, 16:32] = torch.tensor([0x00, 0x08, 0x80, 0x88] * 4, dtype=torch.uint8)
    out = run("fp4_to_fp8_block.weight", [packed, scale], ["I8", "F8_E8M0"])
    assert same_bits(read_fp8_block(out.tensors["weight"], out.tensors["weight_scale"]), fp4_weight(packed, scale))


def test_a_block_spanning_15_binades_is_refused_naming_the_tensor_and_block() -> None:
    exps = torch.full((256, 8), -8)
    exps[130, 5] = -23  # block (row 1, column 1): 15 binades
    packed, scale = fp4_expert(256, 256, exps)
    with pytest.raises(PlanError) as caught:
        run("fp4_to_fp8_block.weight", [packed, scale], ["I8", "F8_E8M0"])
    message = str(caught.value)
    assert message.startswith("mtp.0.w.out: 128x128 block (row 1, column 1) of mtp.0.w.in0:")
    assert "span 15 binades" in message and "\n" not in message
    assert caught.value.kind == "inexact_transform" and code_of("inexact_transform") == 37


def test_a_nan_scale_is_refused_even_over_zero_codes() -> None:
    packed, scale = fp4_expert(128, 128, torch.full((128, 4), -8))
    packed.view(torch.uint8)[7, 0:16] = 0
    scale.view(torch.uint8)[7, 0] = 255  # NaN: the native group decodes to NaN, which no block scale says
    with pytest.raises(PlanError, match=r"block \(row 0, column 0\).*NaN"):
        run("fp4_to_fp8_block.weight", [packed, scale], ["I8", "F8_E8M0"])


def test_e8m0_scales_decode_to_their_powers_of_two() -> None:
    raw = torch.tensor([[0, 1, 127], [128, 200, 254]], dtype=torch.uint8)
    out = run("e8m0_to_f32", [raw.view(torch.float8_e8m0fnu)], ["F8_E8M0"]).tensors[""]
    assert out.dtype == torch.float32
    assert out.tolist() == [[2.0**-127, 2.0**-126, 1.0], [2.0, 2.0**73, 2.0**127]]


def test_dequant_bf16_gives_the_native_weight_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(256, 384, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.randint(100, 120, (2, 3), generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    out = run("dequant_bf16", [weight, scale], ["F8_E4M3", "F8_E8M0"]).tensors[""]
    assert out.dtype == torch.bfloat16 and same_bits(out, fp8_weight(weight, scale, BLOCK))
    packed, fp4_scale = fp4_expert(128, 256, torch.randint(-10, -5, (128, 8), generator=gen))
    out = run("dequant_bf16", [packed, fp4_scale], ["I8", "F8_E8M0"]).tensors[""]
    assert same_bits(out, fp4_weight(packed, fp4_scale))


def test_an_exact_transform_that_is_not_is_refused() -> None:
    # F32 block scales that are no powers of two: e4m3 x scale needs more bits than bf16 has
    weight = torch.full((128, 128), 1.125).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0 + 2.0**-10]])
    with pytest.raises(PlanError, match=r"^mtp.0.w.out: dequant_bf16 of mtp.0.w.in0 differs .* exact") as caught:
        run("dequant_bf16", [weight, scale], ["F8_E4M3", "F32"])
    assert caught.value.kind == "inexact_transform"
    lossy = run("dequant_bf16", [weight, scale], ["F8_E4M3", "F32"], exact=False).measured
    assert lossy is not None and 0 < lossy.max_abs_error < 2.0**-7


@pytest.mark.parametrize(
    "preset,fmt,read,specs",
    [
        (
            "W4A16",
            "pack-quantized",
            read_w4a16,
            {
                "weight_packed": (torch.int32, (256, 32)),
                "weight_scale": (torch.bfloat16, (256, 2)),
                "weight_shape": (torch.int64, (2,)),
            },
        ),
        (
            "NVFP4A16",
            "nvfp4-pack-quantized",
            read_nvfp4,
            {
                "weight_packed": (torch.uint8, (256, 128)),
                "weight_scale": (torch.float8_e4m3fn, (256, 16)),
                "weight_global_scale": (torch.float32, (1,)),
            },
        ),
        (
            "MXFP4A16",
            "mxfp4-pack-quantized",
            read_mxfp4,
            {"weight_packed": (torch.uint8, (256, 128)), "weight_scale": (torch.uint8, (256, 8))},
        ),
    ],
)
def test_requant_writes_the_schemes_tensors_and_measures_the_error_the_runtime_will_see(
    preset: str,
    fmt: str,
    read,
    specs: dict,  # noqa: ANN001
) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(256, 256, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.full((2, 2), 115, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    out = run(
        f"requant.{next(iter(specs))}", [weight, scale], ["F8_E4M3", "F8_E8M0"], exact=False, args=ct_args(preset, fmt)
    )
    assert {k: (v.dtype, tuple(v.shape)) for k, v in out.tensors.items()} == specs
    want = fp8_weight(weight, scale, BLOCK)
    error = (read(out.tensors) - want).abs()
    assert out.measured is not None
    assert out.measured.max_abs_error == pytest.approx(error.max().item(), rel=0.02)
    rel_rms = (error.pow(2).mean() / want.pow(2).mean()).sqrt().item()
    assert out.measured.rel_rms_error == pytest.approx(rel_rms, rel=0.02)
    assert 0.01 < rel_rms < 0.2  # 4-bit round-to-nearest of a gaussian weight


def test_nvfp4_gives_a_fused_pair_one_global_scale_from_both_weights() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(128, 256, generator=gen) * 50).to(torch.float8_e4m3fn)
    partner = (torch.randn(128, 256, generator=gen) * 50).to(torch.float8_e4m3fn)
    partner[3, 7] = 448.0  # the pair's amax lies in the partner
    scale = torch.full((1, 2), 120, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    args = ct_args("NVFP4A16", "nvfp4-pack-quantized")
    dtypes = ["F8_E4M3", "F8_E8M0", "F8_E4M3", "F8_E8M0"]
    alone = run("requant.weight_global_scale", [weight, scale], dtypes[:2], exact=False, args=args)
    paired = run("requant.weight_global_scale", [weight, scale, partner, scale], dtypes, exact=False, args=args)
    amax = 448.0 * 2.0 ** (120 - 127)
    assert paired.tensors["weight_global_scale"].item() == pytest.approx(448 * 6 / amax)
    assert alone.tensors["weight_global_scale"].item() > paired.tensors["weight_global_scale"].item()


def test_mxfp4_requant_of_native_fp4_experts_is_lossless() -> None:
    # the native FP4 experts are MXFP4 values already (e2m1 x a power of two per 32 inputs)
    packed, scale = fp4_expert(128, 256, torch.randint(-10, -5, (128, 8), generator=torch.Generator().manual_seed(5)))
    out = run(
        "requant.weight_packed",
        [packed, scale],
        ["I8", "F8_E8M0"],
        exact=False,
        args=ct_args("MXFP4A16", "mxfp4-pack-quantized"),
    )
    assert torch.equal(read_mxfp4(out.tensors), fp4_weight(packed, scale))
    assert out.measured is not None and out.measured.exact
