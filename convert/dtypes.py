"""safetensors dtype names <-> torch dtypes and sizes."""

from __future__ import annotations

import ctypes

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
SAFETENSORS_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
ITEMSIZE: dict[str, int] = {k: v.itemsize for k, v in TORCH_DTYPES.items()}


def nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor, whatever its dtype, without a copy on the CPU.

    An E8M0 or FP8 tensor must never pass through a numeric conversion on its way to disk.
    torch tensors do not implement the buffer protocol and numpy is not a dependency, so
    the bytes are viewed through ctypes; the view keeps the tensor alive.
    """
    t = t.detach().contiguous().cpu()
    raw = (ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr())
    raw.tensor = t  # type: ignore[attr-defined]  # lifetime: the memory belongs to t
    return memoryview(raw).cast("B")
