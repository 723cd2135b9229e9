"""One entry per target `quant_method`, and what is asked of them: each draft module's scheme
(`decide`), the whole draft's tensors under them (`draft_tensors`), and whether a draft
directory holds exactly those (`check_served`, for `check --serve-with`).

An entry is a `TargetMethod` (base.py); a method not listed is refused naming the field, never
read as another.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from dsv4.convert.plan import Plan
from dsv4.convert.schemes import compressed_tensors, deepseek_fp8, modelopt, unquantised
from dsv4.convert.schemes.base import (
    ROUTES,
    Decision,
    ErrorFactory,
    LayerMap,
    ServePlan,
    TargetMethod,
    layer_map,
    module_of,
)
from dsv4.model.errors import DSV4Error
from dsv4.model.native import Layout, standalone_draft_layout

METHODS: dict[str | None, TargetMethod] = {
    entry.method: entry for entry in (deepseek_fp8.ENTRY, compressed_tensors.ENTRY, modelopt.ENTRY, unquantised.ENTRY)
}


def _known() -> str:
    return "; ".join(f"{m if m is not None else 'none'}: {entry.label}" for m, entry in METHODS.items())


def target_method(qc: object, where: str, error: ErrorFactory) -> TargetMethod:
    """The entry for a target's `quantization_config` (None: absent)."""
    if qc is None:
        return METHODS[None]
    if not isinstance(qc, Mapping):
        raise error(
            f"{where}: quantization_config is {type(qc).__name__}, expected an object",
            path=where,
            field="quantization_config",
        )
    method = qc.get("quant_method")
    entry = METHODS.get(method) if isinstance(method, str) else None
    if entry is None:
        raise error(
            f"{where}: quantization_config.quant_method {method!r} is not a quantisation method this converter "
            f"knows the draft's schemes for (it knows {_known()})",
            path=where,
            field="quantization_config.quant_method",
        )
    return entry


def _renumbered(target_config: Mapping[str, Any], layers: LayerMap, where: str, error: ErrorFactory) -> LayerMap:
    n = target_config.get("num_hidden_layers")
    if type(n) is not int or n < 1:
        raise error(
            f"{where}: num_hidden_layers is {n!r}, expected a positive integer", path=where, field="num_hidden_layers"
        )
    return layers.renumbered(n)


def decide(
    target_config: Mapping[str, Any], layers: LayerMap, native: Layout, where: str, error: ErrorFactory
) -> list[Decision]:
    """Each module of the draft (`layers`, numbered by the draft's own config) under the target
    whose config.json is `target_config` (read at `where`): named as the runtime names it
    beside that target (after its `num_hidden_layers`), with its scheme. `native` is the
    draft's native layout, what the schemes derive their tensors from."""
    renumbered = _renumbered(target_config, layers, where, error)
    qc = target_config.get("quantization_config")
    return target_method(qc, where, error).decide(qc, renumbered, native, where, error)


def serve_plan(
    target_config: Mapping[str, Any],
    layers: LayerMap,
    native: Layout,
    where: str,
    error: ErrorFactory,
    *,
    route: str = "auto",
    allow_lossy: bool = False,
) -> ServePlan:
    """The draft to write for the target whose config.json is `target_config` (read at
    `where`) by `route` (--draft-format; "auto" picks the exact route the target allows).
    A route the target's method cannot take exactly is refused naming the field, unless it
    is lossy and `allow_lossy`."""
    if route != "auto" and route not in ROUTES:
        raise error(f"--draft-format {route!r} is not one of auto, {', '.join(ROUTES)}", field="--draft-format")
    qc = target_config.get("quantization_config")
    entry = target_method(qc, where, error)
    if entry.serve is not None:
        assert qc is not None  # only the entries of a named method have routes of their own
        return entry.serve(
            qc, _renumbered(target_config, layers, where, error), native, where, error, route, allow_lossy
        )
    decisions = decide(target_config, layers, native, where, error)
    method = entry.method
    # the two entries of today: a DeepSeek fp8 target serves the native draft as it is; a
    # target with no quantisation config builds every draft layer bf16 (exact), no launch change
    chosen = {"fp8": "native", None: "match-target"}[method]
    if route not in ("auto", chosen):
        raise error(
            f"{where}: --draft-format {route} is not a route for a target of quant_method {method!r} "
            f"(it takes {chosen})",
            path=where,
            field="quantization_config.quant_method",
        )
    why = "a DeepSeek fp8 target serves the native draft" if method == "fp8" else "an unquantised target: bf16 draft"
    return ServePlan(chosen, decisions, None, dict(qc) if isinstance(qc, Mapping) else None, f"{route}: {why}")  # type: ignore[arg-type]


def provisional_serve_plan(
    target_config: Mapping[str, Any],
    layers: LayerMap,
    native: Layout,
    where: str,
    error: ErrorFactory,
    *,
    route: str = "auto",
    allow_lossy: bool = False,
) -> ServePlan | None:
    """`serve_plan`'s decisions read without the library the target's method validates with
    (its entry's `provisional`), its configs not yet made; None where the entry has no such
    reading, it cannot say, or `serve_plan` refuses what is asked: `serve_plan` decides."""
    qc = target_config.get("quantization_config")
    try:
        entry = target_method(qc, where, error)
        renumbered = _renumbered(target_config, layers, where, error)
    except DSV4Error:
        return None
    if entry.provisional is None or route not in ("auto", *ROUTES):
        return None
    return entry.provisional(qc, renumbered, native, where, error, route, allow_lossy)


def draft_tensors(decisions: list[Decision], native: Layout) -> Layout:
    """The draft's whole layout under `decisions`: each decided module's parts hold what its
    scheme takes, every other tensor (norms, hyper-connections) stays as in `native`."""
    decided = {part for d in decisions for part in d.parts}
    out = {name: spec for name, spec in native.items() if module_of(name) not in decided}
    for d in decisions:
        out.update(d.tensors(native))
    return out


def check_served(
    decisions: list[Decision],
    native: Layout,
    have: Mapping[str, tuple[str, tuple[int, ...]]],
    where: str,
    error: ErrorFactory,
) -> str:
    """Whether a draft directory holding `have` (name -> dtype, shape) is exactly what the
    decided schemes take; the first mismatch, naming its module and scheme, is refused."""
    want = draft_tensors(decisions, native)
    scheme_of = {part: d for d in decisions for part in d.parts}
    for name in sorted(want.keys() | have.keys()):
        mine, theirs = have.get(name), want.get(name)
        if mine == theirs:
            continue
        d = scheme_of.get(module_of(name))
        said = f"{d.module} is built {d.scheme.name} ({d.why})" if d is not None else "it is no quantisation layer's"
        held = f"{mine[0]} {list(mine[1])}" if mine else "absent"
        needed = f"{theirs[0]} {list(theirs[1])}" if theirs else "no such tensor"
        raise error(
            f"{where}: the draft's {name} is {held}, the target needs {needed}: {said}",
            path=where,
            tensor=name,
        )
    counts = Counter(d.scheme.name for d in decisions)
    said = ", ".join(f"{n} {scheme}" for scheme, n in sorted(counts.items()))
    return f"{len(decisions)} draft modules hold exactly what their schemes take ({said})"


def check_draft_served(
    target_config: Mapping[str, Any],
    plan: Plan,
    have: Mapping[str, tuple[str, tuple[int, ...]]],
    where: str,
    error: ErrorFactory,
) -> str:
    """`check_served` for a draft directory: its modules from `plan` (its forward xpu plan),
    the native layout its config describes as what the schemes start from, `have` its tensors."""
    native = standalone_draft_layout(plan.model_config)
    return check_served(decide(target_config, layer_map(plan), native, where, error), native, have, where, error)
