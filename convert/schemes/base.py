"""What every scheme entry works on: the draft's modules as the runtime's quantisation config
sees them, and what one module is built as (a `Scheme`, with the tensors it then takes).

A draft module is one quantisation layer of the bundled draft model, named as vLLM names it
(`model.layers.{L}.attn.fused_wqa_wkv`, mapping/README.md#quantisation-layer-names), made of
native modules (`mtp.0.attn.wq_a`, `mtp.0.attn.wkv`), each of which holds its tensors under
its own name in a draft directory (`mtp.0.attn.wq_a.weight`, `.scale`). Which native modules
make up which layer comes from a forward xpu plan (the table's concat and stack rules); the
layer names and kinds from the bundled model's quantisation layers, cached beside its
layout (model/layout.py `quant_layers_of`), so no model is built to answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from dsv4.convert.plan import Plan
from dsv4.model.errors import DSV4Error
from dsv4.model.layout import LayerKind, quant_layers_of
from dsv4.model.native import Layout

# the error a caller wants a refusal as (PlanError for a plan, CheckError for `check`): a
# factory taking the message and the error's fields
ErrorFactory = Callable[..., DSV4Error]
INSTALL_HINT = "pip install 'dsv4-convert[quant]'"  # the optional extra that brings compressed-tensors
LAYER = re.compile(r"^model\.layers\.(\d+)\.")  # a draft layer's runtime name: its number L
PACKED_FP4 = "I8"  # a native FP4 weight: two e2m1 codes per byte (mapping/README.md#storage-dtypes)


@dataclass(frozen=True)
class LayerMap:
    """The draft's quantisation layers and the native modules each is made of."""

    kinds: dict[str, LayerKind]
    parts: dict[str, tuple[str, ...]]
    num_hidden_layers: int = 0  # N of the draft's own config: its layers are model.layers.{N+i}

    def native_kind(self, draft: str) -> LayerKind:
        # the parts of fused experts are each a plain linear (w1, w2, w3 of one expert)
        return "linear" if self.kinds[draft] == "moe" else self.kinds[draft]

    def renumbered(self, num_hidden_layers: int) -> LayerMap:
        """The same modules as a target with `num_hidden_layers` main layers names them (the
        runtime numbers the draft's layers after the TARGET's; spec: vLLM's quantisation
        prefixes are `model.layers.{N+i}`)."""
        shift = num_hidden_layers - self.num_hidden_layers

        def name(layer: str) -> str:
            return LAYER.sub(lambda m: f"model.layers.{int(m.group(1)) + shift}.", layer, count=1)

        return LayerMap(
            {name(k): v for k, v in self.kinds.items()},
            {name(k): v for k, v in self.parts.items()},
            num_hidden_layers,
        )


def layer_map(plan: Plan) -> LayerMap:
    """From a forward xpu plan: each planned tensor belongs to the draft layer whose module path
    prefixes its name, and is made of source tensors whose module is their name minus the
    last component (`mtp.0.attn.wq_a.scale` -> `mtp.0.attn.wq_a`)."""
    layers = {layer.path: layer for layer in quant_layers_of(plan.model_config)}
    kinds: dict[str, LayerKind] = {}
    parts: dict[str, dict[str, None]] = {}  # insertion-ordered sets
    for t in plan.tensors:
        segments = t.name.split(".")
        owner = next(
            (layers[p] for k in range(len(segments) - 1, 0, -1) if (p := ".".join(segments[:k])) in layers), None
        )
        if owner is None:
            continue  # a norm or hyper-connection parameter: not a quantisation layer
        kinds[owner.name] = owner.kind
        for piece in t.pieces:
            parts.setdefault(owner.name, {})[module_of(piece.name)] = None
    return LayerMap(kinds, {name: tuple(p) for name, p in parts.items()}, plan.model_config.num_hidden_layers)


def module_of(tensor: str) -> str:
    """The native module a tensor belongs to: its name minus the last component."""
    return tensor.rsplit(".", 1)[0]


def part_tensors(part: str, native: Layout) -> Layout:
    """The tensors native module `part` holds in `native` (a draft directory's layout)."""
    return {name: spec for name, spec in native.items() if module_of(name) == part}


@dataclass(frozen=True)
class Output:
    """One tensor a native part holds in the draft under a scheme, and how it is made from the
    native draft's tensors: `transform` names an entry of convert/transforms.py's registry
    ("copy" keeps the bytes, relabelling the dtype where the itemsize agrees), `inputs` are
    the native tensors it reads in the transform's order, `args` the transform's parameters
    (a target group's quantisation arguments), `exact` whether dequantising it as its
    scheme says gives the native values bit for bit."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    transform: str
    inputs: tuple[str, ...]
    exact: bool = True
    args: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Scheme:
    """What the runtime builds one draft module as, and the tensors each of its native parts
    must then hold: `outputs(part, native)` from the part's tensors in the native layout."""

    name: str
    outputs: Callable[[str, Layout], list[Output]]

    def tensors(self, part: str, native: Layout) -> Layout:
        return {o.name: (o.dtype, o.shape) for o in self.outputs(part, native)}


def _as_stored(part: str, native: Layout) -> list[Output]:
    return [Output(name, dtype, shape, "copy", (name,)) for name, (dtype, shape) in part_tensors(part, native).items()]


def _dequantised(part: str, native: Layout) -> list[Output]:
    """The part's weight in BF16 at its logical shape, its scale gone, anything else (a gate's
    bias) as it is: FP8 x E8M0 and e2m1 x E8M0 are exact in bf16 (mapping/README.md#storage-dtypes)."""
    held = part_tensors(part, native)
    out: list[Output] = []
    for name, (dtype, shape) in held.items():
        leaf = name.rsplit(".", 1)[1]
        if leaf == "scale":
            continue
        if leaf == "weight":
            shape = (*shape[:-1], shape[-1] * 2) if dtype == PACKED_FP4 else shape
            scale = f"{part}.scale"
            inputs = (name, scale) if scale in held else (name,)
            out.append(Output(name, "BF16", shape, "dequant_bf16" if scale in held else "copy", inputs))
        else:
            out.append(Output(name, dtype, shape, "copy", (name,)))
    return out


# the schemes the entries share; an entry may define its own
FP8_BLOCK = Scheme("fp8-block", _as_stored)  # e4m3 weight + one scale per 128x128 block, as DeepSeek stores it
FP4_EXPERTS = Scheme("fp4-experts", _as_stored)  # packed e2m1 + one E8M0 scale per 32, as DeepSeek stores it
UNQUANTISED = Scheme("unquantised", _dequantised)  # a bf16 weight

# How a draft is made to serve beside a target (--draft-format): the draft as the source holds
# it; FP8-block (and MXFP4) groups added to the target's config for the draft's layers only,
# passed at launch; the draft's layers ignored in that config and shipped in bf16; requantised
# into the target's own scheme, no launch change
Route = Literal["native", "overlay", "bf16", "match-target"]
ROUTES: tuple[Route, ...] = ("native", "overlay", "bf16", "match-target")


@dataclass(frozen=True)
class Decision:
    """One draft module under a target's quantisation config: its scheme, and why."""

    module: str  # the runtime's quantisation layer name
    kind: LayerKind
    parts: tuple[str, ...]
    scheme: Scheme
    why: str

    def outputs(self, native: Layout) -> list[Output]:
        return [o for part in self.parts for o in self.scheme.outputs(part, native)]

    def tensors(self, native: Layout) -> Layout:
        return {o.name: (o.dtype, o.shape) for o in self.outputs(native)}


@dataclass(frozen=True)
class TargetMethod:
    """A registry entry: one target `quant_method` (None: no quantization_config at all).
    `decide(qc, layers, native, where, error)` gives every module of `layers` its scheme."""

    method: str | None
    label: str  # what the method is, for the refusal that lists the known ones
    decide: Callable[[Mapping[str, Any] | None, LayerMap, Layout, str, ErrorFactory], list[Decision]]
    # serve(qc, layers, native, where, error, route, allow_lossy): the ServePlan of a route
    # ("auto" included); None: the registry's own rule for the entries with one route each
    serve: Callable[..., ServePlan] | None = None
    # provisional(same arguments): `serve`'s plan read without the library the entry validates
    # with, for the conversion to start while the library reads it (convert/verdict.py), or None
    # where it cannot say; None: the entry reads no library (serve is the plan at once)
    provisional: Callable[..., ServePlan | None] | None = None


@dataclass(frozen=True)
class ServePlan:
    """A draft for one serving target: the route, every draft module's scheme under the
    config the runtime will build it with, and what that takes besides the tensors."""

    route: Route
    decisions: list[Decision]  # every draft module, named as vLLM names it beside the target
    # the value `--hf-overrides` takes ({"quantization_config": ...}); None: no launch change
    overrides: dict[str, Any] | None
    quantization_config: dict[str, Any] | None  # what the draft's own config.json says (None: no such field)
    why: str  # the route's reason, one line ("auto: a DeepSeek fp8 target serves the native draft")
