"""The checks of `convert-dsv4 check` against the bundled model (convert/check/run.py has the
order): layout (names, shapes and dtypes equal the target's layout, mapping/targets.py), quant
(every linear has a quantisation layer name and resolves to one scheme), smoke (a strict load
into the bundled model and a few-token forward; for DSpark one draft block; a draft directory
is mapped in memory into the bundled layout first, convert/inmemory.py; one written for a serving
target is loaded as its held forms say, convert/route_load.py) and native
(numerical parity with the reference on the native checkpoint)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from dsv4.convert import interrupts
from dsv4.convert.check.config import layout_target
from dsv4.convert.check.context import Context, Skipped, first_line, short
from dsv4.convert.errors import CheckError
from dsv4.convert.quant_config import check_draft_quantization
from dsv4.convert.route_load import Found, held_forms, is_held_for_a_target
from dsv4.convert.served import agreement_line, recorded_agreement
from dsv4.mapping.targets import bundled_target
from dsv4.model.checkpoint import INDEX_NAME
from dsv4.model.config import ModelConfig
from dsv4.model.errors import DSV4Error, LoadError
from dsv4.model.layout import build_draft_model
from dsv4.model.parity import parity_verdict


# --- layout ------------------------------------------------------------------------------
def check_layout(ctx: Context, details: dict[str, Any]) -> str:
    headers, cfg = ctx.need_headers(), ctx.need_config()
    target, layout = layout_target(ctx)
    found = {name: (src.dtype, src.shape) for name, src in headers.tensors.items()}
    if layout.kind.native_names and is_held_for_a_target(cfg, found):
        return _check_held_layout(ctx, cfg, found, details)
    want = layout.layout(cfg)
    missing = sorted(set(want) - set(headers.tensors))
    unexpected = sorted(set(headers.tensors) - set(want))
    both = sorted(set(want) & set(headers.tensors))
    shape = [
        f"{n} is {list(headers.tensors[n].shape)} in {headers.tensors[n].file}, expected {list(want[n][1])}"
        for n in both
        if headers.tensors[n].shape != want[n][1]
    ]
    dtype = [
        f"{n} is {headers.tensors[n].dtype} in {headers.tensors[n].file}, expected {want[n][0]}"
        for n in both
        if headers.tensors[n].dtype != want[n][0]
    ]
    details.update(missing=missing, unexpected=unexpected, shape=shape, dtype=dtype)
    findings: list[tuple[Callable[..., CheckError], str]] = []
    if missing:
        findings.append((partial(CheckError, kind="missing_tensors"), f"{len(missing)} missing: {short(missing)}"))
    if unexpected:
        findings.append(
            (
                partial(CheckError, kind="unexpected_tensors"),
                f"{len(unexpected)} unexpected: {short([f'{n} in {headers.tensors[n].file}' for n in unexpected])}",
            )
        )
    if shape:
        findings.append((partial(CheckError, kind="tensor_shape"), f"{len(shape)} mis-shaped: {short(shape)}"))
    if dtype:
        findings.append((partial(CheckError, kind="tensor_dtype"), f"{len(dtype)} of the wrong dtype: {short(dtype)}"))
    if findings:
        raise findings[0][0](
            f"{ctx.where(INDEX_NAME)}: not the {cfg.expert_dtype} {target} layout: "
            + "; ".join(text for _, text in findings)
        )
    return f"all {len(want)} tensors of the {target} layout present with their shapes and dtypes, nothing else"


HELD_REFUSALS = {  # the strict loader's refusal -> the layout check's finding
    "missing_key": "missing_tensors",
    "unexpected_key": "unexpected_tensors",
    "shape_mismatch": "tensor_shape",
    "dtype_mismatch": "tensor_dtype",
}


def _check_held_layout(ctx: Context, cfg: ModelConfig, found: Found, details: dict[str, Any]) -> str:
    """A draft written for a serving target: each native linear in one form the bundled model decodes
    (model/storage.py HELD_LINEARS), every other tensor as the native draft holds it. Which forms the
    target takes is the serve check's (--serve-with)."""
    try:
        forms = held_forms(cfg, found, ctx.where(INDEX_NAME))
    except LoadError as exc:
        raise CheckError(str(exc), kind=HELD_REFUSALS[exc.kind], path=exc.path, tensor=exc.tensor) from None
    counts = Counter(form.name for form in forms.values())
    details["held"] = dict(sorted(counts.items()))
    said = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
    return f"a draft for a serving target: its {len(forms)} linears held as {said}, the rest as the native draft's"


# --- quantisation ------------------------------------------------------------------------
def check_quant(ctx: Context, details: dict[str, Any]) -> str:
    cfg = ctx.need_config()
    assert ctx.config is not None  # a parsed cfg implies a parsed config.json
    config = ctx.config
    native_names = layout_target(ctx)[1].kind.native_names
    if native_names and is_held_for_a_target(
        cfg, {n: (t.dtype, t.shape) for n, t in ctx.need_headers().tensors.items()}
    ):
        raise Skipped(
            "a draft for a serving target: the schemes its layers are built with are the target's (--serve-with)"
        )
    if native_names:
        # native module names: the quantisation layer names are those of the bundled layout's
        # conversion of this directory, whose config.json the converter rewrites (convert/quant_config.py)
        from dsv4.convert.pipeline import output_config

        try:
            config = output_config(ctx.bundled_plan())
        except DSV4Error as exc:
            if exc.kind == "quant_carry":  # the bundled layout's conversion would refuse this quantization_config
                raise CheckError(str(exc), kind="quant_scheme") from None
            raise Skipped(
                f"needs the {bundled_target().name} plan of this draft directory: {first_line(exc)}"
            ) from None
    summary = check_draft_quantization(build_draft_model(cfg), config, ctx.config_where)
    if summary.library_missing:
        raise Skipped(summary.reason)
    details.update(layers=summary.layers, schemes_checked=summary.schemes_checked)
    return summary.reason


# --- smoke and native parity -------------------------------------------------------------
def check_smoke(ctx: Context, details: dict[str, Any]) -> str:
    if not (ctx.smoke or ctx.native):
        raise Skipped("not requested (--smoke or --native)")
    if "layout" not in ctx.passed:
        raise Skipped("needs the target layout (layout check failed): a strict load would fail")
    from dsv4.convert.inmemory import model_loader
    from dsv4.model.smoke import run_dspark_smoke, run_smoke  # imports the reference and kernels: only here

    dspark = ctx.need_config().is_dspark
    try:
        # a draft directory (native names): the bundled layout's plan (the quant check's), in memory
        load = model_loader(ctx.root, ctx.bundled_plan)
        # DSpark: one draft block from a context of `tokens` random target features
        report = (
            run_dspark_smoke(ctx.root, ctx.device, ctx.tokens, reference_dir=ctx.native, load=load)
            if dspark
            else run_smoke(ctx.root, ctx.device, ctx.tokens, ctx.native, load=load)
        )
    except Exception as exc:  # a failed load or forward, whatever raised it, is this check's finding
        interrupts.raise_if_interrupted()
        said = first_line(exc)
        raise CheckError(said if str(ctx.root) in said else f"{ctx.root}: {said}", kind="smoke_failed") from None
    ctx.smoke_report = report
    if dspark:
        details.update(
            {
                k: report[k]
                for k in (
                    "device",
                    "kernels",
                    "hidden_shape",
                    "logits_shape",
                    "draft_tokens",
                    "load_ms",
                    "hidden_warm_ms",
                    "logits_warm_ms",
                    "confidence",
                )
                if k in report  # confidence: V4.1's drafter only
            }
        )
        return (
            f"strict load and one DSpark block ({ctx.tokens}-token context) on {report['device']}: hidden "
            f"{report['hidden_shape']}, logits {report['logits_shape']}, draft tokens {report['draft_tokens']}, "
            f"finite; fused norms: {report['kernels']}"
        )
    details.update(
        {k: report[k] for k in ("device", "kernels", "hidden_shape", "logits_shape", "load_ms", "forward_warm_ms")}
    )
    return (
        f"strict load and {ctx.tokens}-token forward on {report['device']}: hidden {report['hidden_shape']}, logits "
        f"{report['logits_shape']}, finite; fused norms: {report['kernels']}"
    )


def check_native(ctx: Context, details: dict[str, Any]) -> str:
    if ctx.native is None:
        raise Skipped("not requested (--native SRC)")
    if ctx.smoke_report is None:
        raise Skipped("needs the smoke run (smoke check failed or was skipped)")
    if recorded_agreement(ctx.root) is not None:  # a lossy match-target draft: as `smoke --native` reports it
        from dsv4.convert.inmemory import match_target_figures

        figures = match_target_figures(ctx.root, ctx.native, ctx.smoke_report["device"], ctx.tokens)
        details["agreement"] = {"measured": True, **figures}
        return f"{agreement_line(details['agreement'])}; a lossy match-target draft, not held to parity"
    passed, said = parity_verdict(ctx.smoke_report, ctx.min_top1, ctx.max_rel_diff)  # the rule of `smoke --native`
    details.update({k: v for k, v in ctx.smoke_report.items() if k in PARITY_DETAILS})
    if not passed:
        raise CheckError(
            f"{ctx.root}: differs from the reference on {ctx.native}: {said}", kind="native_parity", path=str(ctx.root)
        )
    return f"agrees with the reference on {ctx.native}: {said}"


PARITY_DETAILS = (
    "hidden_max_abs_diff",
    "hidden_max_abs",
    "logits_max_abs_diff",
    "logits_max_abs",
    "top1_agreement",
    "top1_agreement_up_to_ties",
    "routing_disagreements",
    "draft_tokens",
    "reference_draft_tokens",
    "draft_token_agreement",
)
