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
from dsv4.convert.schemes.registry import check_draft_served
from dsv4.convert.serving import OVERRIDES_FILE
from dsv4.convert.serving_target import ServingTarget, first_difference, read_serving_target, serve_fields
from dsv4.mapping.targets import serving_targets
from dsv4.model.errors import DSV4Error
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
    overrides = _overrides(ctx)
    effective = {**target.config, **overrides}
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
    try:
        plan = ctx.bundled_plan()
    except DSV4Error as exc:
        raise Skipped(f"needs the xpu plan of this draft directory: {first_line(exc)}") from None
    have = {name: (t.dtype, tuple(t.shape)) for name, t in ctx.need_headers().tensors.items()}
    served = check_draft_served(effective, plan, have, where, SERVE_MISMATCH)
    return (
        f"{where}{with_overrides}: the {len(serve_fields())} config fields vLLM builds the draft's layers from "
        f"(quantization_config included) are the draft's own; {served}"
    )
