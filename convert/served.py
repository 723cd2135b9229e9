"""What a served draft's computed tensors add to a conversion's records: each one's measured
error in the journal (a resumed run does not compute a finished tensor again, yet records
it), and conversion.json's "serve" object.

conversion.json's "serve" holds "tensors": per computed tensor, its transform, the native
tensors it was made of, whether its scheme makes it exact (checked while it was computed:
an exact transform whose result differs from the native weight is refused), and, where a
weight was rebuilt to measure it, the max absolute error and the RMS error relative to the
native weight's RMS (0.0 and 0.0 for an exact one). A draft without computed tensors has no
"serve" object from here.

A draft with a lossy tensor (match-target --allow-lossy) also holds "agreement": the bundled model
run on the written draft and on the native source it was made from (convert/inmemory.py
match_target_figures: top-1 agreement where the native top-2 margin is decisive, the logits'
largest difference and relative RMS, on smoke's seeded inputs on the CPU), measured before the
output is published; for a hub source, read by byte ranges and never whole here, "measured":
false and why. Logits that are not finite (a NaN or an infinity in either run) are refused
(kind non_finite_agreement): such a draft is not published, and a figure that is not a number
has no place in conversion.json's strict JSON.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dsv4.convert.computed import Measured
from dsv4.convert.errors import PlanError
from dsv4.convert.plan import Plan
from dsv4.model.record import ConversionRecord

MEASURED = ("max_abs_error", "rel_rms_error")  # a journal entry's and the record's fields


def measured_fields(measured: Measured | None) -> dict[str, float]:
    """A computed tensor's journal fields (none for a copy or a scale's decoding)."""
    if measured is None:
        return {}
    return {"max_abs_error": measured.max_abs_error, "rel_rms_error": measured.rel_rms_error}


def measure_agreement(plan: Plan, draft: Path, native: Path | None) -> dict[str, Any] | None:
    """The "agreement" of draft directory `draft` (written, unpublished) with `native`, the local
    source it was made from (None: a hub source), when `plan` computes a lossy tensor; else None."""
    if not any(t.transform is not None and not t.transform.exact for t in plan.tensors):
        return None
    if native is None:
        why = "the source is a hub repo: run `convert-dsv4 smoke OUT --native SRC` with SRC a local copy of it"
        return {"measured": False, "why": why}
    from dsv4.convert.inmemory import match_target_figures  # torch, only for a lossy draft

    figures = match_target_figures(draft, native)
    for name in ("logits_max_abs", "logits_max_abs_diff", "logits_rel_rms"):
        if not math.isfinite(figures[name]):
            whose = "the native draft's" if name == "logits_max_abs" else "the lossy draft's"
            raise PlanError(
                f"{draft}: {whose} logits on smoke's seeded inputs are not finite ({name} {figures[name]}); "
                f"the draft's agreement with {native} cannot be measured, so nothing is published",
                kind="non_finite_agreement",
                path=str(draft),
            )
    return {"measured": True, **figures}


def recorded_agreement(out: Path) -> dict[str, Any] | None:
    """The agreement OUT's conversion.json records (a lossy served draft's), else None."""
    record = ConversionRecord.find(out)
    serve = record.serve if record is not None else None
    return serve.get("agreement") if serve is not None else None


def agreement_line(figures: dict[str, Any]) -> str:
    """One line of a lossy draft's agreement with its native source, as convert and smoke print it."""
    if not figures["measured"]:
        return f"agreement with the native draft: not measured ({figures['why']})"
    top1 = figures["top1_agreement"]
    said = "no row decisive" if top1 is None else f"{top1:.3f} over {figures['rows_compared']} decisive rows"
    return (
        f"agreement with the native draft ({figures['tokens']} tokens on {figures['device']}, seed {figures['seed']}): "
        f"top-1 {said} of {figures['rows']}; logits max|diff| {figures['logits_max_abs_diff']:.4g} "
        f"(max|logit| {figures['logits_max_abs']:.4g}), rel RMS {figures['logits_rel_rms']:.4g}"
    )


def serve_object(
    plan: Plan,
    journal: dict[str, dict[str, Any]],
    target: dict[str, Any] | None = None,
    agreement: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """conversion.json's "serve" object: `target`, the serving target's record (the target,
    the route, OUT/serve/'s files: convert/serving.py), the computed tensors of `plan`
    (every one finished, in `journal`) and a lossy draft's `agreement`; None for a draft made
    for no target that computes none."""
    tensors = {}
    for t in plan.tensors:
        if t.transform is None:
            continue
        entry = journal[t.name]
        tensors[t.name] = {
            "transform": t.transform.name,
            "inputs": [i.name for i in t.transform.inputs],
            "exact": t.transform.exact,
            **{k: entry[k] for k in MEASURED if k in entry},
        }
    if target is None and not tensors:
        return None
    return {
        **(target or {}),
        **({"tensors": tensors} if tensors else {}),
        **({"agreement": agreement} if agreement is not None else {}),
    }
