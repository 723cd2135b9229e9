"""Reading compressed-tensors weights back as vLLM 0.33.0 reads them, independently of the
converter's requantisation (convert/requant.py), for tests that measure what the runtime sees."""

from __future__ import annotations

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def ct_args(preset: str, fmt: str) -> tuple[tuple[str, object], ...]:
    """A compressed-tensors preset's weights arguments as a scheme passes them, plus the format."""
    from compressed_tensors.quantization import preset_name_to_scheme

    weights = preset_name_to_scheme(preset, ["Linear"]).weights.model_dump(mode="json")
    return (*sorted(weights.items()), ("format", fmt))


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' packed e2m1 (two a byte, the even index low) as fp32 values."""
    b = packed.view(torch.uint8).long()
    return torch.stack((E2M1[b & 15], E2M1[b >> 4]), dim=-1).flatten(-2)


def read_w4a16(out: dict[str, torch.Tensor]) -> torch.Tensor:
    """As vLLM 0.33.0's WNA16 layer reads it: compressed-tensors' unpack_from_int32
    (compressed_tensors_wNa16.py:9), each int4 times its group's scale."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    codes = unpack_from_int32(out["weight_packed"], 4, torch.Size(out["weight_shape"].tolist()))
    return codes.float() * out["weight_scale"].float().repeat_interleave(128, 1)


def read_nvfp4(out: dict[str, torch.Tensor]) -> torch.Tensor:
    # CT stores the global scale as a divisor (compressed_tensors_w4a4_nvfp4.py:110-111)
    local = out["weight_scale"].float().repeat_interleave(16, 1)
    return fp4_values(out["weight_packed"]) * local / out["weight_global_scale"]


def read_mxfp4(out: dict[str, torch.Tensor]) -> torch.Tensor:
    return fp4_values(out["weight_packed"]) * torch.exp2(out["weight_scale"].float() - 127).repeat_interleave(32, 1)
