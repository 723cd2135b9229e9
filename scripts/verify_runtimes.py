"""Run vLLM's and SGLang's own draft loaders, cut out of their wheels, on CPU: by default the
releases the layouts were verified against (vLLM 0.33.0, SGLang 0.5.23), or any other release.

    .venv/bin/python scripts/verify_runtimes.py DRAFT --expected XPU_OUT --native NATIVE \
        [--wheels DIR] [--vllm-version X.Y.Z] [--sglang-version X.Y.Z] [--loader NAME ...] [--json]
    .venv/bin/python scripts/verify_runtimes.py DRAFT --serve-with TARGET [--overrides FILE] \
        --native NATIVE [--loader NAME ...] [--json]
    .venv/bin/python scripts/verify_runtimes.py V41_DRAFT --native NATIVE [--loader NAME ...] [--json]
    .venv/bin/python scripts/verify_runtimes.py --fetch-wheels [--wheels DIR] [--vllm-version X.Y.Z] ...

DRAFT is the directory fed to the loaders (a `--target draft` output, or anything else to
see what the runtimes make of it); XPU_OUT is the `--target xpu` output of NATIVE, the
native checkpoint DRAFT comes from. The wheels (`pip download --no-deps vllm==X.Y.Z`,
`sglang==X.Y.Z`) are cached in --wheels (default: $DSV4_WHEELS, else
~/.cache/dsv4-convert/wheels) and downloaded on first use, or by --fetch-wheels alone (the
test command's install step, scripts/test.sh: the pinned releases and the newest one the
drafter families' ranges claim, mapping/targets/draft.toml); only the few .py files that
runtime_loaders/releases.py names for the release (VLLM_COMMON, VLLM_LOADERS, SGLANG_COMMON,
SGLANG_LOADERS: per range of releases, the files, the names cut from them and the parameter
names that release's model gives where they are not the pinned one's) are read from them,
never imported as packages; a loader the release has not is reported as not in the release.
scripts/verify_releases.py runs every release and prints the release table. The loaders
run: vLLM DeepSeekV4MTP.load_weights of xpu/, nvidia/ and amd/ mtp.py for an MTP config,
vLLM xpu, nvidia and amd DSparkDeepseekV4ForCausalLM.load_weights for a config with dspark_*
fields (where a class keeps the confidence head, or NVIDIA's its context_wkv_proj, parameters
XPU_OUT has not, they hold the draft's own tensors: releases.py's `added`);
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

--serve-with TARGET (a compressed-tensors or ModelOpt target's config.json, or its directory) proves
instead that DRAFT loads beside that target, with vLLM's parameters built by vLLM's own
code rather than taken from an XPU_OUT (runtime_loaders/serve_verify.py, serve_runs.py,
vllm_build.py, vllm_layer.py, sglang_quant.py). --overrides FILE is the JSON value of
vLLM's --hf-overrides the target runs with: its quantization_config replaces the target's
wholesale (vllm/config/model.py:555-568, 616-629, 691-692). Per vLLM loader (nvidia, amd,
xpu DeepSeekV4MTP; nvidia, amd, xpu DSparkDeepseekV4ForCausalLM for a DSpark draft, NVIDIA's
with its context_wkv_proj, every stage's wkv stacked, nvidia/dspark.py:142-150, and NVIDIA's and
AMD's with the confidence head, built without the quant config):
  a. the config class vLLM picks for the target's effective quantization_config: the first of
     ModelOptFp8Config, ModelOptNvFp4Config whose override_quantization_method claims it
     (config/model.py:1396-1435), else the registry's class for its quant_method
     (quantization/__init__.py:163-164): CompressedTensorsConfig, ModelOptFp8Config or
     ModelOptNvFp4Config; its from_config on that quantization_config (DSpark: on the draft's
     own, the target's method with the draft's dict, config/speculative.py:1564-1566,
     dspark/utils.py:115-117), then configure_quant_config with
     DeepseekV4ForCausalLM's hf_to_vllm_mapper and packed_modules_mapping (MTP only; the
     DSpark class has neither), then AMD's align_mtp_quant_config;
  b. each draft module built by the wheel's ReplicatedLinear / ColumnParallelLinear /
     MergedColumnParallelLinear / RowParallelLinear / RoutedExperts __init__, with the
     constructor arguments and quant prefixes of nvidia/mtp.py, attention.py, nvidia/model.py
     and */dspark.py (vllm_layer._linear_specs says where each comes from): __init__ asks
     the config for the method (compressed-tensors: get_quant_method -> get_scheme /
     get_moe_method; ModelOpt: get_quant_method -> is_layer_excluded, modelopt.py:191-264: an
     excluded linear UnquantizedLinearMethod, excluded experts no method and so
     UnquantizedFusedMoEMethod, routed_experts.py:236-240; else build_linear_method's
     ModelOptLinearMethod or the config's FP8 / NVFP4 MoE method);
  c. that method's create_weights: the parameters with vLLM's classes, names, dtypes,
     shapes and weight_loaders (ModelWeightParameter & co., the layer's weight_loader(_v2),
     RoutedExperts.weight_loader);
  d. the loader's load_weights feeding DRAFT into exactly those parameters plus the draft's
     unquantised ones (norms, hc_*, attn_sink, gate: the xpu / xpu_dspark tables' targets
     bound for the config, less those under a built module and the shared embedding and
     head); any other name is the KeyError vLLM raises; every built parameter's
     weight_loader is the wheel's own, copying into the parameter;
  e. SGLang: the quantisation ModelConfig._verify_quantization picks for the draft
     directory (the draft flag defaulted from the target's as serving_hook.py:676-709 does),
     and SGLang's NextN/DSpark loader on DRAFT against NATIVE as above.
Pass rule per loader there: no error, no fed tensor reaching no parameter (but the xpu
table's [copy] sources and mtp.* [skip] rules), every parameter part (shard, expert)
filled exactly once, and every parameter's value what the native checkpoint gives: FP8
bytes equal, an F32 weight_scale = 2^e of the E8M0, U8 weight_packed / weight_scale the
native bytes, a bf16 weight the native weight dequantised, an FP8 block weight fed from FP4
experts re-blocked judged with its weight_scale by value (weight x per-128x128 scale equal to
the FP4 weight dequantised). A tensor DRAFT's conversion.json
records a measured error of ("serve" -> "tensors" -> NAME with max_abs_error and rel_rms_error:
a weight rebuilt in another format) has no native bytes: its parameter part must hold it as DRAFT
does, of the parameter's dtype (weight_shape: each shard writes it whole, the last stays, in the
parameter's dtype), and its module, decoded as the converter decodes it, must differ from the
native weight by the recorded errors to 1e-6 relative (runtime_loaders/lossy.py): a lossy one
("exact": false, a match-target --allow-lossy requantisation) by its error, which the table
prints with the worst of its parameters; an exact one (FP4 experts re-blocked into FP8, a bf16
dequantisation) by none. Without a record every value is held to the native one. What is cut
out for it: VLLM_BUILD_CUTS
(vllm_build.py: compressed-tensors config and utils, the transform lookup, parameter
classes, fp8_utils' parameter makers, the linear and RoutedExperts classes, the CT linear
schemes W8A8Fp8 / WNA16 / W4A4Fp4 / W4A4Mxfp4 and MoE methods W8A8Fp8 / WNA16 / W4A4Nvfp4 /
W4A4Mxfp4 / Unquantized, WeightsMapper, _make_deepseek_v4_weights_mapper,
configure_quant_config, align_mtp_quant_config; quant_utils.is_layer_skipped; ModelOpt's
config base and its FP8 / NVFP4 classes (from_config, overrides, is_layer_excluded,
apply_vllm_mapper, get_quant_method), ModelOptLinearMethod with resolve, build_linear_method and
its weight / activation key schemes, ModelOptFp8MoEMethod and ModelOptNvFp4FusedMoE), VLLM_CUTS
(the loaders, as above) and SGLANG_QUANT_CUTS (sglang_quant.py: _verify_quantization, its
ModelOpt config unwrapping, and the registry's override_quantization_method hooks). No vLLM
or SGLang module is imported whole; the compressed-tensors library is imported (vLLM's own
dependency: QuantizationArgs, TransformConfig, is_match). What is stubbed there:
* platform and process: current_platform per loader (nvidia: capability 9.0; amd: ROCm
  9.4, not gfx950; xpu: no capability), tensor-parallel rank 0 of 1, no TPU weight-loader
  sync, the vLLM config's model dtype bf16 and linear/MoE backends "auto", no LoRA;
  torch's default dtype bf16 while the modules are built (as vLLM sets it);
* kernels and backends: every kernel/backend selector and quant key the schemes'
  __init__/create_weights call (init_*_linear_kernel, choose_mp_linear_kernel,
  select_*_moe_backend, ModelOpt's select_linear_kernel, ...) returns a stand-in; the quant
  keys (kNvfp4Static, ...) are stand-ins too, so ModelOpt's QuantSpec is a namespace of its
  (weight, activation) pair; FusedMoEMethodBase.maybe_roundup_sizes
  keeps the sizes (it rounds only for all2all backends); no online quantization;
* MoE: FusedMoEConfig as a namespace of the fields read (gated SiLU, TP/EP 1, no EPLB,
  no padding), the expert map identity, update_expert_map_info a no-op;
* modelopt.py's module-level statements the cut leaves out are done by hand: each config's
  FusedMoEMethodCls (modelopt.py:725, 1199) and ModelOptLinearMethod's registration as a
  weight_loader_v2 method (its decorator, modelopt.py:2559); MLAAttention an empty class;
* a target transform_config that applies to a draft layer is reported as that layer's
  error (TransformOnDraft) instead of building CompressedTensorsLinearTransformMethod;
* the vLLM modules imported inside the cut-out functions (vllm_build.IMPORTED_INSIDE,
  sglang_quant.IMPORTED_INSIDE) are, while they run, stand-in modules holding the
  cut-out namespace;
* SGLang: CUDA (is_hip False, capability 9.0, marlin supported), the registry's CUDA
  branch (mxfp4), the other registry classes with the base's override (None).

Pass rule per loader: no error (nor SGLang warning); no fed tensor skipped except those the
runtime's draft has no place for (vLLM: the xpu table's [copy] sources embed.weight and
head.weight, taken from the target at run time, and its [skip] rules on `mtp.*` names, the
DSpark confidence head that vLLM's XPU class drops on purpose, xpu/dspark.py:406-407;
SGLang: what it skips in NATIVE too); every parameter except the shared ones (vLLM: the
table's [copy] targets) hit, holding exactly XPU_OUT's bytes (SGLang: the bytes the NATIVE
run put there). Exit 0 when every loader passes, 1 otherwise, 2 on a usage error.

A DeepSeek V4.1 draft (config.json's model_type deepseek_v41; runtime_loaders/v41_verify.py,
vllm_v41.py, sglang_v41.py) runs vLLM's two V4.1 DSpark loaders, DSparkV41DraftModel's
load_weights of models/deepseek_v41/nvidia/ and amd/dspark.py (vllm-nvidia-v41-dspark,
vllm-amd-v41-dspark; V4.1 has no XPU class, hence no --expected), and SGLang's
DeepseekV4ForCausalLMDSpark.load_weights (sglang-v41-dspark) against NATIVE as above, both configs
through the wheel's normalize_deepseek_v41_config (configs/deepseek_v41.py:23-40). vLLM's
parameters are built as --serve-with builds them, under V4.1's own quant config: cut out besides
VLLM_BUILD_CUTS are DeepseekV41Config (the nested config flattened, its vision fields),
DeepseekV4FP8Config of deepseek_v41/quant_config.py whole (override_quantization_method claims the
draft's fp8 dict; get_quant_method gives ModelOptLinearMethod(kMxfp8Static, kMxfp8Dynamic) with a
32x32 CkptCtx for every linear: weight F8_E4M3 [out, in] and weight_scale uint8 [out, in/32] filled
through KMxfp8Static.get_scale_weight_loader, each grid row repeated 32 times, modelopt.py:2309-2365;
Mxfp4MoEMethod for the routed experts, uint8 w13/w2 weights and scales, mxfp4.py:661-733), Fp8Config's
__init__/from_config, the mxfp8_utils constants, default_weight_loader, load_attention_sink and
make_attention_sink, each platform's get_padded_num_q_heads (NVIDIA FlashMLA: 64 or 128 heads), and
the loaders' _linear_scale_param_name, _use_sequence_parallel and _pad_shared_expert_weight. Built by
the wheel's classes: main_proj and each stage's fused_wqa_wkv, wq_b, wo_a, wo_b and shared experts
(vllm_layer._linear_specs' V4 DSpark block, whose arguments V4.1's attention.py:371-410 repeats), each
stage's gate (a ReplicatedLinear without quant config, which GateLinear is) and routed experts with
dspark_n_routed_experts, the F32 confidence head. Taken from the wheel's module definitions instead
(their shapes, dtypes and loaders): hc_* F32, the norms in the model dtype, the sink, the gate's
e_score_correction_bias and (with a vision tower) bias_vl, markov_w1/w2. Stubbed in addition: the
vLLM config (the draft's flattened config as the model's, TP/PP/DP 1, no expert parallel, moe
backend auto), the Kimi-K3 SiTU expert paths off, the MXFP4 MoE backend selector a stand-in and
Mxfp4MoEMethod.maybe_roundup_sizes not cut (the sizes kept: at the tiny and the released dims, hidden
a multiple of 256 and intermediate of 128, no backend rounds them, fused_moe/oracle/mxfp4.py:837-880),
transformers' PreTrainedConfig a class setting its keyword arguments. Pass rule: as --serve-with's
(no error, no skip, every parameter part filled once), every value the native checkpoint's: FP8 and E8M0 bytes, a
scale grid compared after repeating each row over its 32 output rows, the e2m1 bytes, the sink
padded with -inf, any other tensor in the parameter's dtype; a fed tensor outside mtp.* is the
target's (dropped, as _remap_dspark_name does). The table also shows the count vLLM's load_weights
logs ("DSpark draft model loaded: N params", nvidia/dspark.py:487, amd/dspark.py:516) where it ran
through: a dropped tensor or an expert id past dspark_n_routed_experts changes it or not, silently,
where this table fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# the parts live in runtime_loaders/ beside this file; the tests load this file by its path
sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_loaders import UsageError  # noqa: E402
from runtime_loaders.cut import cut  # noqa: E402
from runtime_loaders.recording import Recorder, RecordingParam, Report, run_loader  # noqa: E402
from runtime_loaders.serve_verify import serve_table, verify_serving  # noqa: E402
from runtime_loaders.sglang_quant import sglang_draft_quantization  # noqa: E402
from runtime_loaders.sglang_runs import SGLANG_CUTS, verify_sglang  # noqa: E402
from runtime_loaders.v41_verify import V41_LOADER_NAMES, is_v41_draft, v41_table, verify_v41  # noqa: E402
from runtime_loaders.vllm_runs import VLLM_CUTS, verify_vllm  # noqa: E402
from runtime_loaders.wheels import (  # noqa: E402
    DEFAULT_WHEELS,
    NEWEST,
    PINNED,
    WHEELS,
    WHEELS_ENV,
    Wheel,
    fetch_wheels,
    wheel_cache,
    wheel_path,
    wheels_cached,
)

from dsv4.model.errors import DSV4Error  # noqa: E402

# What tests/scripts/test_verify_runtimes.py reaches as vr.NAME; cut, Recorder, RecordingParam,
# run_loader, wheels_cached and subprocess (it patches subprocess.run, which wheel_path's pip
# download calls) are imported here only for it.
__all__ = [
    "DEFAULT_WHEELS",
    "NEWEST",
    "PINNED",
    "WHEELS",
    "WHEELS_ENV",
    "Recorder",
    "RecordingParam",
    "Report",
    "UsageError",
    "cut",
    "main",
    "run_loader",
    "subprocess",
    "verify",
    "verify_serving",
    "sglang_draft_quantization",
    "Wheel",
    "wheel_path",
    "wheel_cache",
    "wheels_cached",
]


def verify(
    draft: Path,
    expected: Path,
    native: Path,
    wheels: Path,
    loaders: list[str] | None = None,
    versions: dict[str, str] | None = None,
) -> list[Report]:
    """Every applicable loader's report on `draft` (MTP loaders for an MTP config, the DSpark
    loaders for a config with dspark_* fields), each cut from the wheel of its package's
    release in `versions` (package -> release; default PINNED): a loader that release has
    not is reported as not in the release (runtime_loaders/releases.py)."""
    for d in (draft, expected, native):
        if not (d / "config.json").is_file():
            raise UsageError(f"{d}: no config.json")
    is_dspark = "dspark_target_layer_ids" in json.loads((draft / "config.json").read_text())
    chosen = loaders or [n for n in [*VLLM_CUTS, *SGLANG_CUTS] if n.endswith("dspark") == is_dspark]
    reports = []
    opened: dict[str, Wheel] = {}
    for name in chosen:
        package = "vllm" if name in VLLM_CUTS else "sglang"
        wheel = opened.setdefault(package, Wheel(wheel_path(wheels, package, (versions or PINNED)[package])))
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
        if r.absent:
            lines.append(f"| {r.loader} | not in {r.absent} |" + " |" * 7)
            continue
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
        "--fetch-wheels",
        action="store_true",
        help="only download the wheels missing from the cache (the releases named, else the pinned and the "
        "newest proven ones), and stop",
    )
    for package, runtime in (("vllm", "vLLM"), ("sglang", "SGLang")):
        ap.add_argument(
            f"--{package}-version",
            default=PINNED[package],
            metavar="X.Y.Z",
            help=f"the {runtime} release whose wheel's loaders run (default {PINNED[package]}, the verified one)",
        )
    ap.add_argument(
        "--loader",
        action="append",
        choices=sorted(VLLM_CUTS) + sorted(SGLANG_CUTS) + V41_LOADER_NAMES,
        help="run only this loader (repeatable; default: every one for the drafter)",
    )
    ap.add_argument(
        "--serve-with",
        type=Path,
        help="a compressed-tensors or modelopt target's config.json (or its directory): "
        "load DRAFT into the parameters vLLM builds beside it",
    )
    ap.add_argument(
        "--overrides", type=Path, help="with --serve-with: the JSON value of vLLM's --hf-overrides the target runs with"
    )
    ap.add_argument("--json", action="store_true", help="every report as JSON, per tensor")
    args = ap.parse_args(argv)
    v41 = args.draft is not None and is_v41_draft(args.draft)  # no XPU layout: nothing for --expected
    if v41 and (args.expected or args.serve_with):
        ap.error(
            "a V4.1 draft takes DRAFT --native NATIVE only (vLLM 0.33.0 has no V4.1 XPU layout for --expected; "
            "--serve-with builds V4's draft classes)"
        )
    needed = (args.draft, args.native) if args.serve_with or v41 else (args.draft, args.expected, args.native)
    if not args.fetch_wheels and None in needed:
        ap.error(
            "DRAFT and --native, and --expected unless --serve-with or a V4.1 draft, are required "
            "(unless --fetch-wheels)"
        )
    if args.overrides and not args.serve_with:
        ap.error("--overrides goes with --serve-with")
    versions = {"vllm": args.vllm_version, "sglang": args.sglang_version}
    if (args.serve_with or v41) and versions != PINNED:
        what = "--serve-with runs" if args.serve_with else "a V4.1 draft runs"
        ap.error(f"{what} the verified releases only (vLLM {PINNED['vllm']}, SGLang {PINNED['sglang']})")
    try:
        if args.fetch_wheels:
            print("\n".join(map(str, fetch_wheels(args.wheels, versions))))
            return 0
        if v41:
            reports = verify_v41(args.wheels, args.draft, args.native, args.loader)
            lines = v41_table(reports)
        elif args.serve_with:
            target, reports = verify_serving(
                args.wheels, args.draft, args.serve_with, args.overrides, args.native, args.loader
            )
            lines = serve_table(target, args.overrides.name if args.overrides else "no overrides", reports)
        else:
            reports = verify(args.draft, args.expected, args.native, args.wheels, args.loader, versions)
            lines = table_lines(reports)
    except (UsageError, DSV4Error) as exc:  # a missing wheel or directory, an unreadable checkpoint
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.summary() for r in reports], indent=1))
    else:
        print("\n".join(lines))
    return 0 if all(r.passed for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
