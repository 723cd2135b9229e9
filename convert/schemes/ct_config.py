"""A serving target's compressed-tensors `quantization_config`, read strictly, and each config
group's scheme named as vLLM 0.33.0 dispatches it.

vLLM parses the config in CompressedTensorsConfig.from_config (compressed_tensors.py:235-271):
groups whose only target ends in "Attention" are dropped, every target maps to its group's
weights / input_activations (QuantizationArgs, pydantic-validated) and format (the group's,
else the config's), a later group naming the same target replaces it in place (a dict
assignment, :318-336). The scheme a layer gets follows `_get_scheme_from_parts`
(:783-949) for linears and `CompressedTensorsMoEMethod.get_moe_method`
(compressed_tensors_moe.py:28-201) for experts; this module names the outcomes this converter
can write the draft for and refuses every other one naming its field, rather than guess.
The arguments are validated with compressed-tensors' own pydantic models, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dsv4.convert.schemes.base import INSTALL_HINT, ErrorFactory

METHOD = "compressed-tensors"
# what CompressedTensorsConfig reads (compressed_tensors.py:235-271) and what
# compressed-tensors' QuantizationConfig writes beside it (quantization/quant_config.py:164-170)
KNOWN_KEYS = frozenset(
    {
        "quant_method",
        "format",
        "config_groups",
        "ignore",
        "kv_cache_scheme",
        "transform_config",
        "sparsity_config",
        "quantization_status",
        "global_compression_ratio",
        "version",
        "total_num_heads",
        "total_num_kv_heads",
        # written by compressed-tensors 0.20's QuantizationConfig (quant_config.py:170),
        # null where no experts were pruned; vLLM never reads it (parse refuses a set one)
        "moe_sparsity_config",
    }
)
GROUP_KEYS = frozenset({"targets", "weights", "input_activations", "output_activations", "format"})
# the schemes (and so the tensors) this converter knows; each is what vLLM builds for it
FP8_BLOCK, WNA16, NVFP4A16, NVFP4, MXFP4A16, MXFP4 = "FP8_BLOCK", "WNA16", "NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4"
UNVERIFIED = "unverified"  # a group's scheme before compressed-tensors has read its arguments (`provisional`)
# the format a scheme's tensors are written in (compressed-tensors' CompressionFormat); vLLM
# reads FP8 only under an activation-quantisation format (utils.py:43-50) and WNA16 only
# pack-quantized (compressed_tensors.py:865-875)
FORMATS = {
    FP8_BLOCK: ("float-quantized", "naive-quantized"),
    WNA16: ("pack-quantized",),
    NVFP4A16: ("nvfp4-pack-quantized",),
    NVFP4: ("nvfp4-pack-quantized",),
    MXFP4A16: ("mxfp4-pack-quantized",),
    MXFP4: ("mxfp4-pack-quantized",),
}


@dataclass(frozen=True)
class Group:
    """One config group as vLLM holds it for each of its targets."""

    name: str
    targets: tuple[str, ...]
    scheme: str  # one of the names above
    weights: dict[str, Any]  # the validated QuantizationArgs, as JSON
    format: str
    static_input: bool  # FP8 with a calibrated input_scale (static activations)

    @property
    def field(self) -> str:
        return f"quantization_config.config_groups.{self.name}"

    def args(self) -> tuple[tuple[str, Any], ...]:
        """The transform arguments of a requantisation into this group's scheme."""
        pairs = [(k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(self.weights.items())]
        return (*((k, v) for k, v in pairs if not isinstance(v, dict)), ("format", self.format))


@dataclass(frozen=True)
class Transform:
    """One `apply` entry of a transform_config group."""

    field: str
    targets: tuple[str, ...]
    ignore: tuple[str, ...]
    online: bool  # applied at run time (input/output), not folded into the stored weights


@dataclass(frozen=True)
class CtConfig:
    groups: dict[str, Group]
    # target -> group, in vLLM's order: first insertion, last group wins (compressed_tensors.py:332)
    targets: dict[str, Group]
    ignore: tuple[str, ...]
    transforms: tuple[Transform, ...] = field(default=())


def _refuse(error: ErrorFactory, where: str, fld: str, said: str) -> Exception:
    return error(f"{where}: {fld} {said}", path=where, field=fld)


def _strings(value: object, fld: str, where: str, error: ErrorFactory, *, empty: bool) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(error, where, fld, f"is {type(value).__name__}, expected a list of strings")
    if not value and not empty:
        raise _refuse(error, where, fld, "is empty: a config group must target some layer")
    return tuple(value)


def _args(value: object, fld: str, where: str, error: ErrorFactory) -> Any:
    from compressed_tensors.quantization import QuantizationArgs
    from pydantic import ValidationError

    if not isinstance(value, Mapping):
        raise _refuse(error, where, fld, f"is {type(value).__name__}, expected an object")
    try:
        return QuantizationArgs.model_validate(dict(value))
    except ValidationError as exc:
        first = exc.errors()[0]
        at = ".".join(str(p) for p in first["loc"])
        raise _refuse(error, where, f"{fld}.{at}" if at else fld, f"is not valid: {first['msg']}") from None


def _format(value: object, fld: str, where: str, error: ErrorFactory) -> str:
    from compressed_tensors.config import CompressionFormat

    if not isinstance(value, str) or value not in {f.value for f in CompressionFormat}:
        raise _refuse(error, where, fld, f"{value!r} is not a compressed-tensors format")
    return value


def _v(value: Any) -> Any:
    """An enum field's value (QuantizationArgs keeps strings or enums, by version)."""
    return getattr(value, "value", value)


def identify(w: Any, inp: Any, fmt: str, fld: str, where: str, error: ErrorFactory) -> tuple[str, bool]:
    """(scheme, static input) for a group's weights `w` and input_activations `inp` under
    `fmt`, in vLLM's dispatch order (compressed_tensors.py:795-912); what vLLM would build
    something else for, or refuse, is refused naming the argument."""
    w_fld, in_fld = f"{fld}.weights", f"{fld}.input_activations"
    strategy = _v(w.strategy)
    if _v(w.type) == "float" and w.num_bits == 4 and w.symmetric:
        if strategy == "tensor_group" and w.group_size == 16:  # _is_nvfp4_format :420-437
            if inp is None:
                scheme = NVFP4A16
            elif _v(inp.type) == "float" and inp.num_bits == 4 and inp.group_size == 16:
                scheme = NVFP4
            else:  # vLLM raises (:799-802)
                raise _refuse(error, where, in_fld, "must be NVFP4 (or absent) beside NVFP4 weights, as vLLM requires")
        elif strategy == "group" and w.group_size == 32:  # _is_mxfp4 :440-456
            if inp is not None and _v(inp.type) == "float" and inp.num_bits == 8:
                raise _refuse(
                    error, where, in_fld, "is FP8 beside MXFP4 weights (W4A8 MXFP4): not a scheme this converter writes"
                )
            scheme = MXFP4 if inp is not None else MXFP4A16
        else:
            raise _refuse(
                error,
                where,
                f"{w_fld}.strategy",
                f"{strategy!r} with group_size {w.group_size} is not NVFP4 (tensor_group 16) or MXFP4 (group 32)",
            )
    elif _v(w.type) == "int" and inp is None and strategy in ("group", "channel") and not w.dynamic:
        if fmt != "pack-quantized":  # vLLM falls through to schemes that refuse (:865-875)
            raise _refuse(
                error, where, f"{fld}.format", f"{fmt!r}: int weights without activations are read only pack-quantized"
            )
        if w.num_bits not in (4, 8) or not w.symmetric or w.actorder not in (None, False, "static", "weight"):
            raise _refuse(error, where, w_fld, "is not symmetric int4/int8 (weight zero points are not written)")
        scheme = WNA16
    elif _v(w.type) == "float" and w.num_bits == 8 and strategy == "block" and w.symmetric and not w.dynamic:
        if list(w.block_structure or []) != [128, 128]:
            raise _refuse(
                error, where, f"{w_fld}.block_structure", f"{w.block_structure} is not [128, 128], DeepSeek's FP8 block"
            )
        if inp is not None and (_v(inp.type) != "float" or inp.num_bits != 8):
            raise _refuse(error, where, in_fld, "is not FP8 beside FP8 block weights")
        static = inp is not None and not inp.dynamic
        if static and not (inp.symmetric and _v(inp.strategy) == "tensor"):
            raise _refuse(
                error,
                where,
                f"{in_fld}.strategy",
                "static FP8 activations must be per-tensor and symmetric (_is_fp8_w8a8 :582-616)",
            )
        scheme = FP8_BLOCK
        return _checked_format(scheme, fmt, fld, where, error), static
    else:
        what = f"{_v(w.type)}{w.num_bits} {strategy}"
        raise _refuse(
            error,
            where,
            w_fld,
            f"({what}{' with input activations' if inp is not None else ''}) is not a scheme this converter "
            "writes (it knows FP8_BLOCK, W4A16/W8A16, NVFP4A16, NVFP4, MXFP4A16, MXFP4)",
        )
    return _checked_format(scheme, fmt, fld, where, error), False


def _checked_format(scheme: str, fmt: str, fld: str, where: str, error: ErrorFactory) -> str:
    if fmt not in FORMATS[scheme]:
        raise _refuse(
            error,
            where,
            f"{fld}.format",
            f"{fmt!r} is not how {scheme} tensors are stored ({' or '.join(FORMATS[scheme])})",
        )
    return scheme


def _group(name: str, body: object, default_fmt: str | None, where: str, error: ErrorFactory) -> Group:
    fld = f"quantization_config.config_groups.{name}"
    if not isinstance(body, Mapping):
        raise _refuse(error, where, fld, f"is {type(body).__name__}, expected an object")
    extra = sorted(set(body) - GROUP_KEYS)
    if extra:
        raise _refuse(error, where, f"{fld}.{extra[0]}", "is not a config group field vLLM reads")
    targets = _strings(body.get("targets"), f"{fld}.targets", where, error, empty=False)
    if body.get("output_activations") is not None:
        raise _refuse(
            error,
            where,
            f"{fld}.output_activations",
            "is set: output fake-quantisation is not a scheme this converter writes",
        )
    if body.get("weights") is None:
        raise _refuse(
            error, where, f"{fld}.weights", "is absent: a group without weight quantisation has no scheme for the draft"
        )
    w = _args(body["weights"], f"{fld}.weights", where, error)
    inp = body.get("input_activations")
    inp = _args(inp, f"{fld}.input_activations", where, error) if inp is not None else None
    fmt_value = body.get("format") if body.get("format") is not None else default_fmt
    if fmt_value is None:
        raise _refuse(error, where, f"{fld}.format", "is absent and quantization_config.format too")
    fmt = _format(
        fmt_value, f"{fld}.format" if body.get("format") is not None else "quantization_config.format", where, error
    )
    scheme, static = identify(w, inp, fmt, fld, where, error)
    return Group(name, targets, scheme, w.model_dump(mode="json", exclude_none=True), fmt, static)


def _transforms(value: object, where: str, error: ErrorFactory) -> tuple[Transform, ...]:
    from compressed_tensors.transform import TransformConfig
    from pydantic import ValidationError

    fld = "quantization_config.transform_config"
    if not value:
        return ()
    if not isinstance(value, Mapping):
        raise _refuse(error, where, fld, f"is {type(value).__name__}, expected an object")
    try:
        parsed = TransformConfig.model_validate(dict(value))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise _refuse(error, where, ".".join([fld, *map(str, first["loc"])]), f"is not valid: {first['msg']}") from None
    return tuple(
        Transform(f"{fld}.config_groups.{name}.apply.{k}", tuple(a.targets), tuple(a.ignore), a.is_online())
        for name, scheme in parsed.config_groups.items()
        for k, a in enumerate(scheme.apply)
    )


def _attention_only(body: object) -> bool:
    """A group vLLM drops: its only target ends in "Attention" (compressed_tensors.py:240-251)."""
    t = body.get("targets") if isinstance(body, Mapping) else None
    return isinstance(t, list) and len(t) == 1 and isinstance(t[0], str) and t[0].endswith("Attention")


def parse(qc: Mapping[str, Any], where: str, error: ErrorFactory) -> CtConfig:
    """The target's config as vLLM holds it; anything this converter cannot read exactly is
    refused naming the field."""
    try:  # its models read the arguments below
        import compressed_tensors.quantization  # noqa: F401
    except ImportError:
        raise _refuse(
            error,
            where,
            "quantization_config.quant_method",
            f"is 'compressed-tensors': reading it needs the compressed-tensors library ({INSTALL_HINT})",
        ) from None
    extra = sorted(k for k in qc if k not in KNOWN_KEYS)
    if extra:
        raise _refuse(error, where, f"quantization_config.{extra[0]}", "is not a compressed-tensors field vLLM reads")
    if qc.get("moe_sparsity_config") is not None:
        # per-layer expert counts (compressed_tensors/config/expert_sparsity.py:13-40) that
        # vLLM's CompressedTensorsConfig ignores (compressed_tensors.py:235-271): the draft's
        # expert tensors would not be what the target's runtime builds
        raise _refuse(
            error,
            where,
            "quantization_config.moe_sparsity_config",
            "prunes experts per layer: vLLM 0.33.0 does not read it",
        )
    sparsity = qc.get("sparsity_config")
    if sparsity and (not isinstance(sparsity, Mapping) or sparsity.get("targets")):
        # vLLM refuses a sparsity config with targets (compressed_tensors.py:273-300)
        raise _refuse(
            error,
            where,
            "quantization_config.sparsity_config",
            "names layers: sparsity is not supported by vLLM 0.33.0",
        )
    top_fmt = qc.get("format")
    if top_fmt is not None:
        _format(top_fmt, "quantization_config.format", where, error)
    groups_value = qc.get("config_groups")
    if not isinstance(groups_value, Mapping) or not groups_value:
        raise _refuse(error, where, "quantization_config.config_groups", "must be a non-empty object")
    groups: dict[str, Group] = {}
    targets: dict[str, Group] = {}
    for name, body in groups_value.items():
        if _attention_only(body):
            continue
        group = _group(str(name), body, top_fmt, where, error)
        groups[group.name] = group
        for target in group.targets:
            targets[target] = group
    ignore = _strings(qc.get("ignore", []) or [], "quantization_config.ignore", where, error, empty=True)
    return CtConfig(groups, targets, ignore, _transforms(qc.get("transform_config"), where, error))


def _listed(value: object) -> tuple[str, ...] | None:
    ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    return tuple(value) if ok else None  # type: ignore[arg-type]


def provisional(qc: Mapping[str, Any], own: Mapping[str, str]) -> CtConfig | None:
    """What of `qc` vLLM matches names against (targets, ignore, transforms' targets and
    ignore), read without compressed-tensors, for a plan to start while the library reads the
    whole config in another process (convert/verdict.py). The groups named in `own` are the
    converter's, built from the compressed-tensors preset of that name: their scheme is the
    preset's, provisionally; every other group's scheme is UNVERIFIED and no argument is read,
    and every transform counts as online. It is never the authority: what a QuantizationArgs
    means (its defaults, its inferred strategy) and whether the config is valid is the
    library's alone, and the library's reading replaces this one before anything is published.
    None where the config's shape is not plain (the library's reading then decides at once)."""
    groups_value, ignore = qc.get("config_groups"), _listed(qc.get("ignore", []) or [])
    if not isinstance(groups_value, Mapping) or not groups_value or ignore is None:
        return None
    groups: dict[str, Group] = {}
    targets: dict[str, Group] = {}
    for name, body in groups_value.items():
        if _attention_only(body):
            continue
        listed = _listed(body.get("targets")) if isinstance(body, Mapping) else None
        if not listed:
            return None
        fmt = body.get("format") or qc.get("format")
        fmt = fmt if isinstance(fmt, str) else ""
        groups[name] = Group(str(name), listed, own.get(name, UNVERIFIED), {}, fmt, False)
        targets.update(dict.fromkeys(listed, groups[name]))
    transforms = _provisional_transforms(qc.get("transform_config"))
    return None if transforms is None else CtConfig(groups, targets, ignore, transforms)


def _provisional_transforms(value: object) -> tuple[Transform, ...] | None:
    if not value:
        return ()
    schemes = value.get("config_groups") if isinstance(value, Mapping) else None
    if not isinstance(schemes, Mapping):
        return None
    out = []
    for name, scheme in schemes.items():
        apply = scheme.get("apply") if isinstance(scheme, Mapping) else None
        if not isinstance(apply, list) or not all(isinstance(a, Mapping) for a in apply):
            return None
        for k, a in enumerate(apply):
            listed, ignore = _listed(a.get("targets")), _listed(a.get("ignore", []))
            if listed is None or ignore is None:
                return None
            fld = f"quantization_config.transform_config.config_groups.{name}.apply.{k}"
            out.append(Transform(fld, listed, ignore, True))
    return tuple(out)
