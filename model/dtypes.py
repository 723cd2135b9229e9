"""safetensors dtype names <-> torch dtypes and sizes."""

from __future__ import annotations

import ctypes
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# bytes per element of each safetensors dtype (the format's own table; torch agrees:
# tests/model/test_layout.py). Written out rather than read off torch's dtypes so that the
# converter and the planner, which need only sizes, never import torch (start-up time).
ITEMSIZE: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
}


@cache
def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    import torch  # only the code that makes or reads tensors pays for importing torch

    names = {
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
    return names, {v: k for k, v in names.items()}


def __getattr__(name: str) -> Any:
    """TORCH_DTYPES (safetensors name -> torch dtype) and SAFETENSORS_NAMES (the inverse),
    built on first use (PEP 562) so that importing this module does not import torch."""
    if name == "TORCH_DTYPES":
        return _torch_tables()[0]
    if name == "SAFETENSORS_NAMES":
        return _torch_tables()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
