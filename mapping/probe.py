"""The small configuration a table is validated against, for both expert dtypes: which
native names the source format allows (model/native.py) and which parameters the
bundled model has (model/layout.py)."""

from __future__ import annotations

from functools import cache

from dsv4.model import native
from dsv4.model.config import ModelConfig
from dsv4.model.layout import target_layout
from dsv4.model.presets import preset_config

VARIANT_OF_EXPERT_DTYPE = {"fp4": "instruct", "fp8": "base"}


def probe_config(expert_dtype: str) -> ModelConfig:
    return ModelConfig.from_dict(preset_config("tiny", VARIANT_OF_EXPERT_DTYPE[expert_dtype]))


def native_keys(cfg: ModelConfig) -> set[str]:
    """Every name a native checkpoint with this config may hold (Base's optional MTP
    emb/head included)."""
    keys = set(native.top_level_layout(cfg))
    for j in range(cfg.num_hidden_layers):
        keys |= set(native.main_layer_layout(cfg, j))
    for i in range(cfg.num_nextn_predict_layers):
        keys |= set(native.mtp_layout(cfg, i, with_emb_head=native.variant_of(cfg) == "base"))
    return keys


@cache
def probe_keys() -> tuple[dict[str, set[str]], dict[str, set[str]], list[dict[str, int]]]:
    """For each expert dtype: the native names and the model's parameters; and the values
    the placeholders of a target pattern take ({i} and {L} of each draft block)."""
    cfgs = {d: probe_config(d) for d in VARIANT_OF_EXPERT_DTYPE}
    natives = {d: native_keys(c) for d, c in cfgs.items()}
    targets = {d: set(target_layout(c)) for d, c in cfgs.items()}
    cfg = cfgs["fp4"]
    bindings = [{"i": i, "L": cfg.mtp_layer_index(i)} for i in range(cfg.num_nextn_predict_layers)]
    return natives, targets, bindings
