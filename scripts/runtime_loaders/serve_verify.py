"""`verify_runtimes.py DRAFT --serve-with TARGET [--overrides FILE] --native NATIVE`: which
vLLM loaders run, on which quantization_config, and the table of their reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import UsageError
from .serve_runs import ServeReport, serve_run
from .sglang_quant import sglang_draft_quantization
from .sglang_runs import verify_sglang
from .vllm_build import effective_quantization_config
from .wheels import Wheel, wheel_path

MTP_LOADERS = ["vllm-nvidia-mtp", "vllm-amd-mtp", "vllm-xpu-mtp"]
DSPARK_LOADERS = ["vllm-nvidia-dspark", "vllm-amd-dspark", "vllm-xpu-dspark"]  # models/deepseek_v4/*/dspark.py
# the rows per draft kind: vLLM's loaders, then SGLang's (sglang_report)
SERVED_METHODS = ("compressed-tensors", "modelopt")  # the configs vllm_build cuts out


def read_config(path: Path) -> dict[str, Any]:
    """A config.json, or the one in a directory."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UsageError(f"{path}: no config.json")
    return json.loads(file.read_text())


def scheme_label(qc: dict[str, Any]) -> str:
    """The target's schemes as its config groups state them (format per group, else the config's);
    a ModelOpt target's algorithm."""
    if qc.get("quant_method") == "modelopt":
        return f"modelopt {(qc.get('quantization') or qc).get('quant_algo')}"
    formats = [g.get("format") or qc.get("format") or "?" for g in (qc.get("config_groups") or {}).values()]
    return " + ".join(sorted(set(formats))) or str(qc.get("quant_method"))


def verify_serving(
    wheels: Path, draft: Path, target: Path, overrides: Path | None, native: Path, loaders: list[str] | None = None
) -> tuple[str, list[ServeReport]]:
    """Every vLLM loader for the draft's kind on DRAFT beside TARGET, and SGLang's where no
    overrides are given (SGLang builds the draft by its own config.json): an MTP draft is built
    with the target's effective quantization_config (the overrides' replacing it); a
    DSpark draft with its own (the target's method name, the draft's dict: config/speculative.py:1564-1566,
    dspark/utils.py:115-117; a target's dict --hf-overrides is not applied to a draft,
    config/speculative.py:1193-1194)."""
    for d in (draft, native):
        if not (d / "config.json").is_file():
            raise UsageError(f"{d}: no config.json")
    target_config = read_config(target)
    extra = json.loads(overrides.read_text()) if overrides else None
    effective = effective_quantization_config(target_config, extra)
    if effective.get("quant_method") not in SERVED_METHODS:
        raise UsageError(
            f"{target}: --serve-with takes a compressed-tensors or modelopt target (quant_method is "
            f"{effective.get('quant_method')!r}); a DeepSeek fp8 target serves the native draft: --expected"
        )
    config = json.loads((draft / "config.json").read_text())
    is_dspark = "dspark_target_layer_ids" in config
    chosen = loaders or (DSPARK_LOADERS if is_dspark else MTP_LOADERS)
    quant = (config.get("quantization_config") or {}) if is_dspark else effective
    wheel = Wheel(wheel_path(wheels, "vllm"))
    reports = [
        serve_run(wheel, loader, draft, quant, native, config, effective)
        for loader in chosen
        if loader.startswith("vllm-")
    ]
    sglang = "sglang-dspark" if is_dspark else "sglang-nextn"
    # --hf-overrides is a vLLM launch: SGLang's row only without one (or asked for by name)
    if (loaders is None and overrides is None) or (loaders and sglang in loaders):
        reports.append(sglang_report(Wheel(wheel_path(wheels, "sglang")), sglang, draft, native))
    return scheme_label(target_config.get("quantization_config") or {}), reports


def sglang_report(wheel: Wheel, loader: str, draft: Path, native: Path) -> ServeReport:
    """SGLang beside any target: the quantisation it builds the draft with (the draft's own
    config.json, the target launched without --quantization), and its loader on DRAFT
    against the same loader on NATIVE (sglang_runs.verify_sglang)."""
    quantization, errors = sglang_draft_quantization(wheel, draft)
    run = verify_sglang(wheel, loader, draft, native)
    return ServeReport(
        loader,
        methods={"draft": f"quantization {quantization}"},
        fed=run.fed,
        params=len(run.hit) + len(run.missing),
        filled=len(run.hit),
        errors=errors + run.errors,
        skipped=run.skipped,
        unfilled=run.missing,
        inexact=run.unequal,
    )


def serve_table(target: str, route: str, reports: list[ServeReport]) -> list[str]:
    lines = [
        "| target scheme | route | loader | draft methods | tensors fed | params filled "
        "| errors | skips | exact | lossy placed (max abs, rel RMS) | pass |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        methods = ", ".join(sorted({m.split(":")[0] for m in r.methods.values()}))
        exact = f"{r.filled - len(set(r.inexact) | set(r.lossy))}/{r.filled}"
        lines.append(
            f"| {target} | {route} | {r.loader} | {methods} | {r.fed} | {r.filled}/{r.params} | "
            f"{len(r.errors)} | {len(r.skipped)} | {exact} | {lossy_cell(r)} | {'yes' if r.passed else 'NO'} |"
        )
    return lines + detail_lines(reports, ("error not as recorded", "off_record"))


def detail_lines(reports: list[Any], last: tuple[str, str]) -> list[str]:
    """Below a table: per report, what went wrong, a few names of each (`last`: one more
    (label, field) of the report's own)."""
    fields = (("error", "errors"), ("skipped", "skipped"), ("unfilled", "unfilled"), ("filled twice", "twice"))
    lines = []
    for r in reports:
        for label, name in (*fields, ("not exact", "inexact"), last):
            if items := getattr(r, name):
                lines.append(f"{r.loader}: {label} {len(items)}, e.g. {'; '.join(items[:3])}")
    return lines


def lossy_cell(r: ServeReport) -> str:
    """How many of the parameters fed lossy tensors hold them as the draft does, and their worst error."""
    if not r.lossy:
        return "-"
    held = [p for p in r.lossy if p not in r.inexact]
    worst_abs = max(e[0] for e in r.lossy.values())
    worst_rms = max(e[1] for e in r.lossy.values())
    return f"{len(held)}/{len(r.lossy)} ({worst_abs:.4g}, {worst_rms:.4g})"
