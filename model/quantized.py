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

from collections.abc import Callable

import torch
from torch import nn

from dsv4.model.dtypes import TORCH_DTYPES
from dsv4.model.storage import EXPERT_CONTAINERS, ExpertStorage, ceil_div

FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu

FP32_STEP_BYTES = 64 << 20  # Bf16Linear.forward_fp32's fp32 buffer: 4096 rows of Flash's head


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


def dequant_block(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """W[n, k] = w[n, k] * S[n // bn, k // bk] for numeric weights (FP8 e4m3, integers); the scale
    grid is ceil-sized, edges cropped."""
    bn, bk = block
    rows, cols = weight.shape[-2:]
    s = scale_to_float(scale)
    s = s.repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)[..., :cols]
    return (weight.float() * s).to(out_dtype)


def dequant_packed(
    packed: torch.Tensor, scale: torch.Tensor, storage: ExpertStorage, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Codes of `storage.codebook` packed `codes_per_byte` to a byte [.., rows, cols/n] (LOW bits = even
    index) with one scale per group of inputs [.., rows, cols/group] -> [.., rows, cols] (FP4: e2m1)."""
    assert storage.codebook is not None and storage.scale_block is not None  # ExpertStorage checks both
    # bf16 has fp32's exponent range, so a code of few significant bits (e2m1: 2) times a
    # power-of-two scale is exact in it, NaN scales included: computing in bf16 gives the fp32
    # result's bits with half the memory traffic. Any other output dtype goes through fp32.
    work = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    lut = torch.tensor(storage.codebook, dtype=work, device=packed.device)
    byte = torch.arange(256, device=packed.device)
    bits = 8 // storage.codes_per_byte
    mask = (1 << bits) - 1
    # byte -> the values of its codes, even index first
    per_byte = torch.stack([lut[(byte >> (k * bits)) & mask] for k in range(storage.codes_per_byte)], dim=-1)
    # one lookup per byte, int32 indices, the scale broadcast over its group: a quarter of
    # the temporaries of a lookup per nibble with a repeated scale (experts are ~8 MB each)
    vals = nn.functional.embedding(packed.view(torch.uint8).int(), per_byte).flatten(-2)
    groups = vals.unflatten(-1, (-1, storage.scale_block[1])) * scale_to_float(scale).to(work).unsqueeze(-1)
    return groups.flatten(-2).to(out_dtype)


def dequantize(
    storage: ExpertStorage,
    weight: torch.Tensor,
    scale: torch.Tensor,
    weight_block_size: tuple[int, int],
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """An expert weight and its scale grid, stored as `storage` says, -> [.., rows, cols] in `out_dtype`."""
    if storage.codebook is not None:
        return dequant_packed(weight, scale, storage, out_dtype)
    return dequant_block(weight, scale, storage.block(weight_block_size), out_dtype)


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
    """y = x @ W.T with W stored FP8 e4m3 [out, in] and block scales `weight_scale_inv`, one per
    `block` (quantization_config's weight_block_size: 128x128 in V4, 32x32 in V4.1).

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
            return dequant_block(self.weight, self.weight_scale_inv, self.block, dtype)
        ws = self.weight.split(list(self.parts), dim=0)
        ss = self.weight_scale_inv.split([ceil_div(p, self.block[0]) for p in self.parts], dim=0)
        return torch.cat([dequant_block(w, s, self.block, dtype) for w, s in zip(ws, ss, strict=True)], dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dequantized(x.dtype).T


class Bf16Linear(QuantLayer):
    """An unquantised linear (shared_head.head). Its name still matters: a quantisation
    config's ignore list must be able to name it."""

    def __init__(self, in_features: int, out_features: int, quant_name: str) -> None:
        super().__init__(quant_name)
        self.weight = weight_param((out_features, in_features), torch.bfloat16)

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight in `dtype` (wo_a reads its weight so, whatever container holds it)."""
        return self.weight.to(dtype)

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


class RoutedExperts(nn.Module):
    """E stacked experts, vLLM's `routed_experts` (mapping/README.md#mtp-parameters), in the containers
    their storage names (FP4: packed e2m1 bytes and raw E8M0 scale bytes, both uint8; FP8: e4m3 weights and
    F32 block scales): w13 = cat(w1, w3) on the output dim, each with its own scale grid."""

    def __init__(
        self, storage: ExpertStorage, n_experts: int, hidden: int, inter: int, weight_block_size: tuple[int, int]
    ) -> None:
        super().__init__()
        E, H, I = n_experts, hidden, inter
        self.storage = storage
        self.block = weight_block_size
        self.inter = inter
        weight, scale = TORCH_DTYPES[storage.container_dtype], TORCH_DTYPES[storage.scale_container_dtype]
        self.scale_name = storage.scale_param
        s13, s2 = storage.scale_shape(I, H, weight_block_size), storage.scale_shape(H, I, weight_block_size)
        self.w13_weight = weight_param((E, *storage.weight_shape(2 * I, H)), weight)
        self.register_parameter(f"w13_{self.scale_name}", weight_param((E, 2 * s13[0], s13[1]), scale))
        self.w2_weight = weight_param((E, *storage.weight_shape(H, I)), weight)
        self.register_parameter(f"w2_{self.scale_name}", weight_param((E, *s2), scale))

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) of expert e, dequantised."""
        w13, s13 = self.w13_weight[e], getattr(self, f"w13_{self.scale_name}")[e]
        w2, s2 = self.w2_weight[e], getattr(self, f"w2_{self.scale_name}")[e]
        if self.inter % self.storage.block(self.block)[0] == 0:  # w3's grid starts where w1's ends: one grid
            w13 = dequantize(self.storage, w13, s13, self.block, dtype)
        else:  # w1 and w3 were concatenated with their own (ragged) scale grids: dequantise them apart
            half = s13.shape[0] // 2
            parts = zip(w13.split(self.inter, dim=0), s13.split(half, dim=0), strict=True)
            w13 = torch.cat([dequantize(self.storage, w, s, self.block, dtype) for w, s in parts], dim=0)
        return w13, dequantize(self.storage, w2, s2, self.block, dtype)


ExpertDecoder = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # e -> (w13 [2I, H], w2 [H, I]) in bf16


class DecodedExperts(nn.Module):
    """Routed experts left as a draft holds them (bf16, or a form the model has no container for) and
    decoded one at a time, when a token routes to one: `decode(e)` gives expert e's (w13, w2), moved to
    `device`. It has no parameters: the tensors it decodes are the loader's (the draft's mapped shards),
    so a forward makes only the routed experts' pages resident, as the quantised containers do."""

    def __init__(self, decode: ExpertDecoder, device: torch.device) -> None:
        super().__init__()
        self.decode = decode
        self.device = device

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = self.decode(e)
        return w13.to(self.device, dtype), w2.to(self.device, dtype)


def holding(module: nn.Module, container: str) -> nn.Module | None:
    """`module` (an Fp8Linear or RoutedExperts of the model as built, on the meta device) rebuilt to keep
    its weights as `container` (model/storage.py HeldLinear.container), its name and dims unchanged; None
    when this model has no such container for it (the caller decodes those weights instead: a linear to
    bf16 when loading, experts one at a time, DecodedExperts)."""
    if isinstance(module, Fp8Linear):
        rows, cols = module.weight.shape
        if container == "bf16":
            return Bf16Linear(cols, rows, module.quant_name)
        scale = {"fp8-e8m0": E8M0, "fp8-f32": torch.float32}.get(container)
        return None if scale is None else Fp8Linear(cols, module.parts, scale, module.quant_name, module.block)
    assert isinstance(module, RoutedExperts)
    E, H, I = module.w13_weight.shape[0], module.w2_weight.shape[1], module.inter
    storage = EXPERT_CONTAINERS.get(container)
    return None if storage is None else RoutedExperts(storage, E, H, I, module.block)
