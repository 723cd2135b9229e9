"""convert/schemes/ct_match.py against vLLM 0.33.0's own functions, cut out of the cached wheel
(scripts/runtime_loaders/cut.py) and run unchanged: for every draft module name of the tiny
MTP drafts, on each platform, under each config below, the group (or none) vLLM's
get_scheme_dict finds equals what the re-written matcher finds, and where vLLM raises, the
matcher refuses. The V4 name mappers and AMD's re-keying are the wheel's too."""

from __future__ import annotations

import ast
import copy
import fnmatch
import re
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from types import MappingProxyType
from typing import Any, Literal, cast

import pytest
from compressed_tensors import CompressionFormat
from compressed_tensors.quantization import (
    ActivationOrdering,
    QuantizationArgs,
    QuantizationType,
    preset_name_to_scheme,
)

from dsv4.convert.errors import PlanError
from dsv4.convert.inmemory import bundled_plan
from dsv4.convert.schemes import compressed_tensors as ct
from dsv4.convert.schemes.base import LayerMap, layer_map
from dsv4.convert.schemes.ct_config import parse
from dsv4.convert.schemes.ct_match import (
    IGNORED,
    NEVER_QUANTISED,
    PLATFORMS,
    DraftModule,
    Resolver,
    class_of,
    regex_table,
    vllm_name,
)
from dsv4.convert.synth import write_checkpoint
from dsv4.model.native import standalone_draft_layout
from scripts.runtime_loaders.cut import cut
from scripts.runtime_loaders.wheels import Wheel, wheel_cache, wheel_path

ERROR = partial(PlanError, kind="quant_carry")
N = 43  # the target's num_hidden_layers (Flash): the draft is model.layers.43
V = "vllm/"
Q = V + "model_executor/layers/quantization/"


@dataclass
class WeightsMapper:
    """The wheel's WeightsMapper fields (model_executor/models/utils.py:49-61); its methods are
    cut from the wheel and mixed in below."""

    orig_to_new_renaming: list[Any] = field(default_factory=list)
    orig_to_new_regex: Mapping[Any, Any] = field(default_factory=dict)
    orig_to_new_substr: Mapping[str, Any] = field(default_factory=dict)
    orig_to_new_stacked: Mapping[str, Any] = field(default_factory=dict)
    orig_to_new_prefix: Mapping[str, Any] = field(default_factory=dict)
    orig_to_new_suffix: Mapping[str, Any] = field(default_factory=dict)


class _Logger:
    def warning_once(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def wheel() -> dict[str, Any]:
    w = Wheel(wheel_path(wheel_cache(), "vllm"))
    ns: dict[str, Any] = {
        "re": re,
        "cast": cast,
        "fnmatch": fnmatch.fnmatch,
        "Iterable": Iterable,
        "Mapping": Mapping,
        "MappingProxyType": MappingProxyType,
        "replace": replace,
        "logger": _Logger(),
        "QuantizationArgs": QuantizationArgs,
        "ActivationOrdering": ActivationOrdering,
        "QuantizationType": QuantizationType,
        "CompressionFormat": CompressionFormat,
    }
    cut(
        w.source(Q + "utils/config_utils.py"),
        "config_utils.py",
        ["find_matching_patterns", "is_equal_or_regex_match"],
        ns,
    )
    ct_utils = Q + "compressed_tensors/utils.py"
    names = ["is_activation_quantization_format", "should_ignore_layer", "find_matched_target"]
    cut(w.source(ct_utils), "ct_utils.py", [*names, "_find_first_match", "_match_fused_layer"], ns)
    methods = ["apply_vllm_mapper", "get_scheme_dict", "_add_fused_moe_to_target_scheme_map"]
    methods.append("_quantization_scheme_map_from_config")
    cut(
        w.source(Q + "compressed_tensors/compressed_tensors.py"),
        "ct.py",
        [f"CompressedTensorsConfig.{m}" for m in methods],
        ns,
    )
    mapper_methods = ["map_name", "_map_name", "_map_name_with_shard", "get_rename_mapper", "apply_list"]
    cut(
        w.source(V + "model_executor/models/utils.py"),
        "models_utils.py",
        [f"WeightsMapper.{m}" for m in mapper_methods],
        ns,
    )
    ns["WeightsMapper"] = dataclass(type("WeightsMapper", (WeightsMapper, ns["WeightsMapper"]), {}))
    for platform in ("nvidia", "amd"):
        sub: dict[str, Any] = dict(ns)
        cut(
            w.source(V + f"models/deepseek_v4/{platform}/model.py"),
            f"{platform}_model.py",
            ["_make_deepseek_v4_weights_mapper"],
            sub,
        )
        ns[f"mapper_{platform}"] = sub["_make_deepseek_v4_weights_mapper"]("fp4").get_rename_mapper()
        tree = ast.parse(w.source(V + f"models/deepseek_v4/{platform}/model.py"))
        packed = next(
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "packed_modules_mapping"
        )
        ns[f"packed_{platform}"] = ast.literal_eval(packed)
    ns["packed_xpu"] = ast.literal_eval(
        next(
            n.value
            for n in ast.walk(ast.parse(w.source(V + "models/deepseek_v4/xpu/model.py")))
            if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "packed_modules_mapping"
        )
    )
    cut(w.source(V + "models/deepseek_v4/quant_config.py"), "quant_config.py", ["align_mtp_quant_config"], ns)
    ns |= {"Literal": Literal, "fnmatch": fnmatch.fnmatch}
    cut(w.source(Q + "utils/quant_utils.py"), "quant_utils.py", ["is_layer_skipped"], ns)
    modelopt = ["ModelOptQuantConfigBase.is_layer_excluded", "ModelOptQuantConfigBase.apply_vllm_mapper"]
    cut(w.source(Q + "modelopt.py"), "modelopt.py", modelopt, ns)
    layer_py = ast.parse(w.source(V + "model_executor/layers/fused_moe/layer.py"))
    factory = next(n for n in ast.walk(layer_py) if isinstance(n, ast.FunctionDef) and n.name == "FusedMoEFactory")
    params = [*factory.args.args, *factory.args.kwonlyargs]
    values = [*factory.args.defaults, *factory.args.kw_defaults]
    defaults = {a.arg: d for a, d in zip(reversed(params), reversed(values), strict=False)}
    for platform in ("nvidia", "xpu", "amd"):
        tree = ast.parse(w.source(V + f"models/deepseek_v4/{platform}/model.py"))
        call = next(
            n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "FusedMoEFactory"
        )
        given = next((k.value for k in call.keywords if k.arg == "ckpt_names"), defaults["ckpt_names"])
        gate, down, up = ast.literal_eval(given)
        ns[f"probes_{platform}"] = (gate, up, down)  # get_moe_method's order (compressed_tensors_moe.py:36-43)
    return ns


def _vllm_config(ns: dict[str, Any], qc: dict[str, Any], platform: str) -> Any:
    """The target's CompressedTensorsConfig as the draft meets it on `platform`: mapped by the
    target model's rename mapper (model_loader/utils.py:381-387), AMD's MTP re-keying."""
    config = object.__new__(ns["CompressedTensorsConfig"])
    qc = copy.deepcopy(qc)
    config.target_scheme_map = ns["CompressedTensorsConfig"]._quantization_scheme_map_from_config(config=qc)
    config.ignore = list(qc.get("ignore", []))
    config.quant_format = qc.get("format")
    config.kv_cache_scheme = None
    config.apply_vllm_mapper(ns["mapper_amd" if platform == "amd" else "mapper_nvidia"])
    config.packed_modules_mapping = ns[f"packed_{platform}"]
    if platform == "amd":
        hf = types.SimpleNamespace(num_hidden_layers=N, num_nextn_predict_layers=1)
        utils = types.ModuleType("vllm.model_executor.models.utils")
        utils.WeightsMapper = ns["WeightsMapper"]
        saved = {
            k: sys.modules.get(k) for k in ("vllm", "vllm.model_executor", "vllm.model_executor.models", utils.__name__)
        }
        for k in saved:
            sys.modules[k] = utils if k == utils.__name__ else types.ModuleType(k)
        try:
            ns["align_mtp_quant_config"](config, hf)
        finally:
            for k, v in saved.items():
                sys.modules.pop(k) if v is None else sys.modules.__setitem__(k, v)
    return config


def _vllm_answer(config: Any, module: DraftModule, probes: tuple[str, ...]) -> object:
    layer = type(class_of(module.name), (), {})()
    names = [module.name]
    if module.kind == "moe":
        config._add_fused_moe_to_target_scheme_map()
        names = [f"{module.name}.0.{p}" for p in probes]
    try:
        found = [config.get_scheme_dict(layer, n) for n in names]
    except ValueError:
        return "raises"
    if any(f != found[0] for f in found):
        return "raises"  # compressed_tensors_moe.py:51-55
    s = found[0]
    return None if s is None else (s["weights"].model_dump(mode="json", exclude_none=True), s["format"])


def _my_answers(qc: dict[str, Any], modules: list[DraftModule], platform: str) -> list[object]:
    config = parse(qc, "t", ERROR)
    resolver = Resolver(config, platform, N, 1, regex_table(config, modules, "t", ERROR))
    out: list[object] = []
    for module in modules:
        try:
            found = resolver.resolve(module)
        except ValueError:
            out.append("raises")
            continue
        out.append(None if found is None or found == IGNORED else (found.weights, found.format))
    return out


def _group(preset: str, targets: list[str], fmt: str) -> dict[str, Any]:
    return {**preset_name_to_scheme(preset, targets).model_dump(mode="json", exclude_none=True), "format": fmt}


W4, FP8 = ("W4A16", "pack-quantized"), ("FP8_BLOCK", "float-quantized")
CONFIGS: dict[str, dict[str, Any]] = {
    "linear-class": {"config_groups": {"g": _group(*W4[:1], ["Linear"], W4[1])}, "ignore": ["lm_head", "re:^mtp.*"]},
    "exact-mtp-ignore": {
        "config_groups": {"g": _group("W4A16", ["Linear"], "pack-quantized")},
        "ignore": ["mtp.0.e_proj", "mtp.0.attn.wq_a", "mtp.0.attn.wkv", "mtp.0.ffn.shared_experts.w2"],
    },
    "layer-regex-ignore": {
        "config_groups": {"g": _group("W4A16", ["Linear"], "pack-quantized")},
        "ignore": [r"re:.*layers\.43\..*"],
    },
    "exact-layer-names": {
        "config_groups": {
            "a": _group("FP8_BLOCK", ["layers.43.attn.wq_b", "layers.43.ffn.shared_experts.w2"], "float-quantized"),
            "b": _group("W4A16", ["linear"], "pack-quantized"),
        },
        "ignore": ["layers.43.attn.wq_a", "layers.43.attn.wkv"],
    },
    "one-shard-ignored": {
        "config_groups": {"g": _group("W4A16", ["Linear"], "pack-quantized")},
        "ignore": [r"re:.*\.wkv$"],
    },
    "expert-regex-w123": {
        "config_groups": {
            "e": _group("MXFP4A16", [r"re:.*experts\.\d+\.w[123]$"], "mxfp4-pack-quantized"),
            "g": _group("W4A16", ["Linear"], "pack-quantized"),
        },
        "ignore": [r"re:.*wo_a$"],
    },
    "experts-class": {
        "config_groups": {
            "e": _group("NVFP4A16", ["RoutedExperts"], "nvfp4-pack-quantized"),
            "a": _group("FP8_BLOCK", ["re:.*attn.*"], "float-quantized"),
        },
        "ignore": [],
    },
    "fused-shards-targeted": {
        "config_groups": {"a": _group("FP8_BLOCK", [r"re:.*\.(wq_a|wkv|w1|w3)$"], "float-quantized")},
        "ignore": [],
    },
}


@pytest.fixture(scope="module")
def draft() -> tuple[LayerMap, Any]:
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp())
    plan = bundled_plan(write_checkpoint(root / "instruct", preset="tiny", variant="instruct", seed=0))
    return layer_map(plan).renumbered(N), standalone_draft_layout(plan.model_config)


def _modules(layers: LayerMap) -> list[DraftModule]:
    return [
        DraftModule(vllm_name(m), layers.kinds[m]) for m in layers.parts if not NEVER_QUANTISED.search(vllm_name(m))
    ]


@pytest.mark.parametrize("name", [*CONFIGS, "overlay", "bf16-overlay"])
def test_the_matcher_answers_as_vllm_on_every_draft_module_and_platform(
    wheel: dict[str, Any], draft: tuple[LayerMap, Any], name: str
) -> None:
    layers, native = draft
    if name in CONFIGS:
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", **CONFIGS[name]}
    else:
        qc = ct.overlay_config(
            {"quant_method": "compressed-tensors", **CONFIGS["linear-class"]},
            layers,
            native,
            bf16=name == "bf16-overlay",
        )
    disagree = []
    for platform in PLATFORMS:
        config = _vllm_config(wheel, qc, platform)
        modules = _modules(layers)
        for module, mine in zip(modules, _my_answers(qc, modules, platform), strict=True):
            theirs = _vllm_answer(config, module, wheel[f"probes_{platform}"])
            if theirs != mine:
                disagree.append(f"{platform} {module.name}: vLLM {theirs}, ours {mine}")
    assert not disagree, "\n".join(disagree)


def test_the_configs_reach_each_outcome(wheel: dict[str, Any], draft: tuple[LayerMap, Any]) -> None:
    """The comparison above is not vacuous: the configs give draft modules a scheme, none, and
    a vLLM error, and some module differently on NVIDIA than on XPU/AMD."""
    layers, _ = draft
    seen: set[str] = set()
    for name, body in CONFIGS.items():
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", **body}
        answers = {
            p: [_vllm_answer(_vllm_config(wheel, qc, p), m, wheel[f"probes_{p}"]) for m in _modules(layers)]
            for p in PLATFORMS
        }
        seen |= {"raises" if a == "raises" else "none" if a is None else "scheme" for a in answers["nvidia"]}
        if answers["nvidia"] != answers["xpu"]:
            seen.add(f"platforms differ: {name}")
        if answers["nvidia"] != answers["amd"]:
            seen.add(f"amd differs: {name}")
    assert {"raises", "none", "scheme", "platforms differ: expert-regex-w123", "amd differs: exact-mtp-ignore"} <= seen


EXCLUDES = {
    "lm-head": ["lm_head"],
    "mtp-star": ["lm_head", "mtp*"],
    "exact-mtp": ["mtp.0.e_proj", "mtp.0.attn.wq_a", "mtp.0.attn.wkv", "mtp.0.ffn.experts"],
    "layer-star": ["layers.43*"],
    "one-shard": ["layers.43.attn.wkv"],
    "substring": ["shared_experts", "wo_"],
    "wildcards": ["*.ffn.experts", "model.layers.4?.attn.w[oq]_b"],
    "overlay": ["lm_head", "model.layers.43.*"],
}


def _vllm_excluded(ns: dict[str, Any], exclude: list[str], platform: str, name: str) -> object:
    config = object.__new__(ns["ModelOptQuantConfigBase"])
    config.exclude_modules = list(exclude)
    config.apply_vllm_mapper(ns["mapper_amd" if platform == "amd" else "mapper_nvidia"])
    config.packed_modules_mapping = ns[f"packed_{platform}"]
    if platform == "amd":
        rekey = ns["WeightsMapper"](orig_to_new_prefix={"model.mtp.0.": f"model.layers.{N}."})
        config.apply_vllm_mapper(rekey)  # what align_mtp_quant_config passes (quant_config.py:50-57)
    try:
        return config.is_layer_excluded(name)
    except ValueError:
        return "raises"


@pytest.mark.parametrize("name", list(EXCLUDES))
def test_modelopt_exclusion_answers_as_vllm_on_every_draft_module(
    wheel: dict[str, Any], draft: tuple[LayerMap, Any], name: str
) -> None:
    from dsv4.convert.schemes.ct_match import FUSED
    from dsv4.convert.schemes.modelopt import _mapped, excluded

    layers, _ = draft
    disagree = []
    for platform in PLATFORMS:
        for module in _modules(layers):
            try:
                mine: object = excluded(module.name, _mapped(EXCLUDES[name], platform, N, 1), FUSED[platform])
            except ValueError:
                mine = "raises"
            theirs = _vllm_excluded(wheel, EXCLUDES[name], platform, module.name)
            if mine != theirs:
                disagree.append(f"{platform} {module.name}: vLLM {theirs}, ours {mine}")
    assert not disagree, "\n".join(disagree)


def test_the_exclusions_reach_each_outcome(wheel: dict[str, Any], draft: tuple[LayerMap, Any]) -> None:
    layers, _ = draft
    seen: set[object] = set()
    for name, exclude in EXCLUDES.items():
        answers = {p: [_vllm_excluded(wheel, exclude, p, m.name) for m in _modules(layers)] for p in PLATFORMS}
        seen |= set(answers["nvidia"])
        if answers["amd"] != answers["nvidia"]:
            seen.add(f"amd differs: {name}")
    assert {True, False, "raises", "amd differs: exact-mtp"} <= seen
