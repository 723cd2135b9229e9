"""The serve check of `convert-dsv4 check DIR --serve-with TARGET` (convert/check/run.py has the
order): a draft directory against the target model it is to be served beside. vLLM builds
the draft's layers from the target's config and quantisation, so those fields must be the
draft's own, and each draft module must hold what the scheme the target gives it takes
(convert/schemes/)."""

from __future__ import annotations

from dataclasses import fields
from functools import partial
from typing import Any

from dsv4.convert.check.config import ABSENT, layout_target
from dsv4.convert.check.context import Context, Skipped, first_line
from dsv4.convert.errors import CheckError
from dsv4.convert.schemes.registry import check_draft_served
from dsv4.mapping.targets import serving_targets
from dsv4.model.checkpoint import CONFIG
from dsv4.model.config import ModelConfig, parse_config
from dsv4.model.errors import DSV4Error
from dsv4.model.record import RUNTIME_CONFIG_FIELDS, brief


# vLLM builds a draft's layers from the TARGET's config and quantisation config (line numbers
# at the vLLM version of mapping/targets/draft.toml: model_loader/utils.py:93-101 with the
# target's vllm_config; xpu/mtp.py:76, 89, 97, 176-178; speculative.py:1564-1566 gives a V4
# DSpark draft the target's quantisation method): every field the layers are built from must
# be the draft's own. NOTES.md, "Serving a draft".
def _serve_fields() -> tuple[str, ...]:
    model_fields = sorted({f.name for f in fields(ModelConfig)} - set(RUNTIME_CONFIG_FIELDS))
    return (*RUNTIME_CONFIG_FIELDS, *model_fields)


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
    where = ctx.serve_with / CONFIG if ctx.serve_with.is_dir() else ctx.serve_with
    try:
        target = parse_config(where.read_bytes(), str(where))
    except (OSError, DSV4Error) as exc:  # a config error names `where` already: said once
        raise CheckError(
            f"{where}: cannot read the target's config: {first_line(exc).removeprefix(f'{where}: ')}",
            kind="serve_mismatch",
            path=str(where),
        ) from None
    for key in _serve_fields():
        mine, theirs = ctx.config.get(key, ABSENT), target.get(key, ABSENT)
        if isinstance(mine, dict) and isinstance(theirs, dict):  # name the first sub-field that differs
            sub = next(
                (k for k in sorted(mine.keys() | theirs.keys()) if mine.get(k, ABSENT) != theirs.get(k, ABSENT)), None
            )
            key, mine, theirs = (
                (f"{key}.{sub}", mine.get(sub, ABSENT), theirs.get(sub, ABSENT)) if sub else (key, mine, theirs)
            )
        if mine != theirs:
            details.update(field=key)
            raise CheckError(
                f"{where}: {key} is {brief(theirs)}, the draft's is {brief(mine)}: "
                f"{layout.runtime_named('vLLM')} builds the draft's layers from the "
                "target's config and quantisation, so this draft would not load beside it (serve it beside the "
                "checkpoint it was converted from)",
                kind="serve_mismatch",
                path=str(where),
                field=key,
            )
    # and each draft module holds what the scheme the target gives it takes (convert/schemes/)
    try:
        plan = ctx.bundled_plan()
    except DSV4Error as exc:
        raise Skipped(f"needs the xpu plan of this draft directory: {first_line(exc)}") from None
    have = {name: (t.dtype, tuple(t.shape)) for name, t in ctx.need_headers().tensors.items()}
    served = check_draft_served(target, plan, have, str(where), partial(CheckError, kind="serve_mismatch"))
    return (
        f"{where}: the {len(_serve_fields())} config fields vLLM builds the draft's layers from (quantization_config "
        f"included) are the draft's own; {served}"
    )
