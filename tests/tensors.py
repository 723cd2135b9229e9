"""Reading a whole (small) checkpoint directory back, for tests that compare tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from dsv4.model.checkpoint import local_weight_map


def load_all(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint directory `root`, by name."""
    weight_map, _ = local_weight_map(root)
    out = {}
    for name, file in weight_map.items():
        with safe_open(str(root / file), "pt") as f:
            out[name] = f.get_tensor(name)
    return out
