"""The transforms a served draft's tensors are made by (convert/schemes/ names them in each
`Output`; convert/routes.py plans them; convert/execute.py runs them).

An entry says what a transform takes and makes, from the (dtype, shape) of its inputs and
its args alone, so a plan is checked before any byte is read; and how it computes its
tensors, on the CPU with torch (imported only when a tensor is computed: a plan, a dry run
and a conversion without computed tensors never import it). A transform named
"family.leaf" is one output of a computation that makes several tensors of the same inputs
(a weight and its scale): the computation runs once and gives every leaf.

- "copy": the single input's bytes, its dtype label changed at equal itemsize; planned as
  those bytes, never computed.
- "e8m0_to_f32": an E8M0 scale grid -> F32, same shape (exact: every E8M0 value is a power of
  two or NaN, as F32 holds them).
- "dequant_bf16": a native weight (FP8 e4m3 [N,K] with the source's block scales, or packed
  FP4 [N,K/2] with E8M0 scales per 32) -> BF16 [N,K].
- "fp4_to_fp8_block.weight" / ".weight_scale": packed FP4 + E8M0 per 32 -> FP8 e4m3 [N,K] and
  F32 scales per 128x128 block (convert/transform_ops.py: the exactness rule, checked per block).
- "requant.<leaf>": a native weight requantised into a compressed-tensors scheme
  (convert/requant.py; args: the scheme's weights QuantizationArgs as pairs plus ("format", f)).
  Inputs: the weight and its scale, then for a fused pair (NVFP4's one global scale per
  fused layer) the partner's weight and scale.
- "unit_scale": a tensor-wide F32 [1] scale of 1.0, for a parameter a scheme registers but
  never reads (convert/schemes/ct_schemes.py says which); its one input (the part's native
  scale, its smallest tensor) only anchors it in the plan. Exact by definition: a constant,
  no weight is rebuilt.

Every computation of a weight measures its error against the native dequantised weight: the
max absolute difference and the RMS difference relative to the weight's RMS.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsv4.convert.computed import CT_FP8_BLOCK, FP4_GROUP, Computed
from dsv4.convert.errors import PlanError
from dsv4.model.dtypes import ITEMSIZE
from dsv4.model.storage import DENSE_LINEAR, FP4, FP8, ceil_div

if TYPE_CHECKING:
    import torch

    from dsv4.convert.planned import Transform

Spec = tuple[str, tuple[int, ...]]  # (safetensors dtype, shape)
Args = dict[str, Any]
SCALES = (FP4.linear_scale_dtype, FP8.linear_scale_dtype)  # a native weight's scale: E8M0 bytes, or F32 (Base)


class TransformInputError(ValueError):
    """The inputs are not what the transform takes (a scheme's bug or a layout this entry
    does not know): the reason, for the plan's refusal."""


@dataclass(frozen=True)
class Entry:
    """`makes(inputs, args, source_block)`: the (dtype, shape) of each leaf; `compute(tensors,
    transform, where)`: the tensors (None for "copy", which is planned as bytes)."""

    makes: Callable[[Sequence[Spec], Args, tuple[int, int]], dict[str, Spec]]
    compute: Callable[[list[torch.Tensor], Transform, str], Computed] | None


def native_weight(weight: Spec, scale: Spec, source_block: tuple[int, int]) -> tuple[int, int]:
    """The logical [N, K] of a native weight and its scale: FP8 e4m3 with one scale per
    source block, or packed FP4 (two codes a byte) with one E8M0 scale per 32 inputs."""
    (wd, ws), (sd, ss) = weight, scale
    if len(ws) != 2 or sd not in SCALES:
        raise TransformInputError(f"takes a 2-D native weight and its scale, not {wd}{list(ws)} + {sd}{list(ss)}")
    if wd == DENSE_LINEAR.weight_dtype:
        n, k = ws
        grid = (ceil_div(n, source_block[0]), ceil_div(k, source_block[1]))
    elif wd == FP4.weight_dtype and sd == FP4.scale_dtype:
        n, k = ws[0], ws[1] * FP4.codes_per_byte
        grid = (n, ceil_div(k, FP4_GROUP))
    else:
        raise TransformInputError(f"takes an FP8 e4m3 or packed FP4 (I8) weight, not {wd}")
    if tuple(ss) != grid:
        raise TransformInputError(f"a {wd}{list(ws)} weight has scales {list(grid)}, not {list(ss)}")
    return n, k


def _copy_makes(inputs: Sequence[Spec], args: Args, source_block: tuple[int, int]) -> dict[str, Spec]:
    (dtype, shape), *rest = inputs
    if rest:
        raise TransformInputError("copies one tensor")
    return {"": (dtype, shape)}


def _e8m0_makes(inputs: Sequence[Spec], args: Args, source_block: tuple[int, int]) -> dict[str, Spec]:
    if len(inputs) != 1 or inputs[0][0] != FP4.scale_dtype:
        raise TransformInputError(f"takes one E8M0 scale, not {[d for d, _ in inputs]}")
    return {"": ("F32", inputs[0][1])}


def _unit_makes(inputs: Sequence[Spec], args: Args, source_block: tuple[int, int]) -> dict[str, Spec]:
    if len(inputs) != 1:
        raise TransformInputError(f"takes one tensor (its part's, to anchor it), not {len(inputs)}")
    return {"": ("F32", (1,))}


def _pair(inputs: Sequence[Spec], takes: str) -> tuple[Spec, Spec]:
    if len(inputs) != 2:
        raise TransformInputError(f"takes {takes}, not {len(inputs)} tensors")
    return inputs[0], inputs[1]


def _bf16_makes(inputs: Sequence[Spec], args: Args, source_block: tuple[int, int]) -> dict[str, Spec]:
    n, k = native_weight(*_pair(inputs, "a weight and its scale"), source_block)
    return {"": ("BF16", (n, k))}


def _fp8_block_makes(inputs: Sequence[Spec], args: Args, source_block: tuple[int, int]) -> dict[str, Spec]:
    weight, scale = _pair(inputs, "a packed FP4 weight and its E8M0 scales")
    if weight[0] != FP4.weight_dtype:
        raise TransformInputError(f"takes a packed FP4 (I8) weight, not {weight[0]}")
    n, k = native_weight(weight, scale, source_block)
    bn, bk = CT_FP8_BLOCK
    return {"weight": ("F8_E4M3", (n, k)), "weight_scale": ("F32", (ceil_div(n, bn), ceil_div(k, bk)))}


def _int_packed(n: int, k: int, args: Args) -> dict[str, Spec]:
    """compressed-tensors' pack-quantized: pack_to_int32 packs num_bits-bit codes densely into
    int32 words along K (compressors/pack_quantized/helpers.py:21), one scale per group in the
    weight's dtype (bf16: the native weight dequantised), an asymmetric zero point packed
    along N (pack_quantized/base.py:103-106)."""
    bits, group = args.get("num_bits"), args.get("group_size")
    if args.get("strategy") != "group" or type(bits) is not int or type(group) is not int or not 0 < bits <= 8:
        raise TransformInputError(f"pack-quantized takes group-strategy int weights, not {args}")
    made = {
        "weight_packed": ("I32", (n, ceil_div(k * bits, 32))),
        "weight_scale": ("BF16", (n, ceil_div(k, group))),
        "weight_shape": ("I64", (2,)),
    }
    if args.get("symmetric") is False:
        made["weight_zero_point"] = ("I32", (ceil_div(n * bits, 32), ceil_div(k, group)))
    return made


# the packed-FP4 formats and the one group size each compressor takes (can_compress:
# compressors/nvfp4/base.py:145, mxfp4/base.py:64)
FP4_GROUPS = {"nvfp4-pack-quantized": 16, "mxfp4-pack-quantized": 32}


def requant_leaves(n: int, k: int, args: Args) -> dict[str, Spec]:
    """The tensors a [N, K] weight becomes in the compressed-tensors format args["format"]:
    what its compressor's compression_param_names lists (compressors/pack_quantized/base.py:45-58,
    nvfp4/base.py:37-47, mxfp4/base.py:35-43) at the shapes vLLM 0.33.0 registers
    (compressed_tensors_wNa16.py, compressed_tensors_w4a4_nvfp4.py, compressed_tensors_w4a4_mxfp4.py)."""
    fmt = args.get("format")
    if fmt == "pack-quantized":
        return _int_packed(n, k, args)
    if fmt not in FP4_GROUPS:
        raise TransformInputError(f"requantises into pack-quantized or {' or '.join(FP4_GROUPS)}, not {fmt!r}")
    if args.get("group_size") != FP4_GROUPS[fmt]:
        raise TransformInputError(f"{fmt} takes groups of {FP4_GROUPS[fmt]}, not {args.get('group_size')!r}")
    made = {"weight_packed": ("U8", (n, k // 2)), "weight_scale": ("U8", (n, ceil_div(k, FP4_GROUPS[fmt])))}
    if fmt == "nvfp4-pack-quantized":  # e4m3 local scales under one F32 global scale
        made["weight_scale"] = ("F8_E4M3", made["weight_scale"][1])
        made["weight_global_scale"] = ("F32", (1,))
    return made


def _requant_makes(inputs: Sequence[Spec], args: Args, source_block: tuple[int, int]) -> dict[str, Spec]:
    if len(inputs) < 2 or len(inputs) % 2:
        raise TransformInputError("takes a weight and its scale, then a fused partner's weight and scale")
    n, k = native_weight(inputs[0], inputs[1], source_block)
    for w, s in zip(inputs[2::2], inputs[3::2], strict=True):
        native_weight(w, s, source_block)
    return requant_leaves(n, k, args)


def _compute(family: str) -> Callable[[list[torch.Tensor], Transform, str], Computed]:
    def run(tensors: list[torch.Tensor], transform: Transform, where: str) -> Computed:
        # torch and the ops load only once a tensor is computed
        if family == "requant":
            from dsv4.convert.requant import requantise

            return requantise(tensors, transform, where)
        from dsv4.convert import transform_ops

        return transform_ops.OPS[family](tensors, transform, where)

    return run


# the transforms whose computation rebuilds no weight (a scale decoded, a constant): nothing is
# measured (Computed.measured is None), so `compute` never refuses one as inexact
UNMEASURED = frozenset({"e8m0_to_f32", "unit_scale"})


def may_refuse(transform: Transform) -> bool:
    """Whether computing `transform` can refuse its tensor (an exact one measured inexact)."""
    return transform.exact and transform.family not in UNMEASURED


def prefetch_ops() -> None:
    """Import torch and the ops (a second or more from a cold disk) in a thread, for computations
    that run once the copies are done (convert/journal.py)."""

    def load() -> None:
        try:
            importlib.import_module("dsv4.convert.transform_ops")
        except ImportError:
            pass  # the computation's own import raises it again, where it is reported

    threading.Thread(target=load, name="prefetch-ops", daemon=True).start()


REQUANT_LEAVES = ("weight_packed", "weight_scale", "weight_shape", "weight_global_scale", "weight_zero_point")


def _entries() -> dict[str, Entry]:
    out = {
        "copy": Entry(_copy_makes, None),
        "e8m0_to_f32": Entry(_e8m0_makes, _compute("e8m0_to_f32")),
        "dequant_bf16": Entry(_bf16_makes, _compute("dequant_bf16")),
        "unit_scale": Entry(_unit_makes, _compute("unit_scale")),
    }
    fp8_block = Entry(_fp8_block_makes, _compute("fp4_to_fp8_block"))
    out.update((f"fp4_to_fp8_block.{leaf}", fp8_block) for leaf in ("weight", "weight_scale"))
    out.update((f"requant.{leaf}", Entry(_requant_makes, _compute("requant"))) for leaf in REQUANT_LEAVES)
    return out


TRANSFORMS: dict[str, Entry] = _entries()


def planned_spec(name: str, inputs: Sequence[Spec], args: Args, source_block: tuple[int, int]) -> Spec:
    """The (dtype, shape) transform `name` makes of `inputs`; TransformInputError says why not."""
    entry = TRANSFORMS.get(name)
    if entry is None:
        raise TransformInputError(f"no transform {name!r} (known: {', '.join(sorted(TRANSFORMS))})")
    made = entry.makes(inputs, args, source_block)
    leaf = name.partition(".")[2]
    if leaf not in made:
        raise TransformInputError(f"makes {', '.join(sorted(made))} under these args, not {leaf}")
    return made[leaf]


def same_size(a: Spec, b: Spec) -> bool:
    """Whether a copy can relabel `a` as `b`: the same shape and element size."""
    return a[1] == b[1] and ITEMSIZE[a[0]] == ITEMSIZE[b[0]]


def compute(transform: Transform, tensors: list[torch.Tensor], where: str) -> Computed:
    """Run the computation `transform` is a leaf of, on its inputs' tensors (in order);
    `where` names the tensor being made, for a refusal."""
    entry = TRANSFORMS[transform.name]
    assert entry.compute is not None, "a copy is planned as bytes"
    result = entry.compute(tensors, transform, where)
    if transform.exact and result.measured is not None and not result.measured.exact:
        raise PlanError(
            f"{where}: {transform.name} of {transform.inputs[0].name} differs from the native weight by up to "
            f"{result.measured.max_abs_error:g}, but its scheme takes it exact; refusing to write it",
            kind="inexact_transform",
            tensor=where,
        )
    return result
