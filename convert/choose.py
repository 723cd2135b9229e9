"""Which installed table a checkpoint takes for a target: the one of its drafter kind (MTP or
DSpark), read from its config AND its tensors, which must agree (mapping/README.md#choosing-the-table)."""

from __future__ import annotations

from typing import Literal

from dsv4.convert.sources.inventory import Inventory
from dsv4.mapping.drafters import NO_DRAFTER, identify_drafter
from dsv4.mapping.table import Table, load_table
from dsv4.mapping.targets import LAYOUT_KINDS, drafter_families, require_target, table_name_for
from dsv4.model.checkpoint import CONFIG, is_full_native
from dsv4.model.config import ModelConfig
from dsv4.model.errors import CheckpointError
from dsv4.model.record import LAYOUT_RECORD

Direction = Literal["forward", "reverse"]


# The tensor that makes a checkpoint a DSpark drafter besides its config's dspark_* fields
# (mapping/README.md#xpu-dspark-layout: one without the other is refused), in the native and in the target layout.
DSPARK_MARKER: dict[Direction, str] = {"forward": "mtp.0.main_proj.weight", "reverse": "model.main_proj.weight"}


def drafter_of(inv: Inventory, cfg: ModelConfig, direction: Direction = "forward") -> str:
    """ "dspark" or "mtp": which draft layout `inv` holds, from its config AND its tensors,
    which must agree (unsupported_layout 35 otherwise)."""
    marker = DSPARK_MARKER[direction]
    if marker in inv.tensors and not cfg.is_dspark:
        raise CheckpointError(
            f"{inv.tensors[marker].file}: tensor {marker}: a DSpark drafter's projection, but "
            f"{inv.location}/{CONFIG} has no dspark_* fields (mapping/README.md#dspark-source-checkpoint); "
            "refusing to convert",
            kind="unsupported_layout",
            path=str(inv.tensors[marker].file),
            tensor=marker,
        )
    if cfg.is_dspark and marker not in inv.tensors:
        raise CheckpointError(
            f"{inv.location}/{CONFIG}: dspark_* fields (a DSpark drafter, mapping/README.md#dspark-v4-flash-0731), "
            f"but the checkpoint has no tensor {marker}; refusing to convert",
            kind="unsupported_layout",
        )
    return "dspark" if cfg.is_dspark else "mtp"


def drafter_family(inv: Inventory, target: str, direction: Direction = "forward") -> str | None:
    """The drafter family `inv` holds (mapping/drafters.py), from its config and tensor names:
    in native names for a forward conversion, in `target`'s for a reverse one."""
    block = require_target(target).kind.block if direction == "reverse" else LAYOUT_KINDS["native"].block
    return identify_drafter(inv.config, inv.tensors, block)


def refuse_unconvertible(inv: Inventory, target: str) -> None:
    """Refuse (35), before any tensor byte is read, a native checkpoint without draft layers or
    holding a drafter family that `target` does not convert yet, saying what is missing."""
    family = drafter_family(inv, target)
    where = inv.location
    if family == NO_DRAFTER:
        raise CheckpointError(
            f"{where}: holds no draft layers (no mtp.* tensor): a re-export without the drafter (a re-quantisation "
            "drops it); a draft comes from the original DeepSeek checkpoint: convert-dsv4 ORIGINAL OUT --target "
            f"draft --serve-with {where} makes one to serve beside this one",
            kind="no_drafter",
            path=where,
        )
    if family is None:
        return  # not a DeepSeek V4 model: the config loader refuses it by its model_type
    families = drafter_families()[1]
    why = families[family].refusal(require_target(target))
    if why is not None:
        raise CheckpointError(
            f"{where}: holds a {families[family].title} drafter, which --target {target} does not convert: {why}",
            kind="unsupported_drafter",
            path=where,
        )


def choose_table(target: str, inv: Inventory, direction: Direction = "forward", *, convertible: bool = False) -> Table:
    """The installed table of `target` for the draft layout `inv` holds (MTP or DSpark).
    A converted checkpoint given to a forward conversion, or a full native one given to a
    reverse conversion, is refused naming the command that takes it (unsupported_layout);
    `convertible`: so is a drafter family `target` does not convert (the commands; `check`
    maps a draft directory into the xpu layout in memory, whichever family it holds)."""
    where = inv.location
    if direction == "forward" and isinstance(inv.config.get(LAYOUT_RECORD), dict):
        raise CheckpointError(
            f"{where}: is a converted checkpoint (its config.json has the {LAYOUT_RECORD} layout record), not a "
            "native one: "
            f"convert-dsv4 {where} OUT --reverse turns it back into native names, convert-dsv4 check {where} "
            "verifies it",
            kind="unsupported_layout",
            path=str(where),
        )
    if convertible and direction == "forward":
        refuse_unconvertible(inv, target)
    if direction == "reverse" and is_full_native(inv.tensors):
        raise CheckpointError(
            f"{where}: is a native DeepSeek V4 checkpoint (the main model's layers.* tensors), not a converted one: "
            f"convert-dsv4 {where} OUT --target {target} converts it (without --reverse)",
            kind="unsupported_layout",
            path=str(where),
        )
    family = drafter_family(inv, target, direction)
    return load_table(table_name_for(target, drafter_of(inv, inv.model_config, direction), family))
