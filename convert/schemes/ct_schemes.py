"""The tensors a draft module holds under each compressed-tensors scheme vLLM 0.33.0 builds, made
from the native draft's tensors (the transform names of convert/transforms.py).

Parameters per scheme (read in vLLM's create_weights):
* FP8 block (CompressedTensorsW8A8Fp8, schemes/compressed_tensors_w8a8_fp8.py:87-135; MoE
  compressed_tensors_moe_w8a8_fp8.py:142-251): `weight` e4m3 [N,K], `weight_scale` f32
  [ceil(N/128), ceil(K/128)]: DeepSeek's FP8 bytes with their E8M0 scale widened (exact);
  FP4 experts re-blocked into FP8 (exact where each block's exponents fit, checked when run).
* MXFP4 (CompressedTensorsW4A4Mxfp4, schemes/compressed_tensors_w4a4_mxfp4.py:49-88; MoE
  compressed_tensors_moe_w4a4_mxfp4.py:96-149): `weight_packed` u8 [N,K/2], `weight_scale` u8
  [N,K/32]: DeepSeek's FP4 experts byte for byte (same e2m1 nibble order and e8m0 byte,
  compressed_tensors/compressors/nvfp4/helpers.py:367-415, mx_utils.py:18-30).
* WNA16 (schemes/compressed_tensors_wNa16.py:161-243): `weight_packed` i32 [N, K*b/32],
  `weight_scale` bf16 [N, K/g], `weight_shape` i64 [2].
* NVFP4A16 (schemes/compressed_tensors_w4a4_nvfp4.py:38-91): `weight_packed` u8 [N,K/2],
  `weight_scale` e4m3 [N,K/16], `weight_global_scale` f32 [1], one per fused pair (vLLM keeps the
  max of a pair, :98-106, so the pair's parts are each other's inputs). Its MoE method
  (compressed_tensors_moe/compressed_tensors_moe_w4a4_nvfp4.py:167-185) registers
  `w13_input_global_scale` / `w2_input_global_scale` in A16 mode too, which no A16 kernel reads:
  an expert's `input_global_scale` is written 1.0 (`unit_scale`) so every parameter is filled.
Everything that is not an FP8 block or an MXFP4 byte copy is a round-to-nearest requantisation:
lossy, written only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from math import ceil

from dsv4.convert.schemes.base import PACKED_FP4, Output, Scheme, part_tensors
from dsv4.convert.schemes.ct_config import FP8_BLOCK, MXFP4, MXFP4A16, NVFP4, NVFP4A16, WNA16, Group
from dsv4.model.native import Layout

BLOCK = 128  # DeepSeek's FP8 block, the FP8_BLOCK group's block_structure


def _weight_and_scale(part: str, native: Layout) -> tuple[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]]:
    held = part_tensors(part, native)
    return held[f"{part}.weight"], held[f"{part}.scale"]


def _logical(part: str, native: Layout) -> tuple[int, int]:
    (dtype, (n, k)), _ = _weight_and_scale(part, native)
    return n, k * 2 if dtype == PACKED_FP4 else k


def _others(part: str, native: Layout) -> list[Output]:
    """A part's tensors besides its weight and scale (a bias), as they are."""
    return [
        Output(name, dtype, shape, "copy", (name,))
        for name, (dtype, shape) in part_tensors(part, native).items()
        if name.rsplit(".", 1)[1] not in ("weight", "scale")
    ]


def _fp8_block(part: str, native: Layout) -> list[Output]:
    (dtype, _), (scale_dtype, _) = _weight_and_scale(part, native)
    n, k = _logical(part, native)
    w, s = f"{part}.weight", f"{part}.scale"
    grid = (ceil(n / BLOCK), ceil(k / BLOCK))
    if dtype == PACKED_FP4:
        outs = [
            Output(w, "F8_E4M3", (n, k), "fp4_to_fp8_block.weight", (w, s)),
            Output(f"{part}.weight_scale", "F32", grid, "fp4_to_fp8_block.weight_scale", (w, s)),
        ]
    else:
        widen = "e8m0_to_f32" if scale_dtype == "F8_E8M0" else "copy"  # Base stores F32 scales
        outs = [Output(w, dtype, (n, k), "copy", (w,)), Output(f"{part}.weight_scale", "F32", grid, widen, (s,))]
    return outs + _others(part, native)


def _mxfp4_copy(part: str, native: Layout) -> list[Output]:
    n, k = _logical(part, native)
    w, s = f"{part}.weight", f"{part}.scale"
    return [
        Output(f"{part}.weight_packed", "U8", (n, k // 2), "copy", (w,)),
        Output(f"{part}.weight_scale", "U8", (n, k // 32), "copy", (s,)),
    ] + _others(part, native)


def _requant(
    group: Group, pair: Callable[[str], tuple[str, ...]], experts: bool
) -> Callable[[str, Layout], list[Output]]:
    """Round-to-nearest into `group`'s scheme; `pair(part)` the parts sharing a global scale;
    `experts`: the parts are routed experts'."""
    args = group.args()

    def outputs(part: str, native: Layout) -> list[Output]:
        n, k = _logical(part, native)
        inputs = tuple(
            f"{p}.{leaf}" for p in (part, *(q for q in pair(part) if q != part)) for leaf in ("weight", "scale")
        )
        if group.scheme == WNA16:
            bits, g = group.weights["num_bits"], group.weights.get("group_size") or k
            leaves = [("weight_packed", "I32", (n, k * bits // 32)), ("weight_scale", "BF16", (n, k // g))]
            leaves.append(("weight_shape", "I64", (2,)))
        elif group.scheme in (NVFP4A16, NVFP4):
            leaves = [("weight_packed", "U8", (n, k // 2)), ("weight_scale", "F8_E4M3", (n, k // 16))]
            leaves.append(("weight_global_scale", "F32", (1,)))
        else:
            leaves = [("weight_packed", "U8", (n, k // 2)), ("weight_scale", "U8", (n, k // 32))]
        made = [
            Output(f"{part}.{leaf}", dtype, shape, f"requant.{leaf}", inputs, exact=False, args=args)
            for leaf, dtype, shape in leaves
        ]
        if experts and group.scheme == NVFP4A16:
            # vLLM 0.33.0's NVFP4 MoE method registers w13/w2_input_global_scale in A16 mode too
            # (compressed_tensors_moe_w4a4_nvfp4.py:167-185) but picks its kernel for unquantised
            # activations (:66), which only Marlin, Humming and a B12X asked for by name take
            # (fused_moe/experts/*.py _supports_quant_scheme); Marlin and Humming drop the scale
            # (fused_moe/oracle/nvfp4.py:452, :461, its W4A16 quant config :554-564), B12X in
            # w4a16 mode takes unit ones (fused_moe/b12x.py:353-360). So its value is never read: 1.0,
            # which also keeps the 1/x vLLM takes of it on loading (:249) finite.
            made.append(Output(f"{part}.input_global_scale", "F32", (1,), "unit_scale", (f"{part}.scale",)))
        return made + _others(part, native)

    return outputs


CT_FP8_BLOCK = Scheme("ct-fp8-block", _fp8_block)
CT_MXFP4 = Scheme("ct-mxfp4", _mxfp4_copy)


def scheme_for(
    group: Group, storage: str, pair: Callable[[str], tuple[str, ...]], *, experts: bool
) -> tuple[Scheme, str | None]:
    """(the scheme a module stored as `storage` (its weight dtype) takes in `group`, the
    parameter that needs calibration or None); `experts`: the module is routed experts. FP8
    block is exact from either storage; MXFP4 is a byte copy of FP4; the rest is requantised."""
    if group.scheme == FP8_BLOCK:
        return CT_FP8_BLOCK, ("input_scale" if group.static_input else None)
    if group.scheme in (MXFP4, MXFP4A16) and storage == PACKED_FP4:
        return CT_MXFP4, None
    calibrate = "input_global_scale" if group.scheme == NVFP4 else None
    return Scheme(f"requant-{group.scheme.lower()}", _requant(group, pair, experts)), calibrate


def is_lossy(scheme: Scheme) -> bool:
    return scheme.name.startswith("requant-")
