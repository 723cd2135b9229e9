"""`verify_runtimes.py DRAFT --native NATIVE` for a DeepSeek V4.1 draft: vLLM's two V4.1 DSpark loaders
(vllm_v41) and SGLang's (sglang_v41), and the table of their reports."""

from __future__ import annotations

import json
from pathlib import Path

from . import UsageError
from .recording import Report
from .serve_verify import detail_lines
from .sglang_v41 import SGLANG_V41_LOADER, verify_sglang_v41
from .vllm_v41 import V41_LOADERS, V41Report, v41_run
from .wheels import Wheel, wheel_path

V41_LOADER_NAMES = [*V41_LOADERS, SGLANG_V41_LOADER]


def verify_v41(wheels: Path, draft: Path, native: Path, loaders: list[str] | None = None) -> list[V41Report]:
    """Every V4.1 loader (or those named) on DRAFT; SGLang's report in the vLLM reports' terms."""
    for d in (draft, native):
        if not (d / "config.json").is_file():
            raise UsageError(f"{d}: no config.json")
    chosen = loaders or V41_LOADER_NAMES
    unknown = [n for n in chosen if n not in V41_LOADER_NAMES]
    if unknown:
        raise UsageError(f"{draft}: a V4.1 draft runs {', '.join(V41_LOADER_NAMES)}, not {', '.join(unknown)}")
    reports = []
    if any(n in V41_LOADERS for n in chosen):
        vllm = Wheel(wheel_path(wheels, "vllm"))
        reports += [v41_run(vllm, n, draft, native) for n in chosen if n in V41_LOADERS]
    if SGLANG_V41_LOADER in chosen:
        reports.append(_in_v41_terms(verify_sglang_v41(Wheel(wheel_path(wheels, "sglang")), draft, native)))
    return reports


def _in_v41_terms(run: Report) -> V41Report:
    """SGLang's report: its parameters those its loader fills from NATIVE, what both runs drop counted as
    the runtime dropping it, no count of its own (SGLang's DSpark load_weights logs none: -1)."""
    return V41Report(
        run.loader,
        fed=run.fed,
        params=len(run.hit) + len(run.missing),
        filled=len(run.hit),
        errors=run.errors,
        skipped=run.skipped,
        unfilled=run.missing,
        inexact=run.unequal,
        dropped=run.dropped,
    )


def is_v41_draft(draft: Path) -> bool:
    """DRAFT's config.json names DeepSeek V4.1 (vllm/transformers_utils/config.py:172 registers the type)."""
    file = draft / "config.json"
    return file.is_file() and json.loads(file.read_text()).get("model_type") == "deepseek_v41"


def v41_table(reports: list[V41Report]) -> list[str]:
    lines = [
        "| loader | tensors fed | params filled | vLLM's own count | dropped as the runtime does "
        "| errors | skips | exact | pass |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        own = "-" if r.runtime_loaded < 0 else f"loaded: {r.runtime_loaded} params"
        exact = f"{r.filled - len(r.inexact)}/{r.filled}"
        lines.append(
            f"| {r.loader} | {r.fed} | {r.filled}/{r.params} | {own} | {len(r.dropped)} | {len(r.errors)} "
            f"| {len(r.skipped)} | {exact} | {'yes' if r.passed else 'NO'} |"
        )
    return lines + detail_lines(reports, ("dropped", "dropped"))
