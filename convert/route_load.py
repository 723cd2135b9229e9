"""A draft directory written for a serving target (`--serve-with`, any route) loaded into the
bundled model, each native linear decoded as the form it is held in says (model/storage.py
HELD_LINEARS); every tensor checked first, strictly (`held_forms`, also the layout check's rule).

The native names map into the bundled model by the xpu table, as for a native draft
(convert/inmemory.py): its plan, made for the native layout this draft's config describes,
says which native tensors each model parameter is made of, back to back. A held linear the
model has a container for (FP8 blocks with E8M0 or F32 scales, FP4 experts, bf16 linears) is
loaded as its bytes; any other linear (a lossy form, an MXFP4 linear) is decoded to bf16 first,
and routed experts the model has no container for are decoded one at a time, when a token routes
to one. So an exact route's draft runs on the very values the native draft does.

Lossy forms are decoded with compressed-tensors' own decompressors (an optional extra, imported
here only when such a draft is loaded): the bundled model (model/) imports no optional library,
and the decoding must be the one the format's writer defines, not a second copy of it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4.convert.choose import choose_table
from dsv4.convert.plan import Plan, plan_conversion
from dsv4.convert.schemes.base import INSTALL_HINT, layer_map, module_of
from dsv4.convert.sources.inventory import Inventory
from dsv4.mapping.targets import bundled_target
from dsv4.model.checkpoint import Checkpoint
from dsv4.model.config import ModelConfig
from dsv4.model.dtypes import nbytes
from dsv4.model.errors import LoadError
from dsv4.model.layout import quant_layers_of
from dsv4.model.native import standalone_draft_layout
from dsv4.model.safetensors_header import TensorBytes
from dsv4.model.storage import HELD_LINEARS, HeldLinear, held_linear, nearest_held_linears

if TYPE_CHECKING:
    import torch
    from torch import nn

NATIVE_LEAVES = ("weight", "scale")  # a native linear's tensors (mapping/README.md#storage-dtypes)
Found = Mapping[str, tuple[str, tuple[int, ...]]]  # a directory's tensors: name -> (dtype, shape)


def _refuse(kind: str, message: str, where: str, tensor: str) -> LoadError:
    return LoadError(f"{where}: {message}", kind=kind, path=where, tensor=tensor)


def native_linears(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every native linear of the draft `cfg` describes (a module with a weight and a scale) and its
    logical [rows, cols] (an FP4 weight packs two inputs per byte)."""
    native = standalone_draft_layout(cfg)
    out = {}
    for name in native:
        if name.endswith(".scale"):
            module = module_of(name)
            wdtype, (rows, cols) = native[f"{module}.weight"]
            out[module] = (rows, cols * 2 if wdtype == "I8" else cols)
    return out


def is_held_for_a_target(cfg: ModelConfig, found: Found) -> bool:
    """Whether a draft directory holding `found` holds some native linear otherwise than as a native
    pair (so it was written for a serving target): a leaf other than weight and scale, or exactly the
    tensors of another form (a bf16 weight alone). Headers only: a native draft with a tensor missing
    or of a wrong dtype is left to the planner and the config check to refuse."""
    linears = native_linears(cfg)
    leaves: dict[str, dict[str, str]] = {}
    for name, (dtype, _) in found.items():
        if (module := module_of(name)) in linears:
            leaves.setdefault(module, {})[name.rsplit(".", 1)[1]] = dtype
    for module, held in leaves.items():
        form = held_linear(module, held)
        if any(leaf not in NATIVE_LEAVES for leaf in held) or (form is not None and not form.native):
            return True
    return False


def _refuse_nearest(module: str, dtypes: dict[str, str], where: str) -> None:
    """The refusal for native linear `module` holding `dtypes` (leaf -> dtype), no form's leaves: what
    the nearest forms miss, else the leaf none of them has, else the dtype none of them holds it in."""
    if not dtypes:
        said = f"missing tensors {module}.* (the linear is held in none of the forms {', '.join(HELD_LINEARS)})"
        raise _refuse("missing_key", said, where, f"{module}.weight")
    near = nearest_held_linears(module, dtypes)
    missing = {h.name: [x.name for x in h.leaves if x.name not in dtypes] for h in near}
    if all(missing.values()):
        names = sorted({f"{module}.{leaf}" for leaves in missing.values() for leaf in leaves})
        said = f"missing tensor {' or '.join(names)} (held as {' or '.join(missing)})"
        raise _refuse("missing_key", said, where, names[0])
    near = [h for h in near if not missing[h.name]]
    forms = " or ".join(h.name for h in near)
    for leaf, dtype in sorted(dtypes.items()):
        wants = {x.dtype for h in near for x in h.leaves if x.name == leaf}
        if not wants:
            said = f"unexpected tensor {module}.{leaf} (held as {forms})"
            raise _refuse("unexpected_key", said, where, f"{module}.{leaf}")
        if dtype not in wants:
            said = f"tensor {module}.{leaf} has dtype {dtype}, {forms} holds {' or '.join(sorted(wants))}"
            raise _refuse("dtype_mismatch", said, where, f"{module}.{leaf}")


def _held_form(module: str, leaves: Found, dims: tuple[int, int], cfg: ModelConfig, where: str) -> HeldLinear:
    """The form native linear `module` is held in (its tensors `leaves`: leaf -> (dtype, shape)),
    every leaf present, of its dtype and shape for the linear's logical `dims`; else refused naming
    the tensor (missing_key, unexpected_key, dtype_mismatch, shape_mismatch)."""
    dtypes = {leaf: dtype for leaf, (dtype, _) in leaves.items()}
    form = held_linear(module, dtypes)
    if form is None:
        _refuse_nearest(module, dtypes, where)
    assert form is not None  # _refuse_nearest refuses every other case
    rows, cols = dims
    shapes = {leaf: shape for leaf, (_, shape) in leaves.items()}
    group = form.group_of(cols, shapes)
    if group is None:  # a group the scale's columns give, and they do not divide the inputs
        said = f"{module}: {form.name} scale of shape {list(shapes['weight_scale'])} groups no whole inputs of {cols}"
        raise _refuse("shape_mismatch", said, where, f"{module}.weight_scale")
    for leaf, (_, shape) in form.tensors(rows, cols, group, cfg.weight_block_size).items():
        if shapes[leaf] != shape:
            said = f"tensor {module}.{leaf} has shape {list(shapes[leaf])}, {form.name} of [{rows}, {cols}] holds"
            raise _refuse("shape_mismatch", f"{said} {list(shape)}", where, f"{module}.{leaf}")
    return form


def held_forms(cfg: ModelConfig, found: Found, where: str) -> dict[str, HeldLinear]:
    """Each native linear's held form, the directory's tensors (`found`, listed in `where`) checked
    strictly: every other tensor (norms, hyper-connections, attn_sink, the router) exactly as the
    native draft holds it, nothing missing, nothing extra."""
    native, linears = standalone_draft_layout(cfg), native_linears(cfg)
    by_module: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for name, spec in sorted(found.items()):
        if module_of(name) in linears:
            by_module.setdefault(module_of(name), {})[name.rsplit(".", 1)[1]] = spec
        elif name not in native:
            raise _refuse("unexpected_key", f"unexpected tensor {name} (not a tensor of the draft)", where, name)
        elif spec != native[name]:
            said = (
                f"tensor {name} is {spec[0]} {list(spec[1])}, the draft holds {native[name][0]} {list(native[name][1])}"
            )
            raise _refuse("shape_mismatch" if spec[1] != native[name][1] else "dtype_mismatch", said, where, name)
    for name in native:
        if module_of(name) not in linears and name not in found:
            raise _refuse("missing_key", f"missing tensor {name} (a tensor of the draft)", where, name)
    return {m: _held_form(m, by_module.get(m, {}), dims, cfg, where) for m, dims in sorted(linears.items())}


def native_plan(cfg: ModelConfig, config: dict[str, Any], location: str) -> Plan:
    """The xpu plan of the native draft `cfg` describes, from its layout alone (no file behind it):
    which native tensors each parameter of the bundled model is made of, in order."""
    tensors, at = {}, 0
    for name, (dtype, shape) in standalone_draft_layout(cfg).items():
        size = nbytes(dtype, shape)
        tensors[name] = TensorBytes(name, "native-layout", dtype, shape, at, at + size)
        at += size
    inv = Inventory(location, config, tensors, {"native-layout": at})
    return plan_conversion(inv, choose_table(bundled_target().name, inv))


# --- decoding a held linear to bf16 -------------------------------------------------------------
Held = dict[str, "torch.Tensor"]  # a held linear's tensors by leaf


def _ct_decompressed(lossy: tuple[str, str], held: Held, group: int) -> torch.Tensor:
    """compressed-tensors' own decompression of one module's `held` tensors by `lossy` (its compressor's
    format and the preset scheme of its weights), the weights grouped by `group` (compressed-tensors
    0.20.1 compressors/pack_quantized/base.py:113-181, compressors/nvfp4/base.py:101-133)."""
    compressor, preset = lossy
    try:
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import preset_name_to_scheme
    except ImportError:
        raise LoadError(
            f"decoding a {preset} draft needs the compressed-tensors library: {INSTALL_HINT}", kind="load_failed"
        ) from None
    scheme = preset_name_to_scheme(preset, ["Linear"])
    assert scheme.weights is not None  # both presets quantise weights
    scheme.weights = scheme.weights.model_copy(update={"group_size": group})
    return BaseCompressor.get_value_from_registry(compressor).decompress(dict(held), scheme)["weight"]


def decoded(form: HeldLinear, held: Held, cfg: ModelConfig, group: int) -> torch.Tensor:
    """A linear held as `form` (its tensors `held`, by leaf; `group` its inputs per scale) as bf16 [rows,
    cols]: the exact forms by the bundled model's own dequantisation (model/quantized.py), the lossy
    ones by compressed-tensors' decompressors."""
    import torch

    from dsv4.model.quantized import dequant_block, dequant_packed
    from dsv4.model.storage import FP4

    weight, *scales = (held[leaf.name] for leaf in form.leaves)  # the weight first, then its scale(s)
    if form.container in ("fp8-e8m0", "fp8-f32"):
        return dequant_block(weight, scales[0], cfg.weight_block_size)
    if form.container == "fp4":
        return dequant_packed(weight, scales[0], FP4)
    if form.exact:  # bf16
        return weight
    return _ct_decompressed(LOSSY_FORMATS[form.name], held, group).to(torch.bfloat16)


# a lossy form -> (compressed-tensors' format, the preset scheme of its weights)
LOSSY_FORMATS = {
    "w4a16": ("pack-quantized", "W4A16"),
    "nvfp4a16": ("nvfp4-pack-quantized", "NVFP4A16"),
    "nvfp4a16-experts": ("nvfp4-pack-quantized", "NVFP4A16"),  # its input_global_scale is not read
}


# --- the bundled model from a held draft --------------------------------------------------------
def layer_parts(plan: Plan) -> dict[str, tuple[str, ...]]:
    """Module path of each quantisation layer of the bundled model -> the native modules it is made of."""
    paths = {layer.name: layer.path for layer in quant_layers_of(plan.model_config)}
    return {paths[name]: parts for name, parts in layer_map(plan).parts.items()}


def _layer_containers(parts: dict[str, tuple[str, ...]], forms: dict[str, HeldLinear], where: str) -> dict[str, str]:
    """Module path -> container of every quantisation layer whose parts are held linears: the parts of
    one layer (wq_a and wkv of fused_wqa_wkv) in one container, as the runtime builds one layer one
    way; a layer whose parts are held otherwise is refused naming them."""
    out = {}
    for path, layer_parts_ in parts.items():
        held = [p for p in layer_parts_ if p in forms]
        containers = {forms[p].container for p in held}
        if len(containers) > 1:
            said = ", ".join(f"{p} as {forms[p].name}" for p in held)
            raise _refuse("dtype_mismatch", f"layer {path} holds its parts in different forms ({said})", where, held[0])
        if containers:
            out[path] = containers.pop()
    return out


def _back_to_back(values: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """`values`' bytes back to back as a tensor shaped and typed `like` (every table op is a concat along
    dim 0 or a stack: its parts' bytes in order)."""
    import torch

    flat = torch.cat([v.contiguous().reshape(-1).view(torch.uint8) for v in values])
    return flat.view(like.dtype).view(like.shape)


def _stacked_experts(
    path: str, experts: dict[tuple[int, str], str], leaf_of: Callable[[str, int], torch.Tensor], model: nn.Module
) -> dict[str, torch.Tensor]:
    """The kept routed-experts parameters of the layer at `path` (its parts `experts`), each expert's w1
    and w3 then its w2, weight then scale (`leaf_of(module, 0 or 1)`), in the container the model
    built: named by that container, not by the config's storage (FP4 experts held as FP8 blocks)."""
    held = model.get_submodule(f"{path}.routed_experts")
    expected = held.state_dict()
    count = 1 + max(e for e, _ in experts)
    out = {}
    for w, linears in (("w13", ("w1", "w3")), ("w2", ("w2",))):
        for i, param in enumerate(("weight", held.scale_name)):
            values = [leaf_of(experts[e, x], i) for e in range(count) for x in linears]
            out[f"{path}.routed_experts.{w}_{param}"] = _back_to_back(values, expected[f"{w}_{param}"])
    return out


def load_held(root: Path, device: torch.device) -> nn.Module:
    """The bundled model loaded from draft directory `root`, whose linears are held as a serving
    target's schemes take them (held_forms checks every tensor first): each layer kept in the
    container its form names where the model has one; else a linear decoded to bf16 when loading,
    routed experts one at a time when a token routes to one."""
    from dsv4.model.loader import draft_model_holding, load_state
    from dsv4.model.quantized import DecodedExperts

    checkpoint = Checkpoint(root)
    cfg, headers = checkpoint.model_config, checkpoint.headers
    where = str(root / headers.index_file)
    forms = held_forms(cfg, {n: (t.dtype, t.shape) for n, t in headers.tensors.items()}, where)
    plan = native_plan(cfg, checkpoint.config, str(root))
    parts = layer_parts(plan)
    dims = native_linears(cfg)
    tensors = checkpoint.load_tensors(headers.tensors)  # on the CPU, views of the mapped shards

    def held(module: str) -> Held:
        return {x.name: tensors[f"{module}.{x.name}"] for x in forms[module].leaves}

    def decode(module: str) -> torch.Tensor:
        group = forms[module].group_of(dims[module][1], {k: tuple(v.shape) for k, v in held(module).items()})
        assert group is not None  # held_forms refused any other
        return decoded(forms[module], held(module), cfg, group)

    def decoded_experts(path: str) -> DecodedExperts:
        return DecodedExperts(partial(_expert, decode, _experts_of(parts[path])), device)

    model, kept = draft_model_holding(cfg, _layer_containers(parts, forms, where), decoded_experts)
    container_of = {p: kept[path] for path, ps in parts.items() if path in kept for p in ps}

    def leaf_of(module: str, i: int) -> torch.Tensor:  # a kept linear's weight (0) or scale (1), as held
        return held(module)[forms[module].leaves[i].name]

    def value_of(native: str) -> torch.Tensor | None:
        module, leaf = native.rsplit(".", 1)
        if module not in forms:
            return tensors[native]  # a norm, hyper-connection, sink or router tensor: as the draft holds it
        if container_of[module] != "bf16":
            return leaf_of(module, NATIVE_LEAVES.index(leaf))
        return decode(module) if leaf == "weight" else None

    moe = {layer.path for layer in quant_layers_of(cfg) if layer.kind == "moe"}
    expert_parts = {p for path in moe for p in parts[path]}
    state = {}
    for path in moe:  # kept experts by their container's names; decoded ones have no parameter
        if kept.get(path) != "decoded":
            state.update(_stacked_experts(path, _experts_of(parts[path]), leaf_of, model))
    expected = model.state_dict()
    for t in plan.tensors:
        if t.name in expected and not any(module_of(p.name) in expert_parts for p in t.pieces):
            values = [value_of(p.name) for p in t.pieces]
            if all(v is not None for v in values):  # else the scale of a layer kept in bf16
                state[t.name] = _back_to_back(values, expected[t.name])
    return load_state(cfg, state, device, model)


EXPERT_PART = re.compile(r"\.(\d+)\.(w[123])\Z")  # a routed expert's linear: ...ffn.experts.{e}.w{1,2,3}


def _experts_of(parts: tuple[str, ...]) -> dict[tuple[int, str], str]:
    """(expert, w1|w2|w3) -> the native module, for a routed-experts layer's parts."""
    return {(int(m.group(1)), m.group(2)): p for p in parts if (m := EXPERT_PART.search(p))}


def _expert(
    decode: Callable[[str], torch.Tensor], experts: dict[tuple[int, str], str], e: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's (w13 = cat(w1, w3), w2), each decoded as its held form says."""
    import torch

    return torch.cat([decode(experts[e, "w1"]), decode(experts[e, "w3"])]), decode(experts[e, "w2"])
