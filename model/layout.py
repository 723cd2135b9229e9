"""The target (XPU runtime) layout, derived from the bundled model itself.

This is the single source of truth for target names, shapes and dtypes: the model is
instantiated on the meta device (no memory, any size) and its state_dict is read off.
The converter's plan and `check` compare against this; nothing hand-copies it.
"""

from __future__ import annotations

import torch

from dsv4.convert.dtypes import SAFETENSORS_NAMES
from dsv4.convert.native import Layout
from dsv4.model.config import ModelConfig
from dsv4.model.mtp import DeepSeekV4MTP


def target_layout(cfg: ModelConfig) -> Layout:
    """name -> (safetensors dtype, shape) of every parameter of the draft model for `cfg`."""
    with torch.device("meta"):
        model = DeepSeekV4MTP(cfg)
    return {name: (SAFETENSORS_NAMES[t.dtype], tuple(t.shape)) for name, t in model.state_dict().items()}
