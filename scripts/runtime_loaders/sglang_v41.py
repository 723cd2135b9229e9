"""SGLang 0.5.23's DSpark loader on a DeepSeek V4.1 draft: DeepseekV4ForCausalLMDSpark, the class a V4.1
draft directory becomes (its architectures normalised to DeepseekV4ForCausalLM, configs/deepseek_v41.py:38-39;
its dspark_* keys mark a bundled DSpark head, dspark_config.py:162-174, configs/model_config.py:1041-1058),
its config normalised as SGLang's DeepseekV41Config does (normalize_deepseek_v41_config, cut out)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cut import cut
from .recording import Report
from .sglang_runs import config_json, verify_sglang
from .wheels import Wheel

SGLANG_V41_LOADER = "sglang-v41-dspark"
V41_CONFIG = "sglang/srt/configs/deepseek_v41.py"


class _PretrainedConfig:
    """transformers' PretrainedConfig, which _config_dict tests for: a config.json gives plain dicts."""


def v41_config_reader(wheel: Wheel) -> Callable[[Path], dict[str, Any]]:
    """A directory's config.json through the wheel's normalize_deepseek_v41_config (text_config
    flattened, vision_config's fields as vision_*, configs/deepseek_v41.py:5-40)."""
    ns: dict[str, Any] = {"__name__": "cut_out_sglang_v41", "PretrainedConfig": _PretrainedConfig}
    names = ["_VISION_FIELDS", "_config_dict", "normalize_deepseek_v41_config"]
    cut(wheel.source(V41_CONFIG), f"{wheel.path.name}/{V41_CONFIG}", names, ns)
    return lambda directory: ns["normalize_deepseek_v41_config"](config_json(directory))


def verify_sglang_v41(wheel: Wheel, draft: Path, native: Path) -> Report:
    """SGLang's DSpark loader on DRAFT against the same loader on NATIVE (sglang_runs.verify_sglang),
    both configs normalised."""
    report = verify_sglang(wheel, "sglang-dspark", draft, native, v41_config_reader(wheel))
    report.loader = SGLANG_V41_LOADER
    return report
