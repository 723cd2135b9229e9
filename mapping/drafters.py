"""Which drafter family a checkpoint holds, told from its config.json and tensor names alone
(no tensor byte is read): the families of mapping/targets/draft.toml's [[drafter]] entries, or
NO_DRAFTER for a checkpoint without draft layers (a re-export that dropped `mtp.*`).

The markers (mapping/README.md#drafter-families):
- V4.1 has its own model_type, `deepseek_v41` (vLLM transformers_utils/configs/deepseek_v41.py:18);
  its only drafter is DSpark (vLLM config/speculative.py:1471-1486 refuses "method":"mtp" on it).
- The other families are `deepseek_v4`. Without dspark_* fields it is an MTP drafter, Base's when
  its experts are stored as Base releases store them (model/storage.py); with them a DSpark one:
  Vision-Exp's when the model has a vision tower (`vision_n_layers` > 0, which makes vLLM create a
  `gate.bias_vl` per MoE, deepseek_v4/nvidia/model.py:311-318) or the tensors carry one of the
  vision tensors; Pro-0813's on Pro's main model; 0731's otherwise. Pro's main model is told from
  Flash's by its first two layers, compressed at ratio 128 where Flash's two are sliding-window
  only (compress_ratios opens [128, 128] in V4-Pro's config.json, model/presets.py, and in the
  one third-party copy of Pro-0813's that lists them; [0, 0] in V4-Flash's and Flash-0731's).
  That mark holds at any size, so a tiny Pro-0813 is told apart as the release is; the stage
  placement would not do: both releases put their stages on their last three layers (40-42 of
  43, 58-60 of 61).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from dsv4.model.config import SUPPORTED_MODEL_TYPE, ModelConfig
from dsv4.model.presets import PRESETS
from dsv4.model.storage import FIELD, STORAGES

V41_MODEL_TYPE = "deepseek_v41"
NO_DRAFTER = "none"  # a checkpoint without draft layers: not a family of the registry
NO_DRAFTER_TITLE = "none: no draft layers (no mtp.* tensor)"
BASE_RELEASE = "base"  # model/storage.py's release kind of Base's expert storage
# a vision tower's tensors: the main model's encoder and aligner, the image embeddings, and the
# router bias for image tokens each draft stage carries (model/README.md has no vision model)
VISION_TENSOR = re.compile(r"(vision\.|aligner\.|image_|mtp\.\d+\.ffn\.gate\.bias_vl$)")
DEFAULT_EXPERT_DTYPE = next(f.default for f in fields(ModelConfig) if f.name == FIELD)  # absent or null
PRO_LEADING_RATIOS = PRESETS["pro"]["compress_ratios"][:2]  # [128, 128]; Flash's [0, 0]


def _has_vision(config: Mapping[str, Any], names: Iterable[str]) -> bool:
    layers = config.get("vision_n_layers")
    return (type(layers) is int and layers > 0) or any(VISION_TENSOR.match(n) for n in names)


def _on_pro(config: Mapping[str, Any]) -> bool:
    ratios = config.get("compress_ratios")
    return isinstance(ratios, list) and ratios[: len(PRO_LEADING_RATIOS)] == PRO_LEADING_RATIOS


def identify_drafter(config: Mapping[str, Any], names: Iterable[str], block: re.Pattern[str]) -> str | None:
    """The drafter family the checkpoint with this config.json and these tensor names holds;
    NO_DRAFTER when no name is a draft block's (`block`: the layout's block prefix, `mtp.N.` in
    native names); None for a model that is not DeepSeek V4's (the config loader refuses it)."""
    names = list(names)
    family = _family(config, names)
    return NO_DRAFTER if family is not None and not any(block.match(n) for n in names) else family


def _family(config: Mapping[str, Any], names: list[str]) -> str | None:
    """The drafter family of a model with this config.json and these tensor names, whether or
    not the tensors hold it; None for a model that is not DeepSeek V4's."""
    model_type = config.get("model_type", SUPPORTED_MODEL_TYPE)
    if model_type not in (SUPPORTED_MODEL_TYPE, V41_MODEL_TYPE):
        return None
    if model_type == V41_MODEL_TYPE:
        return "v41-dspark"
    if "dspark_target_layer_ids" not in config:
        storage = STORAGES.get(config.get(FIELD) or DEFAULT_EXPERT_DTYPE)
        return "base-mtp" if storage is not None and storage.release == BASE_RELEASE else "v4-mtp"
    if _has_vision(config, names):
        return "vision-exp"
    if _on_pro(config):
        return "pro-0813"
    return "dspark-0731"
