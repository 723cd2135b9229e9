"""The library's reading of a serve plan, in another process while the conversion writes.

A serving target's `quantization_config` is read with its method's library (compressed-tensors:
its pydantic models say what a QuantizationArgs means, its defaults and inferred strategy, and
its presets make the draft's config groups). Importing it takes seconds (its package imports
torch and transformers), more than the copy of a draft that only renames bytes and widens
scales. So `convert` starts from the plan read without the library (registry
`provisional_serve_plan`) and runs the library's own reading, `serve_plan` unchanged, in a child
process started here; before publishing it `final` joins it: the library's decisions must be
the provisional ones, and its configs are the ones written. Anything else (another plan, a
refusal, a child that failed) is decided again in this process by the library, so a refusal is
the one `serve_plan` raises, word for word. The library stays the authority; the provisional
reading only lets the bytes move while it is imported.

A reply the library gave is kept for later runs against the same target (convert/verdict_cache.py):
with it no child is started at all.

The child is a fresh interpreter (not a fork: the converter's reader and writer threads may
be running), given the parent's sys.path and the plan's inputs as JSON on stdin; it answers one
JSON line on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from dsv4.convert.errors import PlanError
from dsv4.convert.schemes.base import LayerMap, ServePlan
from dsv4.convert.verdict_cache import cached_reply, keep_reply
from dsv4.model.native import Layout

CHILD = """
import json, sys
request = json.load(sys.stdin)
sys.path[:] = request["path"]
from dsv4.convert.verdict import answer
answer(request)
"""


def summary(plan: ServePlan) -> dict[str, Any]:
    """What of a serve plan the provisional reading decides: the route, why, every decision."""
    rows = [[d.module, d.kind, list(d.parts), d.scheme.name, d.why] for d in plan.decisions]
    return {"route": plan.route, "why": plan.why, "decisions": rows}


def same_tensors(a: ServePlan, b: ServePlan) -> bool:
    """Whether two serve plans write the same tensors: every module by the same scheme."""
    return [(d.module, d.parts, d.scheme.name) for d in a.decisions] == [
        (d.module, d.parts, d.scheme.name) for d in b.decisions
    ]


def _inputs(request: Mapping[str, Any]) -> tuple[LayerMap, Layout]:
    layers = request["layers"]
    parts = {m: tuple(p) for m, p in layers["parts"].items()}
    native = {name: (dtype, tuple(shape)) for name, (dtype, shape) in request["native"].items()}
    return LayerMap(layers["kinds"], parts, layers["num_hidden_layers"]), native


def answer(request: Mapping[str, Any]) -> None:
    """The child: `serve_plan` of the request, its summary and configs on one line of stdout;
    null where it raised (the parent then asks the library itself, and raises what it raises)."""
    from dsv4.convert.schemes.registry import serve_plan

    layers, native = _inputs(request)
    error = partial(PlanError, kind="quant_carry")
    try:
        plan = serve_plan(
            request["target_config"],
            layers,
            native,
            request["where"],
            error,
            route=request["route"],
            allow_lossy=request["allow_lossy"],
        )
        reply = {**summary(plan), "overrides": plan.overrides, "quantization_config": plan.quantization_config}
    except Exception:  # whatever it is, the parent's own reading raises it again
        reply = None
    sys.stdout.write("\n" + json.dumps({"plan": reply}) + "\n")


@dataclass
class Verdict:
    """The library's reading running in a child, and the same reading in this process
    (`decide`), for when the child's is not the provisional plan's."""

    process: subprocess.Popen[bytes] | None
    decide: Callable[[], ServePlan]
    request: dict[str, Any]
    kept: dict[str, Any] | None = None  # the library's reply to this request as an earlier run kept it

    def _reply(self) -> dict[str, Any] | None:
        if self.kept is not None:
            return self.kept
        reply = self._child_reply()
        if reply is not None:
            keep_reply(self.request, reply)
        return reply

    def _child_reply(self) -> dict[str, Any] | None:
        if self.process is None:
            return None
        assert self.process.stdout is not None
        with self.process.stdout:
            out = self.process.stdout.read()
        if self.process.wait() != 0:
            return None
        try:
            return json.loads(out.rsplit(b"\n", 2)[-2])["plan"]
        except (ValueError, IndexError, KeyError, TypeError):
            return None

    def final(self, provisional: ServePlan) -> ServePlan:
        """The plan to publish: `provisional` with the library's configs where the library
        decided the same; else the library's own plan, or its refusal raised."""
        reply = self._reply()
        if reply is not None and {k: reply[k] for k in ("route", "why", "decisions")} == summary(provisional):
            return dataclasses.replace(
                provisional, overrides=reply["overrides"], quantization_config=reply["quantization_config"]
            )
        return self.decide()

    def close(self) -> None:
        """Stop a child whose answer is no longer wanted (the run ended before publishing)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start(
    target_config: Mapping[str, Any],
    layers: LayerMap,
    native: Layout,
    where: str,
    *,
    route: str,
    allow_lossy: bool,
    decide: Callable[[], ServePlan],
) -> Verdict:
    """The library's `serve_plan` of these inputs started in a child (where it cannot start,
    `final` decides in this process)."""
    request = {
        "path": sys.path,
        "target_config": target_config,
        "where": where,
        "layers": {"kinds": layers.kinds, "parts": layers.parts, "num_hidden_layers": layers.num_hidden_layers},
        "native": native,
        "route": route,
        "allow_lossy": allow_lossy,
    }
    kept = cached_reply(request)
    if kept is not None:
        return Verdict(None, decide, request, kept)
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
    except OSError:
        return Verdict(None, decide, request)
    verdict = Verdict(process, decide, request)
    assert process.stdin is not None
    try:
        with process.stdin:
            process.stdin.write(json.dumps(request).encode())
    except OSError:  # the child is gone: its answer would be none
        verdict.close()
        verdict.process = None
    return verdict
