"""Progress output of long work: one rule for every command.

A bar (or a per-step line) is drawn only on a terminal, and not with `-q`/`--json` or when
HF_HUB_DISABLE_PROGRESS_BARS is set: huggingface_hub's tqdm decides, as for its own
downloads. Byte counts are decimal everywhere (1 GB = 10^9 bytes), in bars as in summaries.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from huggingface_hub.utils import tqdm

BYTES = {"unit": "B", "unit_scale": True, "unit_divisor": 1000}  # decimal: a bar's "5.71GB" is the summary's "5.712 GB"


def bar(total: int | None, desc: str, unit: str, quiet: bool, *, initial: int = 0) -> tqdm:
    """A progress bar over `total` units (bytes: unit "B", scaled as BYTES)."""
    from huggingface_hub.utils import tqdm  # start-up time: brings the HTTP stack, which `plan` never needs

    units = BYTES if unit == "B" else {"unit": unit}
    return tqdm(total=total, initial=initial, desc=desc, disable=True if quiet else None, **units)


def step(line: str, quiet: bool) -> None:
    """One line on stderr saying what long step starts now, by the bars' rule."""
    from huggingface_hub.utils import are_progress_bars_disabled

    if not quiet and sys.stderr.isatty() and not are_progress_bars_disabled():
        print(line, file=sys.stderr, flush=True)
