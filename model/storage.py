"""The routed experts' storage formats, one entry per config.json "expert_dtype" (mapping/README.md#storage-dtypes).

An entry says everything the tool knows of one format: the native tensors of an expert linear
(`ffn.experts.{e}.w{1,2,3}.weight` and `.scale`: safetensors dtypes, shapes as functions of the
linear's dims), the dtype of the dense FP8 linears' scales beside such experts, the bundled model's
containers (the xpu layout's `routed_experts` parameters), how the stored values decode, and how
`synth` draws realistic ones. The native format (model/native.py), the bundled model
(model/quantized.py, model/mtp.py), the presets, the table probe and validation (mapping/), `check`
and `synth` read these fields; none names a format itself. So a new storage is one entry here (and
the table lines that map it to xpu): `storage_of` refuses any other name by name, never reads it as
another. Only the independent reference (model/reference.py) decodes fp4 and fp8 its own way, by design.

Below them, the forms a draft written for a serving target holds one native linear in (`HELD_LINEARS`:
the native pair, compressed-tensors' leaves, bf16), which the held-draft loader (convert/route_load.py)
and `check` read.

Its functions take the expert_dtype string, not a ModelConfig, and it imports nothing of this package
but the errors and no torch: every layer reads it, so it sits at the bottom and closes no import circle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsv4.model.errors import CheckpointError

FIELD = "expert_dtype"  # the config.json field that names the storage


def ceil_div(n: int, d: int) -> int:
    """Blocks of `d` needed for `n` (a block-scale grid's size: the last block may be partial)."""
    return -(-n // d)


@dataclass(frozen=True)
class ExpertStorage:
    """How one release stores its routed experts: each expert linear [rows, cols] is a weight and a
    grid of power-of-two scales, one per `scale_block` (or quantization_config's weight_block_size)."""

    name: str  # the expert_dtype value
    release: str  # the release kind that stores its experts so (synth --variant; plan messages)
    weight_dtype: str  # safetensors dtype of a native expert weight
    scale_dtype: str  # safetensors dtype of its scale
    linear_scale_dtype: str  # the dense FP8 linears' scale dtype in such a checkpoint (and in vLLM's layout)
    container_dtype: str  # dtype of the bundled model's (the xpu layout's) stacked expert weights
    scale_container_dtype: str  # ... and of their scales
    scale_param: str  # the layout's scale parameter: w13_<scale_param>, w2_<scale_param>
    synth_scale_exponents: tuple[int, int]  # inclusive range of log2 of the scales synth draws
    scale_block: tuple[int, int] | None = None  # (rows, cols) one scale covers; None: weight_block_size
    codebook: tuple[float, ...] | None = None  # code -> value of packed codes; None: the weight's own numbers
    codes_per_byte: int = 1  # codes packed in one byte along the input dim, the LOW bits first
    synth_weight_std: float = 0.0  # numeric weights: N(0, std), clamped into the dtype's finite range
    mtp_emb_head: bool = False  # such a release may carry mtp.{i}.emb.tok_emb.weight and mtp.{i}.head.weight

    def __post_init__(self) -> None:
        # dequantisation (model/quantized.py) decodes packed codes one byte at a time, scaled per row group
        if self.codebook is not None and (
            len(self.codebook) != 1 << (8 // self.codes_per_byte) or (self.scale_block or (0,))[0] != 1
        ):
            raise ValueError(f"{self.name}: a codebook fills its code's bits and is scaled per (1, n) group")

    def block(self, weight_block_size: tuple[int, int]) -> tuple[int, int]:
        """(rows, cols) one scale covers, for a config whose quantization_config has `weight_block_size`."""
        return self.scale_block or weight_block_size

    def weight_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return rows, cols // self.codes_per_byte

    def scale_shape(self, rows: int, cols: int, weight_block_size: tuple[int, int]) -> tuple[int, int]:
        br, bc = self.block(weight_block_size)
        return ceil_div(rows, br), ceil_div(cols, bc)


FP4 = ExpertStorage(  # instruct releases: e2m1 codes two per byte, E8M0 scales per 32 inputs
    name="fp4",
    release="instruct",
    weight_dtype="I8",
    scale_dtype="F8_E8M0",
    linear_scale_dtype="F8_E8M0",
    # vLLM's FP4 MoE holds packed codes and E8M0 scales as raw bytes (the table views them as U8)
    container_dtype="U8",
    scale_container_dtype="U8",
    scale_param="weight_scale",
    scale_block=(1, 32),
    codebook=(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0),  # bit 3: sign
    codes_per_byte=2,
    # an FP4 group of 32 has its amax ~6: weights of std ~0.02 need scales around 2^-8
    synth_scale_exponents=(-10, -6),
)

FP8 = ExpertStorage(  # Base releases ("FP8 mixed"): e4m3 [out, in], F32 block scales
    name="fp8",
    release="base",
    weight_dtype="F8_E4M3",
    scale_dtype="F32",
    linear_scale_dtype="F32",
    container_dtype="F8_E4M3",
    scale_container_dtype="F32",
    scale_param="weight_scale_inv",
    # a released FP8 block has its amax scaled to ~448: weights of std ~0.02 need scales around 2^-13
    synth_weight_std=100.0,
    synth_scale_exponents=(-15, -11),
    mtp_emb_head=True,
)

STORAGES: dict[str, ExpertStorage] = {s.name: s for s in (FP4, FP8)}
DENSE_LINEAR = FP8  # every release's dense linears are FP8 e4m3 blocks: synth draws them with FP8's magnitudes


def expert_dtypes() -> tuple[str, ...]:
    """The expert_dtype values this tool has a storage for (read at each call: a test may register one)."""
    return tuple(STORAGES)


def storage_of(expert_dtype: str, where: str) -> ExpertStorage:
    """The storage `expert_dtype` names; any other value is refused (unsupported_layout, exit 35),
    headed by `where`, the file the value came from."""
    storage = STORAGES.get(expert_dtype)
    if storage is None:
        *rest, last = expert_dtypes()
        expected = f"{', '.join(rest)} or {last}" if rest else last
        raise CheckpointError(
            f"{where}: unknown {FIELD} {expert_dtype!r} (expected {expected})",
            kind="unsupported_layout",
            path=where,
            field=FIELD,
        )
    return storage


def holding_native_weight(dtype: str) -> tuple[str, ...]:
    """The expert_dtypes whose native expert weight may be of safetensors `dtype` (several may share one)."""
    return tuple(s.name for s in STORAGES.values() if s.weight_dtype == dtype)


def holding_layout_tensor(param: str, dtype: str) -> tuple[str, ...]:
    """The expert_dtypes whose stacked layout parameter `param` ("weight" or a scale parameter) may be of
    `dtype`: a weight by its container dtype, a scale by its parameter name."""
    if param == "weight":
        return tuple(s.name for s in STORAGES.values() if s.container_dtype == dtype)
    return tuple(s.name for s in STORAGES.values() if s.scale_param == param)


def scale_params() -> tuple[str, ...]:
    """Every storage's layout scale parameter name (weight_scale, weight_scale_inv)."""
    return tuple(sorted({s.scale_param for s in STORAGES.values()}))


# --- how a draft directory holds one native linear under a serving scheme -----------------------
# A draft written for a serving target (--serve-with, mapping/README.md#storage-dtypes) keeps every
# native module name (`mtp.0.attn.wq_a`, `mtp.0.ffn.experts.3.w1`) but holds each linear as the scheme
# vLLM builds it with takes it: the native pair (`.weight` + `.scale`), compressed-tensors' leaves
# (`.weight` + `.weight_scale`, `.weight_packed` + ...), or a bf16 `.weight`. One entry per such form.


@dataclass(frozen=True)
class Leaf:
    """One tensor of a held linear [rows, cols]: its name after the module's, its dtype, and its shape
    for the linear's logical dims and the held form's group (the inputs one scale covers along cols)."""

    name: str
    dtype: str
    grid: str  # "full" [rows, cols], "packed" [rows, cols / per_element], "block" [ceil(rows/br), ceil(cols/bc)],
    # "group" [rows, cols / group], "pair" [2] (the logical shape), "one" [1] (a tensor-wide scale)
    per_element: int = 1  # codes per stored element of a "packed" leaf (e2m1: 2 per byte, int4: 8 per int32)

    def shape(self, rows: int, cols: int, group: int, block: tuple[int, int]) -> tuple[int, ...]:
        grids = {
            "full": lambda: (rows, cols),
            "packed": lambda: (rows, cols // self.per_element),
            "block": lambda: (ceil_div(rows, block[0]), ceil_div(cols, block[1])),
            "group": lambda: (rows, cols // group),
            "pair": lambda: (2,),
            "one": lambda: (1,),
        }
        return grids[self.grid]()


@dataclass(frozen=True)
class HeldLinear:
    """One form a draft directory holds a native linear in. `container` is what the bundled model keeps
    it as when it has such a container for the layer (model/quantized.py `holding`): "fp8-e8m0" or
    "fp8-f32" (e4m3 with block scales), "fp4" (packed e2m1 and E8M0 bytes, routed experts only), "bf16";
    any other pairing is decoded to bf16 when loading. `exact`: decoding it gives the native values bit
    for bit (the lossy forms hold a requantisation). `group`: inputs per scale, 0 when the scale's
    shape says (W4A16's group size is the target's choice)."""

    name: str
    leaves: tuple[Leaf, ...]
    container: str
    exact: bool = True
    group: int = 0
    native: bool = False  # a native pair: as the source release stores the linear
    experts_only: bool = False  # a form only a routed expert's linear is held in

    def group_of(self, cols: int, held: dict[str, tuple[int, ...]]) -> int | None:
        """The group of a linear with `cols` inputs whose leaves have the shapes `held` (leaf -> shape):
        0 for a form with no per-group scale; None when the scale's columns group no whole inputs."""
        scale = next((leaf for leaf in self.leaves if leaf.grid == "group"), None)
        if self.group or scale is None:
            return self.group
        width = held.get(scale.name, (0, 0))[-1]
        return cols // width if width and cols % width == 0 else None

    def tensors(self, rows: int, cols: int, group: int, block: tuple[int, int]) -> dict[str, tuple[str, tuple]]:
        """leaf -> (dtype, shape) of a linear [rows, cols] held so."""
        return {leaf.name: (leaf.dtype, leaf.shape(rows, cols, group, block)) for leaf in self.leaves}


HELD_LINEARS: dict[str, HeldLinear] = {
    h.name: h
    for h in (
        # the native pairs (mapping/README.md#storage-dtypes): FP8 with E8M0 or F32 block scales, FP4 experts
        HeldLinear(
            "native-fp8",
            (Leaf("weight", "F8_E4M3", "full"), Leaf("scale", "F8_E8M0", "block")),
            "fp8-e8m0",
            native=True,
        ),
        HeldLinear(
            "native-fp8-f32",
            (Leaf("weight", "F8_E4M3", "full"), Leaf("scale", "F32", "block")),
            "fp8-f32",
            native=True,
        ),
        HeldLinear(
            "native-fp4",
            (Leaf("weight", "I8", "packed", 2), Leaf("scale", "F8_E8M0", "group")),
            "fp4",
            group=32,
            native=True,
        ),
        # compressed-tensors' FP8 block (the native e4m3 bytes, the E8M0 scales as their F32 values) and
        # MXFP4 (the native bytes as U8: DeepSeek's nibble order, the low nibble the even input, as
        # compressed-tensors 0.20.1 packs it, compressors/nvfp4/helpers.py:412 and :440)
        HeldLinear(
            "ct-fp8-block", (Leaf("weight", "F8_E4M3", "full"), Leaf("weight_scale", "F32", "block")), "fp8-f32"
        ),
        HeldLinear(
            "ct-mxfp4", (Leaf("weight_packed", "U8", "packed", 2), Leaf("weight_scale", "U8", "group")), "fp4", group=32
        ),
        HeldLinear("bf16", (Leaf("weight", "BF16", "full"),), "bf16"),
        # the lossy requantisations of match-target: W4A16 (int4 eight per int32, a bf16 scale per group)
        # and NVFP4A16 (e2m1 two per byte, an e4m3 scale per 16 inputs, one F32 global scale that
        # divides them: compressed-tensors 0.20.1 quantization/lifecycle/forward_helpers.py:184-185)
        HeldLinear(
            "w4a16",
            (
                Leaf("weight_packed", "I32", "packed", 8),
                Leaf("weight_scale", "BF16", "group"),
                Leaf("weight_shape", "I64", "pair"),
            ),
            "bf16",
            exact=False,
        ),
        HeldLinear(
            "nvfp4a16",
            (
                Leaf("weight_packed", "U8", "packed", 2),
                Leaf("weight_scale", "F8_E4M3", "group"),
                Leaf("weight_global_scale", "F32", "one"),
            ),
            "bf16",
            exact=False,
            group=16,
        ),
        # a routed expert's NVFP4A16, with the unit input_global_scale the MoE method registers in A16
        # mode too and never reads (convert/schemes/ct_schemes.py): decoded as nvfp4a16
        HeldLinear(
            "nvfp4a16-experts",
            (
                Leaf("weight_packed", "U8", "packed", 2),
                Leaf("weight_scale", "F8_E4M3", "group"),
                Leaf("weight_global_scale", "F32", "one"),
                Leaf("input_global_scale", "F32", "one"),
            ),
            "bf16",
            exact=False,
            group=16,
            experts_only=True,
        ),
    )
}
ROUTED_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\Z")  # a routed expert's native linear


def dense_block_scale(name: str) -> bool:
    """`name` is a dense FP8 linear's native block scale (a `.scale` of no routed expert): its grid is
    [ceil(rows/br), ceil(cols/bc)] for quantization_config's weight_block_size [br, bc] (V4: 128x128;
    V4.1: 32x32, model/config_v41.py), E8M0 bytes beside FP4 experts."""
    return name.endswith(".scale") and ROUTED_EXPERT.search(name.removesuffix(".scale")) is None


def forms_of(module: str) -> list[HeldLinear]:
    """The forms native linear `module` may be held in (the experts-only ones for a routed expert's)."""
    expert = ROUTED_EXPERT.search(module) is not None
    return [h for h in HELD_LINEARS.values() if expert or not h.experts_only]


def held_linear(module: str, leaves: dict[str, str]) -> HeldLinear | None:
    """The form of native linear `module` whose leaves are exactly `leaves` (leaf -> safetensors dtype);
    None when none is."""
    return next((h for h in forms_of(module) if {leaf.name: leaf.dtype for leaf in h.leaves} == leaves), None)


def nearest_held_linears(module: str, leaves: dict[str, str]) -> list[HeldLinear]:
    """The forms of native linear `module` sharing the most leaf names, then (leaf, dtype) pairs, with
    `leaves` (an FP8 weight alone is as near to the native pair as to compressed-tensors' FP8 block):
    what a refusal says is missing, extra or of another dtype."""

    def shared(h: HeldLinear) -> tuple[int, int]:  # leaf names first, then (name, dtype) pairs
        return sum(x.name in leaves for x in h.leaves), sum(leaves.get(x.name) == x.dtype for x in h.leaves)

    forms = forms_of(module)
    best = max(shared(h) for h in forms)
    return [h for h in forms if shared(h) == best]


# the routed-expert storages by the container a held form names (the others are kept as bf16)
EXPERT_CONTAINERS: dict[str, ExpertStorage] = {"fp4": FP4, "fp8-f32": FP8}
