"""What a served draft's computed tensors add to a conversion's records: each one's measured
error in the journal (a resumed run does not compute a finished tensor again, yet records
it), and conversion.json's "serve" object.

conversion.json's "serve" holds "tensors": per computed tensor, its transform, the native
tensors it was made of, whether its scheme makes it exact (checked while it was computed:
an exact transform whose result differs from the native weight is refused), and, where a
weight was rebuilt to measure it, the max absolute error and the RMS error relative to the
native weight's RMS (0.0 and 0.0 for an exact one). A draft without computed tensors has no
"serve" object from here.
"""

from __future__ import annotations

from typing import Any

from dsv4.convert.computed import Measured
from dsv4.convert.plan import Plan

MEASURED = ("max_abs_error", "rel_rms_error")  # a journal entry's and the record's fields


def measured_fields(measured: Measured | None) -> dict[str, float]:
    """A computed tensor's journal fields (none for a copy or a scale's decoding)."""
    if measured is None:
        return {}
    return {"max_abs_error": measured.max_abs_error, "rel_rms_error": measured.rel_rms_error}


def serve_record(
    plan: Plan, journal: dict[str, dict[str, Any]], target: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """conversion.json's "serve" object: `target`, the serving target's record (the target,
    the route, OUT/serve/'s files: convert/serving.py), and the computed tensors of `plan`
    (every one finished, in `journal`); None for a draft made for no target that computes none."""
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
    return {**(target or {}), **({"tensors": tensors} if tensors else {})}
