"""A compressed-tensors serving target (`quant_method: compressed-tensors`).

vLLM 0.33.0 builds the V4 MTP draft with the TARGET's quantisation config object: the draft's
VllmConfig keeps it (v1/spec_decode/llm_base_proposer.py:1265-1316, config/vllm.py:1607-1610)
and every V4 MTP layer reads vllm_config.quant_config (nvidia/mtp.py:92, xpu/mtp.py:76,
amd/mtp.py:75). So each draft module gets what the target's config gives its runtime name
(ct_match.py), and the only lever is the launch's `--hf-overrides '{"quantization_config": ...}'`,
which replaces the attribute wholesale (config/model.py:555-568, 691-692). The routes:

* match-target: the target's config as it is; each module in the target's scheme (exact for
  FP8 block and MXFP4 experts, a requantisation otherwise, refused where an activation scale
  needs calibration);
* overlay: the target's config with config groups anchored on the draft's layers placed FIRST
  (vLLM takes the first target whose pattern matches the name, compressed_tensors/utils.py:105-130), FP8 block for
  the linears, MXFP4 (FP4 experts) or FP8 block (FP8 experts) for the routed experts: exact;
* bf16: the draft's layers added to `ignore` (checked before targets), weights dequantised
  (exact), but wo_a keeps an FP8 block group: vLLM XPU runs wo_a only through its FP8 kernel
  (xpu/xpu_sparse.py:107-118).
Both overlays add the draft's layers to every transform's ignore, so no transform wraps them.

DSpark drafts are built from the draft's OWN config under the target's method name
(v1/worker/gpu/spec_decode/dspark/utils.py:115-117, config/speculative.py:1564-1566), with no
name mapper or fused-module mapping (nvidia/dspark.py:348-373): the draft's config.json gets a
config of its own whose groups name its layers, and the launch stays as it is. vLLM's NVIDIA
DSpark class also builds `model.context_wkv_proj` with that config (nvidia/dspark.py:142-150) and
loads every stage's wkv tensors into it without a check (:72-86, 483, 514-518); the XPU and AMD
classes have no such layer (they take the context KV from fused_wqa_wkv, xpu/dspark.py:134-142,
amd/dspark.py:166-174). So the draft's config gives it the group of the wkv's layer, and a config
that gives it another scheme is refused.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from dsv4.convert.schemes.base import (
    UNQUANTISED,
    Decision,
    ErrorFactory,
    LayerMap,
    Route,
    Scheme,
    ServePlan,
    TargetMethod,
)
from dsv4.convert.schemes.ct_config import UNVERIFIED, CtConfig, Group, parse, provisional
from dsv4.convert.schemes.ct_match import (
    IGNORED,
    NEVER_QUANTISED,
    PLATFORMS,
    DraftModule,
    Refused,
    Resolver,
    regex_table,
    transformed,
    vllm_name,
)
from dsv4.convert.schemes.ct_overlay import (
    CONTEXT_WKV,
    WO_A,
    dspark_config,
    is_dspark,
    overlaid,
    storage,
    unread_body,
)
from dsv4.convert.schemes.ct_schemes import CT_FP8_BLOCK, is_lossy, scheme_for
from dsv4.model.errors import DSV4Error
from dsv4.model.native import Layout

METHOD = "compressed-tensors"


def _wkv_layers(layers: LayerMap) -> list[str]:
    """The draft modules a stage's wkv is a part of (fused_wqa_wkv)."""
    return [m for m, parts in layers.parts.items() if any(p.endswith(".attn.wkv") for p in parts)]


def _modules(layers: LayerMap) -> dict[str, DraftModule]:
    return {m: DraftModule(vllm_name(m), layers.kinds[m]) for m in layers.parts}


def _pair_of(layers: LayerMap, module: str):
    """The parts of `module` that share one NVFP4 global scale: a fused pair, or an expert's w1/w3."""
    parts = layers.parts[module]

    def pair(part: str) -> tuple[str, ...]:
        if layers.kinds[module] != "moe":
            return parts
        stem, leaf = part.rsplit(".", 1)
        return (f"{stem}.w1", f"{stem}.w3") if leaf in ("w1", "w3") else (part,)

    return pair


def _outcomes(
    config: CtConfig, layers: LayerMap, where: str, error: ErrorFactory, *, target_model: bool
) -> dict[str, Group | str | None]:
    """Per draft module what `config` gives it on every platform; a module the platforms
    disagree on, one vLLM would refuse, or one an online transform would wrap is refused."""
    modules = _modules(layers)
    quantised = {m: d for m, d in modules.items() if not NEVER_QUANTISED.search(d.name)}
    context = [CONTEXT_WKV] if is_dspark(layers) else []
    regex = regex_table(config, [*quantised.values(), *context], where, error)
    n = layers.num_hidden_layers
    n_mtp = len({int(m.split(".")[2]) for m in layers.parts if m.startswith("model.layers.")})
    out: dict[str, Group | str | None] = {m: None for m in modules}
    for platform in PLATFORMS:
        resolver = Resolver(config, platform, n, n_mtp, regex, target_model=target_model)
        for m, d in quantised.items():
            try:
                found = resolver.resolve(d)
            except Refused as exc:
                raise error(f"{where}: {exc} (on {platform})", path=where, field=exc.field) from None
            # vLLM wraps a linear in its transforms whether or not the quantisation ignores it
            # (compressed_tensors.py:162-181)
            tf = transformed(config, d, platform, regex)
            if tf is not None:
                raise error(
                    f"{where}: {tf} wraps the draft's {d.name} on {platform} in an online transform; "
                    "its weights would have to be rotated",
                    path=where,
                    field=tf,
                )
            if platform != PLATFORMS[0] and _key(found) != _key(out[m]):
                raise error(
                    f"{where}: quantization_config gives {d.name} {_said(out[m])} on {PLATFORMS[0]} "
                    f"but {_said(found)} on {platform}; one draft directory cannot serve both",
                    path=where,
                    field="quantization_config",
                )
            out[m] = found
    if context:
        _check_context_wkv(Resolver(config, "nvidia", n, n_mtp, regex, target_model=False), layers, out, where, error)
    return out


def _check_context_wkv(
    nvidia: Resolver, layers: LayerMap, out: Mapping[str, Group | str | None], where: str, error: ErrorFactory
) -> None:
    """NVIDIA's DSpark loads every stage's wkv tensors into model.context_wkv_proj as well
    as into fused_wqa_wkv: both must get one scheme (unquantised, or the same group's), or the
    load raises KeyError (a weight_scale with no parameter) or copies FP8 codes into bf16 as
    numbers."""

    def scheme(found: Group | str | None) -> object:
        return _key(found) if isinstance(found, Group) else None  # ignored or no target: bf16 alike

    try:
        found = nvidia.resolve(CONTEXT_WKV)
    except Refused as exc:
        raise error(f"{where}: {exc} (on nvidia)", path=where, field=exc.field) from None
    for m in _wkv_layers(layers):
        if scheme(found) != scheme(out[m]):
            raise error(
                f"{where}: quantization_config gives {CONTEXT_WKV.name} {_said(found)} on nvidia but the draft's "
                f"wkv ({vllm_name(m)}) {_said(out[m])}; vLLM's NVIDIA DSpark loads the wkv tensors into both "
                "(nvidia/dspark.py:72-86, 514-518), its XPU and AMD classes have no context_wkv_proj",
                path=where,
                field="quantization_config.config_groups",
            )


def _key(found: Group | str | None) -> object:
    return (found.scheme, repr(found.weights), found.format) if isinstance(found, Group) else found


class Unverified(Exception):
    """A provisional reading reached a group whose scheme only compressed-tensors can say."""


def _said(found: Group | str | None) -> str:
    return (
        f"{found.name} ({found.scheme})" if isinstance(found, Group) else "ignore" if found == IGNORED else "no scheme"
    )


def _decisions(
    config: CtConfig,
    layers: LayerMap,
    native: Layout,
    where: str,
    error: ErrorFactory,
    *,
    allow_lossy: bool,
    why: str,
    target_model: bool = True,
) -> list[Decision]:
    outcomes = _outcomes(config, layers, where, error, target_model=target_model)
    out = []
    for m, found in outcomes.items():
        name, kind, parts = vllm_name(m), layers.kinds[m], layers.parts[m]
        if not isinstance(found, Group):
            scheme, said = UNQUANTISED, f"{why}: {'ignored' if found == IGNORED else 'no target'}, bf16"
        else:
            if name.endswith(".head"):
                raise error(
                    f"{where}: {found.field} quantises the draft's head {name}; this converter ships it bf16",
                    path=where,
                    field=f"{found.field}.targets",
                )
            if found.scheme == UNVERIFIED:  # a provisional reading's target group: only the library can say
                raise Unverified(found.field)
            scheme, calibrate = scheme_for(
                found, storage(layers, m, native), _pair_of(layers, m), experts=kind == "moe"
            )
            if calibrate is not None:
                raise error(
                    f"{where}: {found.field} gives {name} a calibrated {calibrate} (static activation scale); "
                    "it cannot be made without calibration data",
                    path=where,
                    field=f"{found.field}.input_activations",
                )
            if is_lossy(scheme) and not allow_lossy:
                raise error(
                    f"{where}: {found.field} ({found.scheme}) makes {name} a lossy requantisation; "
                    "pass --allow-lossy to write it, or take --draft-format overlay (exact)",
                    path=where,
                    field=f"{found.field}.weights",
                )
            said = f"{why}: {found.name} ({found.scheme})"
        _check_wo_a(name, scheme, found, where, error)
        out.append(Decision(name, kind, parts, scheme, said))
    return out


def _check_wo_a(name: str, scheme: Scheme, found: Group | str | None, where: str, error: ErrorFactory) -> None:
    """V4's O-projection reads wo_a's tensors itself: FP8 or bf16 on NVIDIA
    (nvidia/ops/o_proj.py:61-103), FP8 only on XPU (xpu/xpu_sparse.py:107-118). The refusal
    names what gives wo_a its scheme: the ignore list, the want of a target, or the group."""
    if not name.endswith(WO_A) or scheme is CT_FP8_BLOCK:
        return
    platforms = "xpu" if scheme is UNQUANTISED else "nvidia and xpu"
    field = (
        found.field
        if isinstance(found, Group)
        else f"quantization_config.{'ignore' if found == IGNORED else 'config_groups'}"
    )
    cause = "covers it" if found == IGNORED else "has no group for it" if found is None else "gives it that scheme"
    raise error(
        f"{where}: the draft's {name} would be {scheme.name}, which vLLM's V4 O-projection cannot read on {platforms} "
        f"(it runs wo_a through its FP8 kernel): {field} {cause}",
        path=where,
        field=field,
    )


def decide(
    qc: Mapping[str, Any] | None, layers: LayerMap, native: Layout, where: str, error: ErrorFactory
) -> list[Decision]:
    """The target's own scheme for each module (lossy ones included: what vLLM builds)."""
    assert qc is not None
    return _decisions(
        parse(qc, where, error), layers, native, where, error, allow_lossy=True, why="the target's config"
    )


def serve(
    qc: Mapping[str, Any],
    layers: LayerMap,
    native: Layout,
    where: str,
    error: ErrorFactory,
    route: str,
    allow_lossy: bool,
) -> ServePlan:
    config = parse(qc, where, error)  # refuses what it cannot read before any route is chosen
    if is_dspark(layers):
        return _serve_dspark(qc, layers, native, where, error, route)
    if route == "native":
        raise error(
            f"{where}: --draft-format native: vLLM builds the MTP draft with this compressed-tensors config, which "
            "has no parameter for the native .scale tensors (take overlay, bf16 or match-target; for SGLang, which "
            "builds the draft from the draft's own config.json, convert without --serve-with)",
            path=where,
            field="quantization_config.quant_method",
        )
    if route == "match-target":
        decisions = _decisions(config, layers, native, where, error, allow_lossy=allow_lossy, why="match-target")
        lossy = any(is_lossy(d.scheme) for d in decisions)
        why = "the target's own schemes, no launch change" + (" (lossy requantisation allowed)" if lossy else "")
        return ServePlan("match-target", decisions, None, dict(qc), f"{route}: {why}")
    chosen, why = _overlay_route(route)
    effective = overlay_config(qc, layers, native, bf16=chosen == "bf16")
    decisions = _decisions(parse(effective, where, error), layers, native, where, error, allow_lossy=False, why=chosen)
    # the draft's own config.json says what its layers are built with; vLLM builds them with the
    # target's object (which the overrides make the same), and only refuses a draft config whose
    # method disagrees with an explicit speculative quantization (config/model.py:1454-1462)
    return ServePlan(chosen, decisions, {"quantization_config": effective}, effective, why)


def _overlay_route(route: str) -> tuple[Route, str]:
    """The overlay route `route` takes (bf16, or overlay for overlay and auto) and why."""
    if route == "bf16":
        return "bf16", f"{route}: the draft's layers ignored at launch (bf16, exact), wo_a in an FP8 block group"
    return "overlay", f"{route}: FP8 block / MXFP4 groups for the draft's layers at launch (exact)"


DSPARK_WHY = "the DSpark draft's own config names its layers (exact), no launch change"


def overlay_config(qc: Mapping[str, Any], layers: LayerMap, native: Layout, *, bf16: bool) -> dict[str, Any]:
    """The target's config with the draft's compressed-tensors preset groups first (ct_overlay.py)."""
    return overlaid(qc, layers, native, bf16=bf16)[0]


def _serve_dspark(
    qc: Mapping[str, Any], layers: LayerMap, native: Layout, where: str, error: ErrorFactory, route: str
) -> ServePlan:
    if route not in ("auto", "overlay"):
        raise error(
            f"{where}: --draft-format {route}: a DSpark draft is built from its own config.json under the target's "
            "method (dspark/utils.py:115-117), which the converter writes; take auto or overlay",
            path=where,
            field="--draft-format",
        )
    own = dspark_config(layers, native)[0]
    decisions = _decisions(
        parse(own, where, error), layers, native, where, error, allow_lossy=False, why="dspark", target_model=False
    )
    return ServePlan("overlay", decisions, None, own, f"{route}: {DSPARK_WHY}")


def library_imported() -> bool:
    """Whether compressed-tensors is imported in this process already (a batch, a program):
    reading with it then costs milliseconds, nothing for a provisional reading to hide."""
    return "compressed_tensors" in sys.modules


def provisional_serve(
    qc: Mapping[str, Any],
    layers: LayerMap,
    native: Layout,
    where: str,
    error: ErrorFactory,
    route: str,
    allow_lossy: bool,
) -> ServePlan | None:
    """`serve`'s decisions for the routes whose tensors need nothing of compressed-tensors (the
    overlays: renamed bytes, widened scales, dequantised weights), read without the library
    (ct_config.provisional), so that the conversion need not wait for its import (its package
    imports torch and transformers: seconds). The library's `serve` runs meanwhile in another
    process and is the authority (convert/verdict.py): its decisions must equal these and its
    configs are the ones written, before anything is published. The plan has no configs yet
    (None). None where the decisions depend on what only the library says (a target group's
    scheme, a transform, a refusal) or where the library is imported: `serve` then decides
    before anything is written."""
    dspark = is_dspark(layers)
    if route not in (("auto", "overlay") if dspark else ("auto", "overlay", "bf16")) or library_imported():
        return None
    if provisional(qc, {}) is None:
        return None
    if dspark:
        effective, own = dspark_config(layers, native, unread_body)
    else:
        chosen, why = _overlay_route(route)
        effective, own = overlaid(qc, layers, native, bf16=chosen == "bf16", body=unread_body)
    config = provisional(effective, own)
    if config is None:
        return None
    try:
        decisions = _decisions(
            config,
            layers,
            native,
            where,
            error,
            allow_lossy=False,
            why="dspark" if dspark else chosen,
            target_model=not dspark,
        )
    except (Unverified, DSV4Error):
        return None
    if dspark:
        return ServePlan("overlay", decisions, None, None, f"{route}: {DSPARK_WHY}")
    return ServePlan(chosen, decisions, None, None, why)


ENTRY = TargetMethod(
    METHOD,
    "compressed-tensors (FP8_BLOCK, W4A16/W8A16, NVFP4A16, NVFP4, MXFP4A16, MXFP4)",
    decide,
    serve,
    provisional_serve,
)
