"""Quantised weight containers of the bundled model and their dequantisation (mapping/README.md#storage-dtypes).

Every linear-like module derives from `QuantLayer` and carries the quantisation layer name
vLLM gives it (mapping/README.md#quantisation-layer-names). The seed bug was a linear built without one: its name was ""
and compressed-tensors could not match it. So the name is a required constructor argument
and an empty one is refused at construction.

Weights stay quantised in memory (on the CPU, as views of the mapped shards: loader.py);
each forward dequantises what it needs into a temporary bf16 matrix. So a real-size draft
costs no more than its on-disk size, only the pages a forward touches become resident, and
of the routed experts only those some token routes to are ever dequantised.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.model.native import FP4_GROUP, ceil_div

FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu

FP32_STEP_BYTES = 64 << 20  # Bf16Linear.forward_fp32's fp32 buffer: 4096 rows of Flash's head

# e2m1 code -> value; bit 3 is the sign (mapping/README.md#storage-dtypes)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def weight_param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    # Weights are loaded, never trained; integer and fp8 parameters cannot require grad anyway.
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (as float8_e8m0fnu or raw uint8) or F32 scale values -> float32 multipliers.

    Raw bytes are reinterpreted, never converted numerically: byte e means 2^(e-127) and
    byte 255 is NaN, exactly as torch's float8_e8m0fnu decodes it.
    """
    if scale.dtype == torch.uint8:
        scale = scale.view(E8M0)
    return scale.float()


def dequant_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """W[n, k] = w[n, k] * S[n // bn, k // bk]; the scale grid is ceil-sized, edges cropped."""
    bn, bk = block
    rows, cols = weight.shape[-2:]
    s = scale_to_float(scale)
    s = s.repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)[..., :cols]
    return (weight.float() * s).to(out_dtype)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Packed e2m1 [.., rows, cols/2] (LOW nibble = even index) with one E8M0 scale per 32
    inputs [.., rows, cols/32] -> [.., rows, cols]."""
    # bf16 has fp32's exponent range, so an e2m1 value (2 significant bits) times an E8M0
    # power of two is exact in it, NaN scales included: computing in bf16 gives the fp32
    # result's bits with half the memory traffic. Any other output dtype goes through fp32.
    work = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    lut = torch.tensor(_FP4_VALUES, dtype=work, device=packed.device)
    byte = torch.arange(256, device=packed.device)
    pairs = torch.stack((lut[byte & 0xF], lut[byte >> 4]), dim=-1)  # byte -> (even, odd) value
    # one lookup per byte, int32 indices, the scale broadcast over its group: a quarter of
    # the temporaries of a lookup per nibble with a repeated scale (experts are ~8 MB each)
    vals = nn.functional.embedding(packed.view(torch.uint8).int(), pairs).flatten(-2)
    groups = vals.unflatten(-1, (-1, FP4_GROUP)) * scale_to_float(scale).to(work).unsqueeze(-1)
    return groups.flatten(-2).to(out_dtype)


class QuantLayer(nn.Module):
    """A linear-like module with its quantisation layer name (vLLM's `prefix`)."""

    def __init__(self, quant_name: str) -> None:
        super().__init__()
        if not quant_name:
            raise ValueError(f"{type(self).__name__} built without a quantisation layer name (prefix)")
        self.quant_name = quant_name

    def extra_repr(self) -> str:
        return f"quant_name={self.quant_name!r}"


class Fp8Linear(QuantLayer):
    """y = x @ W.T with W stored FP8 e4m3 [out, in] and 128x128 block scales `weight_scale_inv`.

    `parts` lists the row counts of tensors concatenated on dim 0 (fused_wqa_wkv, gate_up_proj):
    each part's scale grid starts on its own block boundary, so the scale rows are the sum of
    the parts' ceil-divided rows and the dequantisation goes part by part.
    """

    def __init__(
        self,
        in_features: int,
        parts: tuple[int, ...],
        scale_dtype: torch.dtype,
        quant_name: str,
        block: tuple[int, int] = (128, 128),
    ) -> None:
        super().__init__(quant_name)
        self.parts = parts
        self.block = block
        out = sum(parts)
        self.weight = weight_param((out, in_features), FP8)
        scale_rows = sum(ceil_div(p, block[0]) for p in parts)
        self.weight_scale_inv = weight_param((scale_rows, ceil_div(in_features, block[1])), scale_dtype)

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if len(self.parts) == 1:
            return dequant_fp8_block(self.weight, self.weight_scale_inv, self.block, dtype)
        ws = self.weight.split(list(self.parts), dim=0)
        ss = self.weight_scale_inv.split([ceil_div(p, self.block[0]) for p in self.parts], dim=0)
        return torch.cat([dequant_fp8_block(w, s, self.block, dtype) for w, s in zip(ws, ss, strict=True)], dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dequantized(x.dtype).T


class Bf16Linear(QuantLayer):
    """An unquantised linear (shared_head.head). Its name still matters: a quantisation
    config's ignore list must be able to name it."""

    def __init__(self, in_features: int, out_features: int, quant_name: str) -> None:
        super().__init__(quant_name)
        self.weight = weight_param((out_features, in_features), torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] @ W.T with fp32 products and sums, fp32 out (the logits), and no fp32
        copy of W (2 GB for Flash's head). torch 2.13 has no bf16 x bf16 -> fp32 GEMM on the
        CPU (aten::mm.dtype is CUDA-only) and a bf16 GEMM rounds its output to bf16, which
        turns near-ties of the top logits into ties. So W is upcast FP32_STEP_BYTES at a
        time into one reused buffer (bf16 -> fp32 is exact: the result is that of the whole
        fp32 product); few large steps, because each GEMM call has a fixed cost."""
        rows, cols = self.weight.shape
        step = max(1, FP32_STEP_BYTES // (4 * cols))
        xf = x.float()
        out = torch.empty(x.shape[0], rows, dtype=torch.float32, device=x.device)
        buf = torch.empty(min(step, rows), cols, dtype=torch.float32, device=x.device)
        for r in range(0, rows, step):
            w = buf[: min(step, rows - r)]
            w.copy_(self.weight[r : r + step])
            torch.mm(xf, w.T, out=out[:, r : r + step])
        return out


class Embedding(QuantLayer):
    def __init__(self, vocab: int, hidden: int, quant_name: str) -> None:
        super().__init__(quant_name)
        self.weight = weight_param((vocab, hidden), torch.bfloat16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class Fp4RoutedExperts(nn.Module):
    """E stacked FP4 experts, vLLM's `routed_experts` (mapping/README.md#mtp-parameters): packed e2m1 bytes and
    raw E8M0 scale bytes, both uint8. w13 = cat(w1, w3) on the output dim."""

    def __init__(self, n_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        E, H, I = n_experts, hidden, inter
        self.w13_weight = weight_param((E, 2 * I, H // 2), torch.uint8)
        self.w13_weight_scale = weight_param((E, 2 * I, H // FP4_GROUP), torch.uint8)
        self.w2_weight = weight_param((E, H, I // 2), torch.uint8)
        self.w2_weight_scale = weight_param((E, H, I // FP4_GROUP), torch.uint8)

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) of expert e, dequantised."""
        w13 = dequant_fp4(self.w13_weight[e], self.w13_weight_scale[e], dtype)
        w2 = dequant_fp4(self.w2_weight[e], self.w2_weight_scale[e], dtype)
        return w13, w2


class Fp8RoutedExperts(nn.Module):
    """E stacked FP8 experts of a Base checkpoint: e4m3 weights, F32 128x128 block scales."""

    def __init__(self, n_experts: int, hidden: int, inter: int, block: tuple[int, int]) -> None:
        super().__init__()
        E, H, I = n_experts, hidden, inter
        bn, bk = block
        self.block = block
        self.inter = inter
        self.w13_weight = weight_param((E, 2 * I, H), FP8)
        self.w13_weight_scale_inv = weight_param((E, 2 * ceil_div(I, bn), ceil_div(H, bk)), torch.float32)
        self.w2_weight = weight_param((E, H, I), FP8)
        self.w2_weight_scale_inv = weight_param((E, ceil_div(H, bn), ceil_div(I, bk)), torch.float32)

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # w1 and w3 were concatenated with their own scale grids: dequantise them apart.
        half = ceil_div(self.inter, self.block[0])
        w1, w3 = self.w13_weight[e].split(self.inter, dim=0)
        s1, s3 = self.w13_weight_scale_inv[e].split(half, dim=0)
        w13 = torch.cat(
            (dequant_fp8_block(w1, s1, self.block, dtype), dequant_fp8_block(w3, s3, self.block, dtype)), dim=0
        )
        w2 = dequant_fp8_block(self.w2_weight[e], self.w2_weight_scale_inv[e], self.block, dtype)
        return w13, w2
