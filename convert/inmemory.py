"""A checkpoint in native names (a `--target draft` directory, or a native checkpoint) as the
bundled model's state dict: the plan of `convert-dsv4 DIR OUT --target xpu` (the target whose
layout is the bundled model's, mapping/targets.py `bundled_target`), executed into memory
instead of into shards.

So `smoke` and `check --smoke/--native` run the bundled model on exactly the tensors that
conversion would write (the xpu table is the mapping; there is no second one), and a draft
directory needs no target checkpoint: embed.weight and head.weight are inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4.convert.choose import choose_table
from dsv4.convert.plan import Plan, plan_conversion
from dsv4.convert.route_load import is_held_for_a_target, load_held
from dsv4.convert.sources.location import open_source
from dsv4.convert.sources.source import ByteReader
from dsv4.mapping.targets import bundled_target
from dsv4.model.checkpoint import Checkpoint
from dsv4.model.errors import DSV4Error
from dsv4.model.loader import has_layout_record, load_state
from dsv4.model.parity import SMOKE_TOKENS

if TYPE_CHECKING:
    import torch
    from torch import nn


def read_planned(plan: Plan, reader: ByteReader) -> dict[str, torch.Tensor]:
    """Every planned tensor, its pieces read back to back into one buffer (every table op
    moves bytes, so a tensor is its pieces' bytes), as a CPU tensor of its planned dtype and shape."""
    import torch

    from dsv4.model.dtypes import TORCH_DTYPES

    state: dict[str, torch.Tensor] = {}
    for t in plan.tensors:
        buf = bytearray(t.nbytes)
        view, at = memoryview(buf), 0
        for p in t.pieces:
            reader.read_into(p.file, p.start, view[at : at + p.nbytes])
            at += p.nbytes
        state[t.name] = (
            torch.frombuffer(buf, dtype=TORCH_DTYPES[t.dtype]).reshape(t.shape)
            if t.nbytes
            else torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype])
        )
    return state


def bundled_plan(root: Path) -> Plan:
    """The plan of converting native-named checkpoint `root` to the bundled layout (headers only)."""
    with open_source(root) as source:
        inv = source.inventory
    return plan_conversion(inv, choose_table(bundled_target().name, inv))


def load_native_named(root: Path, device: torch.device, plan: Plan | None = None) -> nn.Module:
    """The bundled draft model loaded from native-named checkpoint `root` through the xpu
    table's plan (`plan`, when the caller has made it), in memory; the planner's errors
    (exit 30-35) name what does not fit."""
    with open_source(root) as source:
        if plan is None:
            plan = plan_conversion(source.inventory, choose_table(bundled_target().name, source.inventory))
        state = read_planned(plan, source.reader)
    return load_state(plan.model_config, state, device)


def model_loader(root: Path, plan: Callable[[], Plan] | None = None) -> Callable[[torch.device], nn.Module] | None:
    """How `smoke` and `check` load `root` into the bundled model: None for a converted
    checkpoint (its config.json has the layout record: the strict loader reads its names
    as they are), the held draft's loader for a draft written for a serving target, the
    in-memory xpu plan for a checkpoint in native names (`plan()` gives it when the caller
    has one, so `check` plans a draft directory once)."""
    if has_layout_record(root):
        return None
    if held_for_a_target(root):  # linears held as a serving target's schemes take them (--serve-with)
        return lambda device: load_held(root, device)
    return lambda device: load_native_named(root, device, plan() if plan is not None else None)


def held_for_a_target(root: Path) -> bool:
    """Whether draft directory `root` holds some linear otherwise than as its native pair (a draft
    written for a serving target, convert/route_load.py); headers only. A directory whose config or
    headers cannot be read is not: the native path's own checks name what is wrong."""
    checkpoint = Checkpoint(root)
    try:
        found = {name: (t.dtype, t.shape) for name, t in checkpoint.headers.tensors.items()}
        return is_held_for_a_target(checkpoint.model_config, found)
    except DSV4Error:
        return False


def match_target_figures(
    draft: Path, native: Path, device: str = "cpu", tokens: int = SMOKE_TOKENS, seed: int = 0
) -> dict[str, Any]:
    """A match-target draft directory `draft` against `native` (the native checkpoint or native draft it
    was made from), the bundled model run on both with smoke's seeded inputs on `device`: top-1
    agreement where the native top-2 margin is decisive, and the logits error
    (model/smoke.py agreement_figures; MTP drafts)."""
    import torch

    from dsv4.model.loader import load_converted
    from dsv4.model.parity import agreement_figures
    from dsv4.model.smoke import draft_logits

    dev = torch.device(device)
    logits = [draft_logits(model_loader(d) or partial(load_converted, d), dev, tokens, seed) for d in (draft, native)]
    return {**agreement_figures(*logits), "device": str(dev), "tokens": tokens, "seed": seed}
