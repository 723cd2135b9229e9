"""Run vLLM 0.33.0's and SGLang 0.5.23's own draft loaders, cut out of their wheels, on CPU.

    .venv/bin/python scripts/verify_runtimes.py DRAFT --expected XPU_OUT --native NATIVE \
        [--wheels DIR] [--loader NAME ...] [--json]
    .venv/bin/python scripts/verify_runtimes.py --fetch-wheels [--wheels DIR]

DRAFT is the directory fed to the loaders (a `--target draft` output, or anything else to
see what the runtimes make of it); XPU_OUT is the `--target xpu` output of NATIVE, the
native checkpoint DRAFT comes from. The wheels (`pip download --no-deps vllm==0.33.0`,
`sglang==0.5.23`) are cached in --wheels (default: $DSV4_WHEELS, else
~/.cache/dsv4-convert/wheels) and downloaded on first use, or by --fetch-wheels alone (the
test command's install step, scripts/test.sh); only the few .py files named in VLLM_COMMON, VLLM_CUTS,
SGLANG_COMMON and SGLANG_CUTS are read from them, never imported as packages. The loaders
run: vLLM DeepSeekV4MTP.load_weights of xpu/, nvidia/ and amd/ mtp.py for an MTP config,
vLLM xpu DSparkDeepseekV4ForCausalLM.load_weights for a config with dspark_* fields;
SGLang DeepseekV4ForCausalLMNextN.load_weights (which is DeepseekV4ForCausalLM.load_weights
with is_nextn=True) and DeepseekV4ForCausalLMDSpark.load_weights.

"Cut out": each named function, assignment or method is taken from the wheel's source
file with `ast` and compiled under that file's name (tracebacks point into the wheel, with
its line numbers); the runtime's own name mapping, filtering, expert mapping and checks
run as written. What is stubbed:

* the model object. `config`: DRAFT's config.json as attributes (what hf_config holds for
  these fields); `model.layers`: stand-ins whose MoE is not a mega-MoE (`use_mega_moe`,
  `use_native_mega_moe` False: the default FusedMoE path, experts under
  `ffn.experts.routed_experts`) and has no fused shared experts; SGLang: no vision tower, no
  fused shared experts, one pipeline stage, confidence head enabled (its default: ragged
  verify not STATIC), `wo_a_fp8` as deepseek_v4.py:280-287 computes it for the config.
* the parameters. vLLM: one `RecordingParam` per tensor of XPU_OUT (the bundled model's
  layout, which `check` verifies against the model; vLLM's XPU in-memory names,
  mapping/README.md). SGLang (whose parameter names this project has no model of): the
  names SGLang's own loader asks for when it loads NATIVE (how SGLang serves the
  in-checkpoint draft today), its params_dict accepting any name but a per-expert one
  (SGLang's FusedMoE registers only fused experts.w13_/w2_ parameters); DRAFT then runs
  against exactly those names.
* every `weight_loader` (and `default_weight_loader`) records (tensor fed, shard id,
  expert id, bytes) and returns True; the shards are assembled as vLLM's and SGLang's
  MergedColumnParallel/FusedMoE loaders do at tensor-parallel size 1 (stacked shards in id
  order along dim 0; experts in id order, w13 = w1 then w3).
* collaborators: loggers (SGLang's warnings are kept and count as errors), tensor-parallel
  world size 1, sequence parallelism off, async loading off (SGLang loads inline), the
  env flags at their defaults (SGLANG_OPT_FUSE_WQA_WKV on), `quant_config` from
  config.json's `quantization_config`; SGLang's `_dequant_fp8` (it needs einops) passes
  the FP8 weight on unchanged, in both its runs, while the wo_a pairing around it runs.

Pass rule per loader: no error (nor SGLang warning); no fed tensor skipped except those the
runtime's draft has no place for (vLLM: the xpu table's [copy] sources embed.weight and
head.weight, taken from the target at run time, and its [skip] rules on `mtp.*` names, the
DSpark confidence head that vLLM's XPU class drops on purpose, xpu/dspark.py:406-407;
SGLang: what it skips in NATIVE too); every parameter except the shared ones (vLLM: the
table's [copy] targets) hit, holding exactly XPU_OUT's bytes (SGLang: the bytes the NATIVE
run put there). Exit 0 when every loader passes, 1 otherwise, 2 on a usage error.
"""

from __future__ import annotations
import __future__

import argparse
import ast
import concurrent.futures
import copy
import json
import logging
import os
import re
import subprocess
import sys
import types
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dsv4.mapping.table import Table, expand, load_table
from dsv4.mapping.targets import require_target, serving_targets
from dsv4.model.checkpoint import local_weight_map
from dsv4.model.errors import DSV4Error

# the runtime releases the draft target says its layouts were verified against: the wheels
# this script runs (one statement of each version: mapping/targets/draft.toml)
_VERIFIED = dict(require_target(serving_targets()[0]).runtimes)
WHEELS = {"vllm": f"vllm=={_VERIFIED['vLLM']}", "sglang": f"sglang=={_VERIFIED['SGLang']}"}
WHEELS_ENV = "DSV4_WHEELS"  # the wheel cache, where it is not the default one
DEFAULT_WHEELS = Path.home() / ".cache" / "dsv4-convert" / "wheels"
V4 = "vllm/models/deepseek_v4/"
# What every vLLM loader run below needs besides its own class, each the wheel's own code:
# the expert mapping and the spec-layer test.
VLLM_COMMON = {
    "vllm/model_executor/models/utils.py": ["get_spec_layer_idx_from_weight_name"],
    "vllm/model_executor/layers/fused_moe/layer.py": ["fused_moe_make_expert_params_mapping"],
    "vllm/model_executor/layers/fused_moe/routed_experts.py": [
        "RoutedExperts.make_expert_params_mapping",
        "RoutedExperts.build_expert_params_mapping",
    ],
    "vllm/distributed/eplb/eplb_state.py": ["EplbState.build_initial_global_physical_to_logical_map"],
    "vllm/utils/math_utils.py": ["cdiv"],
}
# platform -> (file, the names cut out of it) for the draft model class; the entry's class
# is the one whose load_weights runs.
VLLM_CUTS: dict[str, dict[str, Any]] = {
    "vllm-xpu-mtp": {
        "class": "DeepSeekV4MTP",
        "cuts": {
            V4 + "xpu/mtp.py": [
                "_EXPERT_SCALE_RE",
                "DeepSeekV4MTP.load_weights",
                "DeepSeekV4MTP.finalize_mega_moe_weights",
                "DeepSeekV4MTP._rewrite_spec_layer_name",
            ],
            V4 + "xpu/model.py": ["make_deepseek_v4_expert_params_mapping"],
        },
    },
    "vllm-nvidia-mtp": {
        "class": "DeepSeekV4MTP",
        "cuts": {
            V4 + "nvidia/mtp.py": [
                "_EXPERT_SCALE_RE",
                "DeepSeekV4MTP.load_weights",
                "DeepSeekV4MTP._to_spec_layer_name",
                "DeepSeekV4MTP._rewrite_spec_layer_name",
            ],
            V4 + "nvidia/model.py": [
                "make_deepseek_v4_expert_params_mapping",
                "DeepseekV4Model._pad_shared_expert_weight",
            ],
        },
    },
    "vllm-amd-mtp": {
        "class": "DeepSeekV4MTP",
        "cuts": {
            V4 + "amd/mtp.py": [
                "_EXPERT_SCALE_RE",
                "DeepSeekV4MTP.load_weights",
                "DeepSeekV4MTP._rewrite_spec_layer_name",
            ],
        },
    },
    "vllm-xpu-dspark": {
        "class": "DSparkDeepseekV4ForCausalLM",
        "cuts": {
            V4 + "xpu/dspark.py": [
                "_EXPERT_SCALE_RE",
                "DSparkDeepseekV4ForCausalLM.load_weights",
                "DSparkDeepseekV4ForCausalLM._finalize_moe",
                "DSparkDeepseekV4ForCausalLM._remap_dspark_name",
            ],
            V4 + "xpu/model.py": ["make_deepseek_v4_expert_params_mapping"],
        },
    },
}
SRT = "sglang/srt/"
SGLANG_COMMON = {
    SRT + "models/deepseek_v4.py": [
        "DEEPSEEK_V4_STACKED_PARAMS_MAPPING",
        "_dequant_fp8_wo_a_streaming",
        "_prepare_deepseek_v4_weights",
        "_rename_quark_fp8_block_scales",
        "_fuse_deepseek_v4_wqkv_a_pair",
        "_clone_if_runai_streamed_tensor",
        "DeepseekV4ForCausalLM.load_weights",
        "DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format",
    ],
    SRT + "layers/moe/fused_moe_triton/layer.py": ["FusedMoE.make_expert_params_mapping"],
    SRT + "layers/utils/common.py": ["get_layer_id"],
    SRT + "model_loader/utils.py": ["maybe_executor_submit"],
}
SGLANG_CUTS: dict[str, dict[str, Any]] = {
    "sglang-nextn": {
        "class": "DeepseekV4ForCausalLMNextN",
        "cuts": {SRT + "models/deepseek_v4_nextn.py": ["DeepseekV4ForCausalLMNextN.load_weights"]},
    },
    "sglang-dspark": {
        "class": "DeepseekV4ForCausalLMDSpark",
        "cuts": {
            SRT + "models/deepseek_v4_dspark.py": [
                "_dspark_stage_config",
                "DeepseekV4ForCausalLMDSpark.load_weights",
                "DeepseekV4ForCausalLMDSpark._assert_confidence_head_loaded",
                "DeepseekV4ForCausalLMDSpark._remap_dspark_weight_name",
            ]
        },
    },
}
# SGLang's FusedMoE registers only the fused experts.w13_* / experts.w2_* parameters
# (fused_moe_triton/layer.py:1804-1821), never a per-expert one.
PER_EXPERT = re.compile(r"\.experts\.\d+\.")


class UsageError(Exception):
    """A missing directory or wheel: exit 2 with one line."""


# --- the wheels -----------------------------------------------------------------------


def wheel_cache() -> Path:
    """The wheel cache: $DSV4_WHEELS where it is set, else DEFAULT_WHEELS. The one rule the
    script, scripts/test.sh (through --fetch-wheels) and the tests follow."""
    return Path(os.environ.get(WHEELS_ENV) or DEFAULT_WHEELS)


def wheels_cached(cache: Path) -> bool:
    """Every pinned wheel is in `cache` already."""
    return all(sorted(cache.glob(f"{p}-{pin.split('==')[1]}-*.whl")) for p, pin in WHEELS.items())


def wheel_path(cache: Path, package: str) -> Path:
    """The cached wheel of `package` (WHEELS' pin), downloaded with pip on first use."""
    pin = WHEELS[package]
    version = pin.split("==")[1]
    found = sorted(cache.glob(f"{package}-{version}-*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", pin, "-d", str(cache)]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise UsageError(f"{cache}: pip download --no-deps {pin} failed")
        found = sorted(cache.glob(f"{package}-{version}-*.whl"))
    if not found:
        raise UsageError(f"{cache}: no {package}-{version} wheel after pip download")
    return found[0]


@dataclass
class Wheel:
    path: Path

    @cached_property
    def _zip(self) -> zipfile.ZipFile:  # read the (336 MB) wheel's directory once
        return zipfile.ZipFile(self.path)

    def source(self, member: str) -> str:
        return self._zip.read(member).decode()


# --- cutting functions out of a source file --------------------------------------------


def cut(source: str, filename: str, names: Iterable[str], namespace: dict[str, Any]) -> None:
    """Compile the top-level functions, assignments and class methods `names` ("f", "X",
    "Class.method") of `source` into `namespace`, keeping the file's line numbers.

    A class is rebuilt with only the methods named, and of its bases only those already in
    `namespace` (cut out before it); its other collaborators come from the stand-in it is
    mixed with, so nothing else of the file runs.
    """
    tree = ast.parse(source, filename)
    wanted = list(names)
    by_class: dict[str, list[str]] = {}
    top: list[str] = []
    for name in wanted:
        owner, _, member = name.partition(".")
        (by_class.setdefault(owner, []).append(member) if member else top.append(name))
    body: list[ast.stmt] = []
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in top:
            body.append(node)
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            hit = [t.id for t in targets if isinstance(t, ast.Name) and t.id in top]
            if hit:
                body.append(node)
                found.update(hit)
        elif isinstance(node, ast.ClassDef) and node.name in by_class:
            methods = [
                m
                for m in node.body
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name in by_class[node.name]
            ]
            found.update(f"{node.name}.{m.name}" for m in methods)
            bases = [b for b in node.bases if isinstance(b, ast.Name) and b.id in namespace]
            cls = ast.ClassDef(
                name=node.name,
                bases=bases,
                keywords=[],
                body=methods or [ast.Pass()],
                decorator_list=[],
                type_params=[],
            )
            ast.copy_location(cls, node)
            body.append(cls)
    missing = [n for n in wanted if n not in found]
    if missing:
        raise UsageError(f"{filename}: not found in the wheel: {', '.join(missing)}")
    module = ast.Module(body=body, type_ignores=[])
    ast.fix_missing_locations(module)
    # the wheels' files use `from __future__ import annotations`: their annotations stay text
    code = compile(module, filename, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)  # noqa: S102 - the pinned wheel's own code


# --- the stand-ins -----------------------------------------------------------------------


@dataclass
class Record:
    tensor: str
    shard: Any
    expert: int | None
    data: torch.Tensor


@dataclass
class Recorder:
    """Which fed tensor each weight_loader call came from, and what it was given."""

    current: str = ""
    records: dict[str, list[Record]] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)
    # a tensor a loader built from fed ones (SGLang fuses wq_a and wkv, the first one held
    # back until the second arrives) -> the fed tensors it holds
    made_of: dict[int, list[str]] = field(default_factory=dict)

    def load(self, param: RecordingParam, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        shard = kwargs.get("shard_id", args[-1] if args and not kwargs else None)
        sources = self.made_of.get(id(loaded), [self.current])
        self.records.setdefault(param.name, []).append(
            Record(", ".join(sources), shard, kwargs.get("expert_id"), loaded)
        )
        self.touched.update(sources)
        return True


class RecordingParam:
    """A parameter stand-in: its name and a weight_loader that records."""

    def __init__(self, name: str, recorder: Recorder) -> None:
        self.name = name
        self.weight_loader = recorder.load


def attrs(obj: Any) -> Any:
    """A JSON value with attribute access for objects (as transformers' config gives)."""
    if isinstance(obj, dict):
        return types.SimpleNamespace(**{k: attrs(v) for k, v in obj.items()})
    if isinstance(obj, list):
        return [attrs(v) for v in obj]
    return obj


def stand_in_layer() -> Any:
    moe = types.SimpleNamespace(
        use_mega_moe=False,
        use_native_mega_moe=False,
        finalize_mega_moe_weights=lambda: None,
        experts=types.SimpleNamespace(has_fused_shared_experts=False),
    )
    return types.SimpleNamespace(ffn=moe, mtp_block=types.SimpleNamespace(ffn=moe))


class _Logger:
    def __getattr__(self, _name: str) -> Callable[..., None]:
        return lambda *a, **k: None


# --- reading the directories -------------------------------------------------------------


def read_tensors(root: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint directory, in the index's order (as vLLM iterates)."""
    weight_map, _ = local_weight_map(root)
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    for shard in sorted(by_shard):
        with safe_open(root / shard, framework="pt") as f:
            for name in sorted(by_shard[shard]):
                yield name, f.get_tensor(name)


def raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


# --- one run -----------------------------------------------------------------------------


@dataclass
class Report:
    loader: str
    fed: int = 0
    hit: dict[str, str] = field(default_factory=dict)  # parameter -> the tensors it got
    skipped: list[str] = field(default_factory=list)  # fed, never reached a weight_loader
    errors: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # non-shared parameters not hit
    unequal: list[str] = field(default_factory=list)  # hit, bytes differ from XPU_OUT
    dropped: list[str] = field(default_factory=list)  # skipped, and the table says so

    @property
    def passed(self) -> bool:
        return not (self.errors or self.skipped or self.missing or self.unequal)

    def summary(self) -> dict[str, Any]:
        return {
            "loader": self.loader,
            "passed": self.passed,
            "fed": self.fed,
            "parameters_hit": len(self.hit),
            "skipped_as_the_table_says": self.dropped,
            "skipped": self.skipped,
            "errors": self.errors,
            "missing": self.missing,
            "bytes_unequal": self.unequal,
            "hit": self.hit,
        }


def assemble(records: list[Record]) -> bytes:
    """The bytes a parameter holds after its weight_loader calls, at tensor-parallel size 1."""
    if any(r.expert is not None for r in records):
        order = {"w1": 0, "w3": 1, "w2": 0}
        return b"".join(raw(r.data) for r in sorted(records, key=lambda r: (r.expert, order[r.shard])))
    if len(records) > 1:
        return b"".join(raw(r.data) for r in sorted(records, key=lambda r: r.shard))
    return raw(records[0].data)


def duplicate_shards(records: list[Record]) -> list[str]:
    seen: set[tuple[Any, Any]] = set()
    dup = []
    for r in records:
        key = (r.expert, r.shard)
        if key in seen:
            dup.append(f"{r.tensor} (shard {r.shard}, expert {r.expert})")
        seen.add(key)
    return dup


def run_loader(
    name: str,
    load: Callable[[Iterable[tuple[str, torch.Tensor]], bool], Any],
    recorder: Recorder,
    draft: Path,
    expected: dict[str, torch.Tensor],
    droppable: Callable[[str], bool],
    shared_params: set[str],
    on_feed: Callable[[str, torch.Tensor], None] = lambda _n, _t: None,
) -> Report:
    """Feed every tensor of `draft` to `load(weights, completeness_check)`; on an exception,
    record it against the tensor being loaded and go on with the rest (a fresh call, its
    completeness check off: only the first call's is the runtime's)."""
    report = Report(name)
    tensors = list(read_tensors(draft))
    report.fed = len(tensors)
    position = 0

    def feed() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal position
        while position < len(tensors):
            tname, tensor = tensors[position]
            recorder.current = tname
            on_feed(tname, tensor)
            position += 1
            yield tname, tensor
        recorder.current = ""

    first = True
    while first or position < len(tensors):
        try:
            load(feed(), first)
        except Exception as exc:  # noqa: BLE001 - the runtime's error is the finding
            where = recorder.current or "(after the last tensor)"
            report.errors.append(f"{where}: {type(exc).__name__}: {exc}")
        first = False
    for tname, _ in tensors:
        if tname in recorder.touched:
            continue
        (report.dropped if droppable(tname) else report.skipped).append(tname)
    errored = {e.split(":", 1)[0] for e in report.errors}
    report.skipped = [t for t in report.skipped if t not in errored]
    for pname, records in sorted(recorder.records.items()):
        report.hit[pname] = ", ".join(sorted({r.tensor for r in records}))
        dup = duplicate_shards(records)
        if dup:
            report.errors.append(f"{pname}: loaded twice from {', '.join(dup)}")
        elif pname not in shared_params and (pname not in expected or assemble(records) != raw(expected[pname])):
            report.unequal.append(pname)
    report.missing = sorted(set(expected) - shared_params - set(recorder.records))
    return report


# --- vLLM --------------------------------------------------------------------------------


def vllm_namespace(
    wheel: Wheel, files: dict[str, list[str]], recorder: Recorder, completeness: list[bool]
) -> dict[str, Any]:
    """The module globals the cut-out code runs in: the wheel's functions, the stubs."""
    import typing
    from collections.abc import Callable as _Callable

    ns: dict[str, Any] = {
        "__name__": "cut_out_vllm",
        "re": re,
        "torch": torch,
        "typing": typing,
        "Callable": _Callable,
        "logger": _Logger(),
        "default_weight_loader": recorder.load,
        "is_mtp_completeness_check_enabled": lambda: completeness[0],
        "get_tensor_model_parallel_world_size": lambda: 1,
    }
    for member, names in {**VLLM_COMMON, **files}.items():
        cut(wheel.source(member), f"{wheel.path.name}/{member}", names, ns)
    return ns


def vllm_model(
    ns: dict[str, Any], cls_name: str, config: dict[str, Any], params: Iterable[str], recorder: Recorder
) -> Any:
    """The cut-out class mixed with a stand-in holding what its load_weights reads."""
    cfg = attrs(config)
    quant = attrs(config.get("quantization_config") or {})

    class StandIn:
        def named_parameters(self) -> Iterator[tuple[str, RecordingParam]]:
            for p in params:
                yield p, RecordingParam(p, recorder)

    model = type(cls_name, (ns[cls_name], StandIn), {})()
    model.config = cfg
    model.quant_config = quant
    if cls_name == "DSparkDeepseekV4ForCausalLM":
        stages = len(config["dspark_target_layer_ids"])
        model.model = types.SimpleNamespace(layers=[stand_in_layer() for _ in range(stages)])
    else:
        start, n = config["num_hidden_layers"], config["num_nextn_predict_layers"]
        model.model = types.SimpleNamespace(
            layers={str(start + i): stand_in_layer() for i in range(n)}, mtp_start_layer_idx=start, num_mtp_layers=n
        )
        # nvidia/mtp.py:308-310, with sequence parallelism off (one GPU)
        model.pad_shared_expert = getattr(quant, "weight_block_size", None) is not None
    return model


def verify_vllm(wheel: Wheel, loader: str, draft: Path, expected_dir: Path) -> Report:
    spec = VLLM_CUTS[loader]
    config = json.loads((draft / "config.json").read_text())
    expected = dict(read_tensors(expected_dir))
    droppable, shared_params = table_facts(load_table("xpu_dspark" if loader.endswith("dspark") else "xpu"), config)
    recorder = Recorder()
    completeness = [True]
    ns = vllm_namespace(wheel, spec["cuts"], recorder, completeness)
    model = vllm_model(ns, spec["class"], config, expected, recorder)

    def load(weights: Iterable[tuple[str, torch.Tensor]], first: bool) -> Any:
        completeness[0] = first
        return model.load_weights(weights)

    return run_loader(loader, load, recorder, draft, expected, droppable, shared_params)


def table_facts(table: Table, config: dict[str, Any]) -> tuple[Callable[[str], bool], set[str]]:
    """From the xpu table: which fed names the runtime may drop (the [copy] sources and the
    [skip] rules on the draft's own mtp.* names) and the shared parameters (the [copy]
    targets, {L} bound to each MTP layer num_hidden_layers + i)."""
    copies = [r for r in table.rules if r.op == "copy"]
    allowed = [
        rx
        for r in table.rules
        if r.op == "copy" or (r.op == "skip" and r.sources[0].startswith("mtp."))
        for rx in r.source_regexes
    ]
    layers = range(config["num_hidden_layers"], config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 1))
    shared = {expand(r.target, {"L": n}) for r in copies for n in layers}
    return (lambda name: any(rx.match(name) for rx in allowed)), shared


# --- SGLang ------------------------------------------------------------------------------


class AnyParams(dict):
    """SGLang's params_dict when its parameter names are not known: every name is a
    parameter except a per-expert one (PER_EXPERT); looking one up creates it."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and not PER_EXPERT.search(name)

    def __missing__(self, name: str) -> RecordingParam:
        if PER_EXPERT.search(name):
            raise KeyError(name)
        self[name] = RecordingParam(name, self.recorder)
        return self[name]


class _Warnings:
    """SGLang's logger: warnings are kept (an unknown name only warns there)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, msg: str, *args: Any) -> None:
        self.lines.append(msg % args if args else msg)

    def __getattr__(self, _name: str) -> Callable[..., None]:
        return lambda *a, **k: None


def sglang_namespace(
    wheel: Wheel, files: dict[str, list[str]], recorder: Recorder, params: dict[str, Any], warnings: _Warnings
) -> dict[str, Any]:
    def params_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
        # `dict(self.named_parameters())` in load_weights: hand it the stand-in's mapping
        return params if args and args[0] is _NAMED else dict_(*args, **kwargs)

    dict_ = dict
    ns: dict[str, Any] = {
        "__name__": "cut_out_sglang",
        "re": re,
        "torch": torch,
        "copy": copy,
        "concurrent": concurrent,
        "logging": logging,
        "logger": warnings,
        "envs": types.SimpleNamespace(
            SGLANG_OPT_FUSE_WQA_WKV=types.SimpleNamespace(get=lambda: True)
        ),  # its default, environ.py:1885
        "should_async_load": lambda _w: False,
        "use_npu_arch35_mxfp8_wo_a": lambda _q: False,
        "is_wint4afp8_or_wint4a16_config": lambda _q: False,
        "_is_npu": False,
        "log_info_on_rank0": lambda *a, **k: None,
        "default_weight_loader": recorder.load,
        "RUNAI_STREAMER_TENSOR_ATTR": "_sglang_runai_streamer_tensor",
        "dict": params_dict,
    }
    for member, names in {**SGLANG_COMMON, **files}.items():
        cut(wheel.source(member), f"{wheel.path.name}/{member}", names, ns)
    fuse = ns["_fuse_deepseek_v4_wqkv_a_pair"]
    fed_names: dict[int, str] = {}

    def fuse_and_remember(param_name: str, bucket: dict[str, torch.Tensor]) -> torch.Tensor:
        fused = fuse(param_name, bucket)
        recorder.made_of[id(fused)] = [fed_names.get(id(t), recorder.current) for t in bucket.values()]
        return fused

    def remember(name: str, tensor: torch.Tensor) -> None:
        fed_names[id(tensor)] = name

    def dequant_stand_in(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # SGLang's _dequant_fp8 needs einops: the FP8 bytes go on unchanged (in both runs),
        # noted as made of the weight and its scale; the pairing around it is the wheel's
        kept = weight.view(weight.dtype)
        recorder.made_of[id(kept)] = [
            fed_names.get(id(weight), recorder.current),
            fed_names.get(id(scale), recorder.current),
        ]
        return kept

    ns["_fuse_deepseek_v4_wqkv_a_pair"] = fuse_and_remember  # the wheel's function, its inputs noted
    ns["_dequant_fp8"] = dequant_stand_in
    ns["_remember_fed"] = remember
    return ns


_NAMED = object()  # what the stand-in's named_parameters() returns


def sglang_run(
    wheel: Wheel, loader: str, directory: Path, config: dict[str, Any], parameters: Iterable[str] | None
) -> tuple[Report, Recorder, _Warnings]:
    """SGLang's loader on `directory`, its params_dict holding `parameters` (None: AnyParams)."""
    spec = SGLANG_CUTS[loader]
    recorder, warnings = Recorder(), _Warnings()
    params = AnyParams(recorder) if parameters is None else {n: RecordingParam(n, recorder) for n in parameters}
    ns = sglang_namespace(wheel, spec["cuts"], recorder, params, warnings)
    quant = config.get("quantization_config") or {}
    fake_fused_moe = types.ModuleType("sglang.srt.layers.moe.fused_moe_triton")
    fake_fused_moe.FusedMoE = ns["FusedMoE"]

    class StandIn:
        def named_parameters(self) -> object:
            return _NAMED

        def post_load_weights(self, *a: Any, **k: Any) -> None:
            return None

    model = type(spec["class"], (ns[spec["class"]], StandIn), {})()
    model.config = attrs(config)
    model.quant_config = types.SimpleNamespace(get_name=lambda: quant.get("quant_method"), **quant)
    # deepseek_v4.py:280-287 with SGLANG_OPT_FP8_WO_A_GEMM at its default (environ.py:1871)
    model.wo_a_fp8 = quant.get("quant_method") == "fp8" and quant.get("weight_block_size") == [128, 128]
    model.num_fused_shared_experts = 0
    model.vision = None
    model.model = types.SimpleNamespace()
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    model.confidence_head = object()  # enabled unless ragged verify is STATIC (deepseek_v4_dspark.py:541-542)
    modules = {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.layers": types.ModuleType("sglang.srt.layers"),
        "sglang.srt.layers.moe": types.ModuleType("sglang.srt.layers.moe"),
        "sglang.srt.layers.moe.fused_moe_triton": fake_fused_moe,
    }
    saved = {k: sys.modules.get(k) for k in modules}
    sys.modules.update(modules)  # load_weights imports FusedMoE inside (deepseek_v4_dspark.py:1026)
    try:
        report = run_loader(
            loader,
            lambda weights, _first: model.load_weights(weights),
            recorder,
            directory,
            {},
            lambda _n: False,
            set(),
            ns["_remember_fed"],
        )
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return report, recorder, warnings


def verify_sglang(wheel: Wheel, loader: str, draft: Path, native: Path) -> Report:
    """SGLang's loader on DRAFT against the same loader on the native checkpoint (how SGLang
    serves the in-checkpoint draft today). The native run, its params_dict accepting any
    name but a per-expert one, gives SGLang's parameters; the DRAFT run has exactly those
    (so SGLang's own "not found in params_dict" warnings and its confidence-head check act
    as they would), and each must get the same bytes. DRAFT's tensors may be skipped only
    where the native run skips them too."""
    config = json.loads((draft / "config.json").read_text())
    ref, ref_rec, _ = sglang_run(wheel, loader, native, json.loads((native / "config.json").read_text()), None)
    report, rec, warnings = sglang_run(wheel, loader, draft, config, ref_rec.records)
    ref_skipped = set(ref.skipped)
    report.dropped = [t for t in report.skipped if t in ref_skipped]
    report.skipped = [t for t in report.skipped if t not in ref_skipped]
    report.unequal = []
    for pname, records in rec.records.items():
        if pname not in ref_rec.records or assemble(records) != assemble(ref_rec.records[pname]):
            report.unequal.append(pname)
    report.missing = sorted(set(ref_rec.records) - set(rec.records))
    report.errors += [f"{e} (native run)" for e in ref.errors]
    report.errors += [f"warning: {w}" for w in warnings.lines]
    return report


# --- the command -------------------------------------------------------------------------


def verify(draft: Path, expected: Path, native: Path, wheels: Path, loaders: list[str] | None = None) -> list[Report]:
    """Every applicable loader's report on `draft` (MTP loaders for an MTP config, the DSpark
    loaders for a config with dspark_* fields)."""
    for d in (draft, expected, native):
        if not (d / "config.json").is_file():
            raise UsageError(f"{d}: no config.json")
    is_dspark = "dspark_target_layer_ids" in json.loads((draft / "config.json").read_text())
    chosen = loaders or [n for n in [*VLLM_CUTS, *SGLANG_CUTS] if n.endswith("dspark") == is_dspark]
    reports = []
    opened: dict[str, Wheel] = {}
    for name in chosen:
        package = "vllm" if name in VLLM_CUTS else "sglang"
        wheel = opened.setdefault(package, Wheel(wheel_path(wheels, package)))
        verify_one = verify_vllm if package == "vllm" else verify_sglang
        reports.append(verify_one(wheel, name, draft, expected if package == "vllm" else native))
    return reports


def table_lines(reports: list[Report]) -> list[str]:
    lines = [
        "| loader | tensors fed | parameters hit | skipped as the table says | "
        "other skips | errors and warnings | params missing | bytes unequal | pass |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        lines.append(
            f"| {r.loader} | {r.fed} | {len(r.hit)} | {len(r.dropped)} | {len(r.skipped)} | "
            f"{len(r.errors)} | {len(r.missing)} | {len(r.unequal)} | {'yes' if r.passed else 'NO'} |"
        )
    for r in reports:
        for e in r.errors[:3]:
            lines.append(f"{r.loader}: error: {e}")
        if r.skipped:
            lines.append(f"{r.loader}: skipped {len(r.skipped)}, e.g. {', '.join(r.skipped[:3])}")
        if r.missing:
            lines.append(f"{r.loader}: missing {len(r.missing)}, e.g. {', '.join(r.missing[:3])}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("draft", type=Path, nargs="?", help="the directory fed to the runtimes' loaders")
    ap.add_argument(
        "--expected",
        type=Path,
        help="the --target xpu output of the same native checkpoint (parameters and their bytes)",
    )
    ap.add_argument(
        "--native",
        type=Path,
        help="the native checkpoint they come from (SGLang's loader on it gives SGLang's parameters and bytes)",
    )
    ap.add_argument(
        "--wheels", type=Path, default=wheel_cache(), help=f"wheel cache (default ${WHEELS_ENV}, else {DEFAULT_WHEELS})"
    )
    ap.add_argument(
        "--fetch-wheels", action="store_true", help="only download the wheels missing from the cache, and stop"
    )
    ap.add_argument(
        "--loader",
        action="append",
        choices=sorted(VLLM_CUTS) + sorted(SGLANG_CUTS),
        help="run only this loader (repeatable; default: every one for the drafter)",
    )
    ap.add_argument("--json", action="store_true", help="every report as JSON, per tensor")
    args = ap.parse_args(argv)
    if not args.fetch_wheels and None in (args.draft, args.expected, args.native):
        ap.error("DRAFT, --expected and --native are required (unless --fetch-wheels)")
    try:
        if args.fetch_wheels:
            for package in WHEELS:
                print(wheel_path(args.wheels, package))
            return 0
        reports = verify(args.draft, args.expected, args.native, args.wheels, args.loader)
    except (UsageError, DSV4Error) as exc:  # a missing wheel or directory, an unreadable checkpoint
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.summary() for r in reports], indent=1))
    else:
        print("\n".join(table_lines(reports)))
    return 0 if all(r.passed for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
