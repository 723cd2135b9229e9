"""A draft made to serve beside a serving target (`--serve-with TARGET`, convert/serving_target.py
reads it): the serve plan of the source's draft (convert/schemes/registry.py), the draft's
config.json under it, and what goes into OUT/serve/ beside the tensors:

  OUT/serve/vllm-hf-overrides.json  the value vLLM's --hf-overrides takes, where the route
                                    changes the target's launch (serve.overrides)
  OUT/serve/commands.sh             the launch commands, from the target file's serve
                                    templates (mapping/targets/draft.toml [[card.serve]])

Both are written into the partial directory with the tensors and listed in conversion.json's
"serve" record, so an interrupted run leaves nothing that looks complete and --overwrite
takes them for this tool's own files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

from dsv4.convert.choose import drafter_family
from dsv4.convert.errors import PlanError
from dsv4.convert.launch import serve_commands
from dsv4.convert.plan import Plan
from dsv4.convert.route_load import native_plan
from dsv4.convert.schemes.base import ROUTES, LayerMap, ServePlan, layer_map
from dsv4.convert.schemes.registry import provisional_serve_plan, serve_plan
from dsv4.convert.serving_target import QUANTIZATION, ServingTarget
from dsv4.convert.sources.inventory import Inventory
from dsv4.convert.verdict import Verdict, same_tensors, start
from dsv4.mapping.targets import drafter_families, require_target
from dsv4.model.errors import CheckpointError, DSV4Error
from dsv4.model.native import Layout, standalone_draft_layout
from dsv4.model.record import sha256_hex
from dsv4.model.strictjson import json_bytes, write_bytes

SERVE_DIR = "serve"
OVERRIDES_FILE = f"{SERVE_DIR}/vllm-hf-overrides.json"
COMMANDS_FILE = f"{SERVE_DIR}/commands.sh"
CT_DISTRIBUTION = "compressed-tensors"  # the [quant] extra's library (pyproject.toml)
QUANT_CARRY = partial(PlanError, kind="quant_carry")  # how a serve plan's refusals are raised
DRAFT_FORMATS = ("auto", *ROUTES)  # --draft-format: auto (the exact route the target allows), or a route


@dataclass(frozen=True)
class Serving:
    """What --serve-with asks: the target, the route (--draft-format) and --allow-lossy."""

    target: ServingTarget
    route: str = "auto"
    allow_lossy: bool = False


@dataclass(frozen=True)
class Served:
    """A serving request decided for one source: the serve plan, and the draft's layout and kind."""

    serving: Serving
    plan: ServePlan
    layout: str  # the draft's --target (a serving target file: mapping/targets/draft.toml)
    drafter: str  # "mtp" or "dspark" (the draft table's), which launch command serves it
    native: Layout  # the native draft's layout, what the schemes derive the tensors from
    family: str | None = None  # the drafter family (mapping/drafters.py): its releases and platforms in the commands
    # the library's reading still running, where `plan` is the provisional one (provisional_serving)
    verdict: Verdict | None = None


def _serve_inputs(inventory: Inventory, plan: Plan, serving: Serving) -> tuple[LayerMap, Layout]:
    """The draft's modules from the xpu plan of the native layout its config describes
    (route_load.native_plan, as `check --serve-with` takes them: no second classification of
    the source's every key), and that layout, what the schemes derive their tensors from. A
    DeepSeek V4.1 draft is refused: no quantised V4.1 serving target has been modelled (vLLM
    builds its draft with the target's own V4.1 quantisation, models/deepseek_v41/quant_config.py)."""
    if plan.model_config.is_v41:
        raise CheckpointError(
            f"{inventory.location}: --serve-with is not built for DeepSeek V4.1 drafts (no quantised V4.1 target "
            "has been modelled); convert it without --serve-with: vLLM and SGLang serve that draft beside the V4.1 "
            "model it comes from",
            kind="unsupported_drafter",
            path=str(inventory.location),
        )
    serving.target.refuse_unless_fits(plan.config)
    native = standalone_draft_layout(plan.model_config)
    return layer_map(native_plan(plan.model_config, plan.config, inventory.location)), native


def decide_serving(inventory: Inventory, plan: Plan, serving: Serving) -> Served:
    """The serve plan of `plan`'s draft beside the serving target (`_serve_inputs`)."""
    layers, native = _serve_inputs(inventory, plan, serving)
    decided = serve_plan(
        serving.target.config,
        layers,
        native,
        serving.target.where,
        QUANT_CARRY,
        route=serving.route,
        allow_lossy=serving.allow_lossy,
    )
    family = drafter_family(inventory, plan.target)
    return Served(serving, decided, plan.target, plan.identity.drafter, native, family)


def provisional_serving(inventory: Inventory, plan: Plan, serving: Serving) -> Served | None:
    """`decide_serving`'s plan as read without the target method's library, with the library's
    reading started in another process (`Served.verdict`; `settled` makes the plan final);
    None where there is no such reading (`decide_serving` decides, and refuses)."""
    target = serving.target
    try:
        layers, native = _serve_inputs(inventory, plan, serving)
    except DSV4Error:
        return None
    asked = {"route": serving.route, "allow_lossy": serving.allow_lossy}
    decided = provisional_serve_plan(target.config, layers, native, target.where, QUANT_CARRY, **asked)
    if decided is None:
        return None
    decide = partial(serve_plan, target.config, layers, native, target.where, QUANT_CARRY, **asked)
    verdict = start(target.config, layers, native, target.where, decide=decide, **asked)
    family = drafter_family(inventory, plan.target)
    return Served(serving, decided, plan.target, plan.identity.drafter, native, family, verdict)


class Superseded(Exception):
    """The library's serve plan gives some module another scheme than the provisional plan
    the tensors were written by: they are to be written again by its plan (`served`)."""

    def __init__(self, served: Served) -> None:
        super().__init__(served.plan.why)
        self.served = served


def settled(served: Served, on_refusal: Callable[[], object]) -> Served:
    """`served` with its final plan: the library's verdict joined where one is pending (its
    refusal raised after `on_refusal()`; Superseded where its plan writes other tensors)."""
    if served.verdict is None:
        return served
    try:
        plan = served.verdict.final(served.plan)
    except PlanError:
        on_refusal()
        raise
    final = dataclasses.replace(served, plan=plan, verdict=None)
    if not same_tensors(final.plan, served.plan):
        raise Superseded(final)
    return final


def draft_config(plan: Plan, served: Served) -> dict[str, Any] | bytes:
    """The draft's config.json: the source's, with the quantization_config the runtime is to
    build the draft with (none: the field removed); the source's bytes where that is what it
    says already. num_hidden_layers stays the source's, which the target's equals
    (refuse_unless_fits): vLLM numbers the draft's layers after the target's
    num_hidden_layers (models/deepseek_v4/nvidia/mtp.py 216-225) and SGLang names the draft's
    parameters after the draft's own (docs/serving.md), so the two must agree."""
    config = {k: v for k, v in plan.config.items() if k != QUANTIZATION}
    if served.plan.quantization_config is not None:
        config[QUANTIZATION] = served.plan.quantization_config
    return plan.config_bytes if config == plan.config else config


def quant_method(config: dict[str, Any]) -> str | None:
    """A draft config's quantisation method (what SGLang's --speculative-draft-model-quantization names)."""
    qc = config.get(QUANTIZATION)
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return method if isinstance(method, str) else None


def serve_files(served: Served, out: Path) -> dict[str, bytes]:
    """OUT/serve/'s files (module docstring) for a draft published at `out` (absolute: the
    commands name it, and the overrides file by its path under it)."""
    files: dict[str, bytes] = {}
    overrides = None
    if served.plan.overrides is not None:
        files[OVERRIDES_FILE] = json_bytes(served.plan.overrides)
        overrides = str(out / OVERRIDES_FILE)
    commands = serve_commands(
        require_target(served.layout),
        served.serving.target.name,
        str(out),
        served.drafter,
        route=served.plan.route,
        overrides=overrides,
        quantization=quant_method({QUANTIZATION: served.plan.quantization_config}),
        family=drafter_families()[1].get(served.family) if served.family is not None else None,
    )
    head = f"# Serve {out} beside {served.serving.target.name} ({served.plan.route}: {served.plan.why})\n\n"
    files[COMMANDS_FILE] = (head + commands + "\n").encode()
    return files


def write_serve_files(files: dict[str, bytes], partial_dir: Path) -> None:
    (partial_dir / SERVE_DIR).mkdir(exist_ok=True)
    for name, data in files.items():
        write_bytes(partial_dir / name, data)


def serve_identity(served: Served, out: Path) -> dict[str, Any]:
    """What decides a served draft's config.json and OUT/serve/'s files besides its tensors'
    plan, for the run's fingerprint, known before the library's reading of the target is in
    (convert/verdict.py): the target read, the route and --allow-lossy asked, OUT (the
    commands name it), and the release of the library the target's config is read with."""
    try:
        library = metadata.version(CT_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        library = None
    return {
        "target": served.serving.target.to_json(),
        "route": served.serving.route,
        "allow_lossy": served.serving.allow_lossy,
        "out": str(out),
        CT_DISTRIBUTION: library,
    }


def serve_record(served: Served, files: dict[str, bytes]) -> dict[str, Any]:
    """conversion.json's "serve": the target, the route and why, and OUT/serve/'s files."""
    return {
        "target": served.serving.target.to_json(),
        "route": served.plan.route,
        "why": served.plan.why,
        "allow_lossy": served.serving.allow_lossy,
        "files": {name: sha256_hex(data) for name, data in sorted(files.items())},
    }


def serving_output(served: Served | None, out: Path) -> tuple[dict[str, bytes], dict[str, Any]] | None:
    """OUT/serve/'s files for the draft published at `out`, and conversion.json's record of them."""
    if served is None:
        return None
    files = serve_files(served, out)
    return files, serve_record(served, files)


def decision_rows(served: Served) -> list[dict[str, Any]]:
    """Each draft module's decision: its runtime name, scheme, why, and the tensors it takes."""
    return [
        {
            "module": d.module,
            "kind": d.kind,
            "scheme": d.scheme.name,
            "why": d.why,
            "parts": list(d.parts),
            "tensors": [
                {"name": o.name, "dtype": o.dtype, "shape": list(o.shape), "transform": o.transform, "exact": o.exact}
                for o in d.outputs(served.native)
            ],
        }
        for d in served.plan.decisions
    ]


def serve_json(served: Served) -> dict[str, Any]:
    """`plan --serve-with --json`'s "serve": the target, the route, the overrides, the decisions."""
    return {
        "target": served.serving.target.to_json(),
        "route": served.plan.route,
        "why": served.plan.why,
        "overrides": served.plan.overrides,
        "quantization_config": served.plan.quantization_config,
        "decisions": decision_rows(served),
    }
