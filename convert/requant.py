"""A native weight requantised into a target's compressed-tensors scheme ("requant.<leaf>",
lossy): round-to-nearest with compressed-tensors' own primitives and compressors, so the
tensors are what the library (and vLLM, which reads them with it) makes and reads.

The weight is dequantised first (exactly, in bf16: the dtype vLLM builds the draft in, so a
pack-quantized scale comes out bf16 as its WNA16 layer's weight_scale is,
compressed_tensors_wNa16.py:190-196); then per group `calculate_qparams` on the group's min and max
(quantization/utils/helpers.py:52), for NVFP4 with the global scale `generate_gparam` gives
the amax of the fused layer's weights together (helpers.py:324: vLLM takes one global scale
per fused linear, the max of its shards', compressed_tensors_w4a4_nvfp4.py:99-111, and the
experts' w1's for w1 and w3 both, compressed_tensors_moe_w4a4_nvfp4.py:223-231), and the
format's compressor packs (compressors/base.py:38-97). The compressor's own `decompress`
rebuilds the weight, which is measured against the native one.
"""

from __future__ import annotations

import torch

from dsv4.convert.computed import Computed
from dsv4.convert.errors import PlanError
from dsv4.convert.planned import Transform
from dsv4.convert.schemes.base import INSTALL_HINT
from dsv4.convert.transform_ops import measure, native_dequantised

TENSOR_GROUP = "tensor_group"  # NVFP4's strategy: local scales per group under one global scale


def _library(where: str) -> None:
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise PlanError(
            f"{where}: requantising into a compressed-tensors scheme needs the compressed-tensors library: "
            f"{INSTALL_HINT}",
            kind="quant_carry",
            tensor=where,
        ) from None


def requantise(tensors: list[torch.Tensor], transform: Transform, where: str) -> Computed:
    """Inputs: the weight and its scale, then any fused partners' (their weights share the
    NVFP4 global scale); every leaf of the format's compressed module."""
    _library(where)
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = dict(transform.args)
    fmt = args.pop("format")
    weights = QuantizationArgs.model_validate(args)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    native = [
        native_dequantised(w, s, transform, torch.bfloat16) for w, s in zip(tensors[::2], tensors[1::2], strict=True)
    ]
    weight = native[0]
    state: dict[str, torch.Tensor] = {"weight": weight}
    global_scale = None
    if weights.strategy == TENSOR_GROUP:
        amax = torch.stack([w.float().abs().amax() for w in native]).amax()
        global_scale = state["weight_global_scale"] = generate_gparam(-amax, amax)
    groups = weight.unflatten(-1, (-1, weights.group_size))
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), weights, global_scale=global_scale)
    state["weight_scale"], state["weight_zero_point"] = scale, zero_point
    compressor = BaseCompressor.get_value_from_registry(fmt)
    packed = compressor.compress(state, scheme)
    rebuilt = compressor.decompress(dict(packed), scheme)["weight"]
    return Computed(dict(packed), measure(weight, rebuilt))
