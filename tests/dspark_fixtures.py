"""Broken DSpark checkpoints for the tests that need one refused (exit 35)."""

from __future__ import annotations

import json
from pathlib import Path

from dsv4.convert.synth import write_checkpoint
from dsv4.model.presets import DSPARK_FIELDS


def write_half_dspark(path: Path, *, seed: int = 0) -> Path:
    """A tiny DSpark checkpoint whose config.json lost its dspark_* fields: a DSpark drafter
    (mtp.0.main_proj.weight) with a config that does not say so, refused (mapping/README.md#xpu-dspark-layout)."""
    ckpt = write_checkpoint(path, preset="tiny", variant="dspark", main_layers="all", seed=seed)
    config = json.loads((ckpt / "config.json").read_text())
    for field in DSPARK_FIELDS:
        del config[field]
    (ckpt / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ckpt
