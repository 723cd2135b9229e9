"""A checkpoint in native names (a `--target draft` directory, or a native checkpoint) as the
bundled model's state dict: the plan of `convert-dsv4 DIR OUT --target xpu`, executed into
memory instead of into shards.

So `smoke` and `check --smoke/--native` run the bundled model on exactly the tensors that
conversion would write (the xpu table is the mapping; there is no second one), and a draft
directory needs no target checkpoint: embed.weight and head.weight are inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4.convert.location import open_source
from dsv4.convert.plan import Plan, choose_table, plan_conversion
from dsv4.convert.source import ByteReader
from dsv4.model.loader import has_layout_record, load_state

if TYPE_CHECKING:
    import torch
    from torch import nn

XPU_TARGET = "xpu"  # the bundled model's layout (model/layout.py target_layout)


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


def xpu_plan(root: Path) -> Plan:
    """The plan of converting native-named checkpoint `root` to the xpu layout (headers only)."""
    with open_source(root) as source:
        inv = source.inventory
    return plan_conversion(inv, choose_table(XPU_TARGET, inv))


def load_native_named(root: Path, device: torch.device) -> nn.Module:
    """The bundled draft model loaded from native-named checkpoint `root` through the xpu
    table's plan, in memory; the planner's errors (exit 30-35) name what does not fit."""
    with open_source(root) as source:
        plan = plan_conversion(source.inventory, choose_table(XPU_TARGET, source.inventory))
        state = read_planned(plan, source.reader)
    return load_state(plan.model_config, state, device)


def model_loader(root: Path) -> Callable[[torch.device], nn.Module] | None:
    """How `smoke` and `check` load `root` into the bundled model: None for a converted
    checkpoint (its config.json has the layout record: the strict loader reads its names
    as they are), the in-memory xpu plan for a checkpoint in native names."""
    if has_layout_record(root):
        return None
    return lambda device: load_native_named(root, device)
