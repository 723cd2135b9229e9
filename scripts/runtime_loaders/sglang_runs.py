"""SGLang's draft loaders cut out of its wheel, run on NATIVE (which gives SGLang's parameters)
and on DRAFT against them."""

from __future__ import annotations

import ast
import concurrent.futures
import copy
import json
import logging
import re
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from .cut import cut, modules_in_place
from .recording import Recorder, RecordingParam, Report, assemble, attrs, run_loader
from .releases import SGLANG_COMMON, SGLANG_LOADERS, SRT, Cuts, cuts_for, pick
from .wheels import PINNED, Wheel

# the pinned release's cuts per loader (releases.py has every release's)
SGLANG_CUTS: dict[str, Cuts] = {
    name: cuts for name in SGLANG_LOADERS if (cuts := cuts_for(SGLANG_LOADERS, name, PINNED["sglang"])) is not None
}
# SGLang's FusedMoE registers only the fused experts.w13_* / experts.w2_* parameters
# (fused_moe_triton/layer.py:1804-1821), never a per-expert one.
PER_EXPERT = re.compile(r"\.experts\.\d+\.")


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


def env_defaults(wheel: Wheel) -> types.SimpleNamespace:
    """SGLang's `envs` with every flag at the default the wheel's environ.py gives it
    (`class Envs:` ... `SGLANG_OPT_FUSE_WQA_WKV = EnvBool(True)`, environ.py:1885 in 0.5.23):
    the flags a release's loader reads differ from release to release."""
    member = SRT + "environ.py"
    tree = ast.parse(wheel.source(member), member)
    envs = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Envs")
    flags = {}
    for node in envs.body:
        value = node.value if isinstance(node, ast.Assign) else None
        if isinstance(value, ast.Call) and value.args and isinstance(value.args[0], ast.Constant):
            default = value.args[0].value
            flags.update({t.id: types.SimpleNamespace(get=lambda d=default: d) for t in node.targets})
    return types.SimpleNamespace(**flags)


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
        "envs": env_defaults(wheel),
        "should_async_load": lambda _w: False,
        "use_npu_arch35_mxfp8_wo_a": lambda _q: False,
        "is_wint4afp8_or_wint4a16_config": lambda _q: False,
        "_is_npu": False,
        "log_info_on_rank0": lambda *a, **k: None,
        "default_weight_loader": recorder.load,
        "RUNAI_STREAMER_TENSOR_ATTR": "_sglang_runai_streamer_tensor",
        "dict": params_dict,
    }
    common = pick(SGLANG_COMMON, wheel.version)
    for member in {**common, **files}:
        names = [*common.get(member, []), *files.get(member, [])]
        cut(wheel.source(member), f"{wheel.path.name}/{member}", names, ns)
    fuse = ns.get("_fuse_deepseek_v4_wqkv_a_pair")
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

    if fuse is not None:  # before 0.5.19 load_weights fuses the pair inline (torch.cat)
        ns["_fuse_deepseek_v4_wqkv_a_pair"] = fuse_and_remember  # the wheel's function, its inputs noted
    ns["_dequant_fp8"] = dequant_stand_in
    ns["_remember_fed"] = remember
    return ns


_NAMED = object()  # what the stand-in's named_parameters() returns


def sglang_run(
    wheel: Wheel,
    loader: str,
    spec: Cuts,
    directory: Path,
    config: dict[str, Any],
    parameters: Iterable[str] | None,
) -> tuple[Report, Recorder, _Warnings]:
    """SGLang's `loader` (cut as `spec` says) on `directory`, its params_dict holding
    `parameters` (None: AnyParams)."""
    recorder, warnings = Recorder(), _Warnings()
    params = AnyParams(recorder) if parameters is None else {n: RecordingParam(n, recorder) for n in parameters}
    ns = sglang_namespace(wheel, spec.cuts, recorder, params, warnings)
    quant = config.get("quantization_config") or {}
    fake_fused_moe = types.ModuleType("sglang.srt.layers.moe.fused_moe_triton")
    fake_fused_moe.FusedMoE = ns["FusedMoE"]

    class StandIn:
        def named_parameters(self) -> object:
            return _NAMED

        def post_load_weights(self, *a: Any, **k: Any) -> None:
            return None

    model = type(spec.cls, (ns[spec.cls], StandIn), {})()
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
    with modules_in_place(modules):  # load_weights imports FusedMoE inside (deepseek_v4_dspark.py:1026)
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
    return report, recorder, warnings


def config_json(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())


def verify_sglang(
    wheel: Wheel, loader: str, draft: Path, native: Path, read_config: Callable[[Path], dict[str, Any]] = config_json
) -> Report:
    """SGLang's loader on DRAFT against the same loader on the native checkpoint (how SGLang
    serves the in-checkpoint draft today). The native run, its params_dict accepting any
    name but a per-expert one, gives SGLang's parameters; the DRAFT run has exactly those
    (so SGLang's own "not found in params_dict" warnings and its confidence-head check act
    as they would), and each must get the same bytes. DRAFT's tensors may be skipped only
    where the native run skips them too. `read_config` gives a directory's config as SGLang's
    model holds it (default: config.json as written)."""
    spec = cuts_for(SGLANG_LOADERS, loader, wheel.version)
    if spec is None:
        return Report(loader, absent=f"SGLang {wheel.version}")
    config = read_config(draft)
    ref, ref_rec, _ = sglang_run(wheel, loader, spec, native, read_config(native), None)
    report, rec, warnings = sglang_run(wheel, loader, spec, draft, config, ref_rec.records)
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
