"""The serve check of `convert-dsv4 check DIR --serve-with TARGET` (convert/check/run.py has the
order): a draft directory against the target model it is to be served beside. vLLM builds
the draft's layers from the target's config and quantisation, so those fields must be the
draft's own, and each draft module must hold what the scheme the target gives it takes
(convert/schemes/)."""

from __future__ import annotations

from functools import partial
from typing import Any

from dsv4.convert.check.config import layout_target
from dsv4.convert.check.context import Context, Skipped, first_line
from dsv4.convert.errors import CheckError
from dsv4.convert.plan import Plan
from dsv4.convert.route_load import native_plan
from dsv4.convert.schemes.base import layer_map
from dsv4.convert.schemes.registry import check_draft_served, serve_plan
from dsv4.convert.serving import OVERRIDES_FILE
from dsv4.convert.serving_target import ServingTarget, first_difference, read_serving_target, serve_fields
from dsv4.mapping.targets import serving_targets
from dsv4.model.checkpoint import CONFIG
from dsv4.model.config import ModelConfig
from dsv4.model.config_v41 import V41_MODEL_TYPE
from dsv4.model.errors import DSV4Error
from dsv4.model.native import standalone_draft_layout
from dsv4.model.record import brief
from dsv4.model.strictjson import StrictJSONError, loads, read_record_bytes

SERVE_MISMATCH = partial(CheckError, kind="serve_mismatch")


def _target(ctx: Context) -> ServingTarget:
    """The serving target --serve-with names (a directory, a config.json or a hub repo), its
    model fields unchecked: the check compares them with the draft's."""
    assert ctx.serve_with is not None
    try:
        return read_serving_target(ctx.serve_with, model_fields=False)
    except (OSError, DSV4Error) as exc:  # a config error names its file already: said once
        where = getattr(exc, "path", None) or str(ctx.serve_with)
        raise SERVE_MISMATCH(
            f"{where}: cannot read the target's config: {first_line(exc).removeprefix(f'{where}: ')}", path=where
        ) from None


def _overrides(ctx: Context) -> dict[str, Any]:
    """The draft's launch overrides (OUT/serve/vllm-hf-overrides.json), {} without the file:
    vLLM sets each of its top-level fields on the target's config before it builds anything
    (config/model.py 555-568, 691-692), so the target the draft is checked against has them."""
    path = ctx.root / OVERRIDES_FILE
    if not path.exists():
        return {}
    try:
        value = loads(read_record_bytes(path))
    except (OSError, StrictJSONError) as exc:
        raise SERVE_MISMATCH(
            f"{path}: cannot read the draft's launch overrides: {first_line(exc)}", path=str(path)
        ) from None
    if not isinstance(value, dict):
        raise SERVE_MISMATCH(f"{path}: the launch overrides are {brief(value)}, not a JSON object", path=str(path))
    return value


def _refuse_foreign_overrides(ctx: Context, target: ServingTarget, overrides: dict[str, Any], plan: Plan) -> None:
    """The overrides replace the target's whole quantization_config (vLLM sets it wholesale), so
    a file made for another target would rebuild this target's own layers too: it must be what
    this target's config and the draft's route (conversion.json's; else overlay or bf16) make."""
    recorded = (ctx.record.serve or {}).get("route") if ctx.record is not None else None
    layers, native = layer_map(plan), standalone_draft_layout(plan.model_config)
    made: dict[str, Any] = {}
    for route in [recorded] if isinstance(recorded, str) else ["overlay", "bf16"]:
        try:
            made = serve_plan(target.config, layers, native, target.where, SERVE_MISMATCH, route=route).overrides or {}
        except CheckError:
            continue
        if made == overrides:
            return
    path = ctx.root / OVERRIDES_FILE
    field = (first_difference(overrides, made, ("quantization_config",)) or ("quantization_config",))[0]
    raise SERVE_MISMATCH(
        f"{path}: {field} is not what {target.where} and the draft's route make: made for another target, "
        "these overrides would rebuild that target's own layers too",
        path=str(path),
        field=field,
    )


def _dspark_effective(draft: dict[str, Any], effective: dict[str, Any], where: str) -> dict[str, Any]:
    """vLLM builds a DSpark draft's layers from the DRAFT's own quantization_config under the
    target's method name (v1/worker/gpu/spec_decode/dspark/utils.py:115-117,
    config/speculative.py:1564-1566): the method must be the target's, the rest is the draft's."""
    mine, theirs = draft.get("quantization_config"), effective.get("quantization_config")
    method = (theirs or {}).get("quant_method") if isinstance(theirs, dict) else None
    if (mine or {}).get("quant_method") != method:
        raise SERVE_MISMATCH(
            f"{where}: quantization_config.quant_method is {brief(method)}, the DSpark draft's is "
            f"{brief((mine or {}).get('quant_method'))}: vLLM reads the draft's config under the target's method",
            path=where,
            field="quantization_config.quant_method",
        )
    return {**effective, "quantization_config": mine}


def check_serve(ctx: Context, details: dict[str, Any]) -> str:
    if ctx.serve_with is None:
        raise Skipped("not requested (--serve-with TARGET)")
    if ctx.config is None:
        raise Skipped(f"needs the draft's config.json: {ctx.config_error}")
    name, layout = layout_target(ctx)
    if not layout.kind.native_names:
        raise Skipped(
            f"only a --target {' or '.join(serving_targets())} output is served beside a target model (this one is "
            f"{name!r})"
        )
    target = _target(ctx)
    where = target.where
    if ctx.config.get("model_type") == V41_MODEL_TYPE:  # as convert's --serve-with refuses one (convert/serving.py)
        raise SERVE_MISMATCH(
            f"{ctx.root}: --serve-with is not built for DeepSeek V4.1 drafts (no quantised V4.1 target has been "
            f"modelled), so whether it loads beside {where} is not known; vLLM and SGLang serve it beside the V4.1 "
            "model it comes from",
            path=str(ctx.root),
        )
    # the draft's modules from the native layout its config describes, not from its tensors, which
    # a route has renamed (weight_scale, weight_packed) where the xpu table knows native names only
    try:
        plan = native_plan(ModelConfig.from_dict(ctx.config, str(ctx.root / CONFIG)), ctx.config, str(ctx.root))
    except DSV4Error as exc:
        raise Skipped(f"needs the xpu plan of the draft's native layout: {first_line(exc)}") from None
    overrides = _overrides(ctx)
    if overrides:
        _refuse_foreign_overrides(ctx, target, overrides, plan)
    effective = {**target.config, **overrides}
    if plan.identity.drafter == "dspark":
        effective = _dspark_effective(ctx.config, effective, where)
    with_overrides = f" (with {ctx.root / OVERRIDES_FILE} applied)" if overrides else ""
    found = first_difference(ctx.config, effective, serve_fields())
    if found is not None:
        key, mine, theirs = found
        details.update(field=key)
        raise SERVE_MISMATCH(
            f"{where}: {key} is {brief(theirs)}{with_overrides}, the draft's is {brief(mine)}: "
            f"{layout.runtime_named('vLLM')} builds the draft's layers from the "
            "target's config and quantisation, so this draft would not load beside it (serve it beside the "
            "checkpoint it was converted from)",
            path=where,
            field=key,
        )
    # and each draft module holds what the scheme the target gives it takes (convert/schemes/)
    have = {name: (t.dtype, tuple(t.shape)) for name, t in ctx.need_headers().tensors.items()}
    served = check_draft_served(effective, plan, have, where, SERVE_MISMATCH)
    return (
        f"{where}{with_overrides}: the {len(serve_fields())} config fields vLLM builds the draft's layers from "
        f"(quantization_config included) are the draft's own; {served}"
    )
