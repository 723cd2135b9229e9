"""Benchmark the fused MTP norm kernels against torch eager and torch.compile of the same
math, beside a device-to-device copy measured in the same run; or, with --vllm, against
vLLM 0.33.0's kernels of the same two norms under CUDA-graph replay and eager.

    python scripts/bench_kernels.py [--device cuda] [--json OUT.json]
    python scripts/bench_kernels.py --vllm fused_mtp_input_rmsnorm.py [--sweep] [--json OUT.json]

--vllm FILE: vLLM's vllm/models/deepseek_v4/common/ops/fused_mtp_input_rmsnorm.py (from
`pip download --no-deps vllm==0.33.0`), loaded at run time with the vllm names it imports
stubbed (`load_vllm`); it is not part of this project. Per shape (H x T, `GRAPH_TOKENS`) and
kernel, on the same inputs: both outputs checked against each other and the torch reference
(bf16 ulps), then device time per call under CUDA-graph replay (`graph_us`): ours as the
model calls it against vLLM's as vLLM's model calls it; and eager, the wall clock per call
(`call_us`, host launch cost included) of the same two calls. --sweep times every launch config
(`sweep_configs`) of ours instead, into preallocated outputs: how `kernels._TUNED` was chosen.

Two timings per case:
* gpu_us: device time per call from triton.testing.do_bench (CUDA/XPU events around each
  call, L2 flushed between calls, mean over repetitions). GB/s = bytes moved / gpu time.
Implementations: triton = the kernels as the model calls them (Triton's `kernel[grid](...)`
launch); eager / compile = the torch reference, eager and under torch.compile.
* call_us: wall clock per call over N back-to-back calls with one synchronisation at the
  end: what a caller pays, host launch overhead included (launch-bound at small T).
Bytes moved = every input row read once + every output row written once (+ weights).
The copy moves the same number of bytes (read + write) with `dst.copy_(src)`.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
import time
import types
from collections.abc import Callable
from functools import partial

import torch
import triton.testing

from dsv4.model import kernels

N_HC = 4
EPS = 1e-6
TOKENS = (1, 16, 256, 4096, 16384)
HIDDEN = (4096, 7168)
GRAPH_TOKENS = (1, 4, 16, 64, 256, 4096, 16384)


def sync(dev: torch.device) -> None:
    getattr(torch, dev.type).synchronize(dev)


def gpu_us(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3


def call_us(fn: Callable[[], object], dev: torch.device, n: int = 2000) -> float:
    for _ in range(20):
        fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(dev)
    return (time.perf_counter() - t0) / n * 1e6


def load_vllm(path: str) -> types.ModuleType:
    """vLLM's kernel file as a module, its vllm imports stubbed with the least that launches
    its kernels as vLLM does: `kernel_launcher` binds the wrapper's arguments to the kernel's
    parameters by vLLM's naming rule (name, name_ptr, NAME, NAME_PTR; the wrapper's own launch
    kwargs win) and launches `kernel[grid](**kwargs)`: Triton's defaults, 4 warps."""
    import triton.language as tl

    def kernel_launcher(call: Callable[..., tuple]) -> Callable[..., object]:
        signature = inspect.signature(call)

        def wrapper(self: object, *args: object, **kwargs: object) -> object:
            grid, launch_kwargs, outputs = call(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            params = self.kernel.arg_names
            for name, value in bound.arguments.items():
                target = next(
                    (c for c in (name, f"{name}_ptr", name.upper(), f"{name}_PTR".upper()) if c in params), None
                )
                if name != "self" and target is not None and target not in launch_kwargs:
                    launch_kwargs[target] = value
            if grid is not None:
                self.kernel[grid](**launch_kwargs)
            return outputs

        return wrapper

    class VllmTritonJitKernel:
        def __class_getitem__(cls, key: object) -> type:
            return cls

    stubs = {
        "vllm.model_executor.warmup.jit_warmup": {"kernel_launcher": kernel_launcher},
        "vllm.model_executor.warmup.jit_warmup_triton_helper": {
            "LaunchSpec": tuple,
            "TritonWarmupTensor": object,
            "VllmTritonJitKernel": VllmTritonJitKernel,
        },
        "vllm.triton_utils": {"tl": tl, "triton": triton},
        "vllm.utils.math_utils": {"next_power_of_2": triton.next_power_of_2},
    }
    for name, attrs in stubs.items():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        vars(sys.modules[name]).update(attrs)
    spec = importlib.util.spec_from_file_location("vllm_fused_mtp_input_rmsnorm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graph_us(fns: dict[str, Callable[[], object]], calls: int, rounds: int = 15) -> dict[str, float]:
    """Device µs per call of each fn: `calls` calls captured into one CUDA graph per fn (after
    one call outside it: compilation), the graphs replayed in turn `rounds` times with CUDA
    events around each replay (so slow drifts of the clock hit every fn alike); the median."""
    graphs = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        graphs[name] = graph
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def graph_calls(T: int) -> int:
    # enough calls per replay that one replay lasts ~0.2 ms or more
    return 100 if T <= 256 else 20 if T <= 4096 else 8


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in bf16 units in the last place (+0 and -0 equal)."""

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.view(torch.int16).int()
        return torch.where(bits < 0, -(bits + 32768), bits)

    return int((ordered(a) - ordered(b)).abs().max())


def describe(config: kernels.LaunchConfig) -> str:
    """'warps x rows' and the config's cache hints, if any."""
    extras = ["contiguous"] if config.contiguous else []
    extras += [
        f"{what} {hint}"
        for what, hint in (
            ("load", config.load_eviction),
            ("store", config.store_cache),
            ("store", config.store_eviction),
        )
        if hint
    ]
    return ", ".join([f"{config.num_warps} x {config.rows}", *extras])


def sweep_configs(H: int, T: int) -> list[kernels.LaunchConfig]:
    """Every config worth timing: 1-32 warps, 1, 2 or 4 rows per program (T divisible by
    it), 4-128 elements of a row per thread."""
    block = triton.next_power_of_2(H)
    configs = []
    for rows in (1, 2, 4):
        for warps in (1, 2, 4, 8, 16, 32):
            per_thread = rows * block // (32 * warps)
            if T % rows == 0 and 4 <= per_thread <= 128:
                configs.append(kernels.LaunchConfig(warps, rows))
    return configs


def shape_inputs(H: int, T: int, dev: torch.device, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(e, pos, prev, w1, w2) of one shape, drawn from `g` in a fixed order."""
    e = (torch.randn(T, H, device=dev, generator=g) * 3).bfloat16()
    prev = (torch.randn(T, N_HC, H, device=dev, generator=g) * 5).bfloat16()
    pos = torch.arange(T, device=dev) % 7  # every 7th token starts a sequence
    w1 = (1 + 0.1 * torch.randn(H, device=dev, generator=g)).bfloat16()
    w2 = (1 + 0.1 * torch.randn(H, device=dev, generator=g)).bfloat16()
    return e, pos, prev, w1, w2


def agreement_ulps(vllm: types.ModuleType, inputs: tuple[torch.Tensor, ...]) -> dict[str, tuple[int, int]]:
    """Per kernel: (ours vs vLLM's, ours vs the torch reference), in bf16 ulps."""
    vllm_fused, vllm_head = vllm._FUSED_MTP_INPUT_RMSNORM_KERNEL, vllm._MTP_SHARED_HEAD_RMSNORM_KERNEL
    e, pos, prev, w1, w2 = inputs
    e_ref, h_ref = kernels.fused_mtp_input_rmsnorm_ref(e, pos, prev, w1, w2, EPS, N_HC)
    head_ref = kernels.mtp_shared_head_rmsnorm_ref(e, w1, EPS)
    ours_fused = kernels.fused_mtp_input_rmsnorm(e, pos, prev, w1, w2, EPS, N_HC)
    theirs_fused = vllm_fused(e, pos, prev, w1, w2, EPS, N_HC)
    ours_head, theirs_head = kernels.mtp_shared_head_rmsnorm(e, w1, EPS), vllm_head(e, w1, EPS)
    return {
        "fused_input": (
            # both return (e, h): a kernel returning fewer outputs must not pass as agreeing
            max(bf16_ulps(o, t) for o, t in zip(ours_fused, theirs_fused, strict=True)),
            max(bf16_ulps(o, r) for o, r in zip(ours_fused, (e_ref, h_ref), strict=True)),
        ),
        "shared_head": (bf16_ulps(ours_head, theirs_head), bf16_ulps(ours_head, head_ref)),
    }


def sweep_rows(
    vllm: types.ModuleType, inputs: tuple[torch.Tensor, ...], ulps: dict[str, tuple[int, int]]
) -> list[dict]:
    """Every launch config of ours against vLLM's kernel under graph replay, into preallocated
    outputs, for one shape; each kernel's line printed as it is done."""
    vllm_fused, vllm_head = vllm._FUSED_MTP_INPUT_RMSNORM_KERNEL, vllm._MTP_SHARED_HEAD_RMSNORM_KERNEL
    e, pos, prev, w1, w2 = inputs
    T, H = e.shape
    eo, ho, out = torch.empty_like(e), torch.empty_like(prev), torch.empty_like(e)
    eo2, ho2, out2 = torch.empty_like(e), torch.empty_like(prev), torch.empty_like(e)
    # partial binds this shape's tensors when made (a closure would read whatever the loop
    # variables hold when called); ours lacks only its launch config, its last argument
    cases = {
        "fused_input": (
            partial(kernels._fused_mtp_input_rmsnorm_into, e, pos, prev, w1, w2, eo, ho, EPS, N_HC),
            partial(vllm_fused, e, pos, prev, w1, w2, EPS, N_HC, _outputs=(eo2, ho2)),
        ),
        "shared_head": (
            partial(kernels._mtp_shared_head_rmsnorm_into, e, w1, out, EPS),
            partial(vllm_head, e, w1, EPS, _output=out2),
        ),
    }
    rows = []
    for name, (ours_into, theirs) in cases.items():
        configs = sweep_configs(H, T)
        fns = {f"w{c.num_warps}r{c.rows}": partial(ours_into, c) for c in configs} | {"vllm": theirs}
        us = graph_us(fns, graph_calls(T))
        best = min((k for k in us if k != "vllm"), key=us.get)
        tuned = kernels.launch_config(name, H, T, e.device.type)
        rows.append({
            "kernel": name, "H": H, "T": T, "us": us, "best": best, "tuned": f"w{tuned.num_warps}r{tuned.rows}",
            "ulps_vs_vllm": ulps[name][0], "ulps_vs_ref": ulps[name][1],
        })  # fmt: skip
        ranked = " ".join(f"{k}={v:.2f}" for k, v in sorted(us.items(), key=lambda kv: kv[1]))
        print(
            f"{name:<12}{H:>6}{T:>7}  best {best} {us[best]:.2f} vs vllm {us['vllm']:.2f} "
            f"({us[best] / us['vllm']:.3f})  {ranked}",
            flush=True,
        )
    return rows


def replay_rows(
    vllm: types.ModuleType, inputs: tuple[torch.Tensor, ...], ulps: dict[str, tuple[int, int]], dev: torch.device
) -> list[dict]:
    """Ours as the model calls it against vLLM's as vLLM's model calls it, for one shape:
    device time under graph replay and the wall clock per eager call."""
    vllm_fused, vllm_head = vllm._FUSED_MTP_INPUT_RMSNORM_KERNEL, vllm._MTP_SHARED_HEAD_RMSNORM_KERNEL
    e, pos, prev, w1, w2 = inputs
    T, H = e.shape
    # (ours, vLLM's), this shape's tensors bound now
    cases = {
        "fused_input": (
            partial(kernels.fused_mtp_input_rmsnorm, e, pos, prev, w1, w2, EPS, N_HC),
            partial(vllm_fused, e, pos, prev, w1, w2, EPS, N_HC),
        ),
        "shared_head": (partial(kernels.mtp_shared_head_rmsnorm, e, w1, EPS), partial(vllm_head, e, w1, EPS)),
    }
    rows = []
    for name, (ours, theirs) in cases.items():
        us = graph_us({"ours": ours, "vllm": theirs}, graph_calls(T))
        n = 200 if T >= 4096 else 2000
        eager = {"ours": call_us(ours, dev, n), "vllm": call_us(theirs, dev, n)}
        cfg = kernels.launch_config(name, H, T, e.device.type)
        rows.append({
            "kernel": name, "H": H, "T": T, "config": describe(cfg), "ours_us": us["ours"],
            "vllm_us": us["vllm"], "ours_call_us": eager["ours"], "vllm_call_us": eager["vllm"],
            "ulps_vs_vllm": ulps[name][0], "ulps_vs_ref": ulps[name][1],
        })  # fmt: skip
    return rows


def print_replay_table(rows: list[dict]) -> None:
    print(
        "| kernel | H | T | warps x rows, hints | ours µs | vLLM µs | ours / vLLM | ours call µs | vLLM call µs "
        "| ulps vs vLLM | ulps vs ref |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["ours_us"] / r["vllm_us"]
        mark = "" if ratio <= 1 else " **slower**"
        print(
            f"| {r['kernel']} | {r['H']} | {r['T']} | {r['config']} | {r['ours_us']:.2f} | {r['vllm_us']:.2f} "
            f"| {ratio:.3f}{mark} | {r['ours_call_us']:.1f} | {r['vllm_call_us']:.1f} | {r['ulps_vs_vllm']} "
            f"| {r['ulps_vs_ref']} |"
        )
    faster_graph = sum(r["ours_us"] <= r["vllm_us"] for r in rows)
    faster_eager = sum(r["ours_call_us"] <= r["vllm_call_us"] for r in rows)
    print(
        f"ours <= vLLM in {faster_graph} of {len(rows)} shapes under graph replay, "
        f"{faster_eager} of {len(rows)} eager (wall clock per call)"
    )


def against_vllm(args: argparse.Namespace) -> None:
    dev = torch.device(args.device)
    assert dev.type == "cuda" and kernels.backend(dev) == "triton", kernels.backend(dev)
    vllm = load_vllm(args.vllm)
    print(
        f"device: {torch.cuda.get_device_name(dev)}; torch {torch.__version__}, triton {triton.__version__}; "
        f"vLLM kernels from {args.vllm}"
    )
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for H in HIDDEN:
        for T in args.tokens:
            inputs = shape_inputs(H, T, dev, g)
            ulps = agreement_ulps(vllm, inputs)
            rows += sweep_rows(vllm, inputs, ulps) if args.sweep else replay_rows(vllm, inputs, ulps, dev)
    if not args.sweep:
        print_replay_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    ap.add_argument(
        "--vllm",
        metavar="FILE",
        help="vLLM's fused_mtp_input_rmsnorm.py: compare with its kernels under CUDA-graph replay",
    )
    ap.add_argument("--sweep", action="store_true", help="with --vllm: time every launch config of ours")
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=GRAPH_TOKENS, help="with --vllm: the T values (default: %(default)s)"
    )
    return ap.parse_args()


def norm_cases(
    H: int, T: int, dev: torch.device, compiled_fused: Callable, compiled_head: Callable
) -> dict[str, tuple[int, dict[str, Callable[[], object]]]]:
    """Per kernel of one shape, on fresh random inputs: (bytes moved, implementation -> call)."""
    e = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    prev = torch.randn(T, N_HC, H, device=dev, dtype=torch.bfloat16)
    pos = torch.arange(T, device=dev)
    w1 = torch.randn(H, device=dev, dtype=torch.bfloat16)
    w2 = torch.randn(H, device=dev, dtype=torch.bfloat16)
    fused_args, head_args = (e, pos, prev, w1, w2, EPS, N_HC), (e, w1, EPS)
    # partial binds this shape's tensors when made (a closure would read the loop variables when called)
    return {
        "fused_mtp_input_rmsnorm": (
            2 * (1 + N_HC) * T * H * 2 + 2 * H * 2 + T * 8,
            {
                "triton": partial(kernels.fused_mtp_input_rmsnorm, *fused_args),
                "eager": partial(kernels.fused_mtp_input_rmsnorm_ref, *fused_args),
                "compile": partial(compiled_fused, *fused_args),
            },
        ),
        "mtp_shared_head_rmsnorm": (
            2 * T * H * 2 + H * 2,
            {
                "triton": partial(kernels.mtp_shared_head_rmsnorm, *head_args),
                "eager": partial(kernels.mtp_shared_head_rmsnorm_ref, *head_args),
                "compile": partial(compiled_head, *head_args),
            },
        ),
    }


def case_rows(
    name: str, H: int, T: int, nbytes: int, impls: dict[str, Callable[[], object]], dev: torch.device, no_compile: bool
) -> list[dict]:
    """Each implementation of one kernel and shape, beside a copy of as many bytes; each
    printed as it is done."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_gbs = nbytes / (gpu_us(partial(dst.copy_, src)) * 1e3)
    rows = []
    for impl, fn in impls.items():
        if impl == "compile" and no_compile:
            continue
        fn()  # compile / JIT outside the timing
        g = gpu_us(fn)
        c = call_us(fn, dev, n=200 if T >= 4096 else 2000)
        gbs = nbytes / (g * 1e3)
        rows.append({
            "kernel": name, "H": H, "T": T, "impl": impl, "gpu_us": g, "call_us": c, "GBps": gbs,
            "copy_GBps": copy_gbs, "bytes": nbytes,
        })  # fmt: skip
        print(
            f"{name:<24}{H:>6}{T:>7}{impl:>9}{g:>10.2f}{c:>10.2f}{gbs:>9.0f}{copy_gbs:>11.0f}"
            f"{100 * gbs / copy_gbs:>7.0f}%"
        )
    return rows


def main() -> None:
    args = parse_args()
    if args.vllm:
        return against_vllm(args)
    dev = torch.device(args.device)
    assert kernels.backend(dev) == "triton", kernels.backend(dev)

    # one compiled graph per shape (dynamic=False): allow all 10 shapes without falling back
    torch._dynamo.config.recompile_limit = 64
    compiled_fused = torch.compile(kernels.fused_mtp_input_rmsnorm_ref, dynamic=False)
    compiled_head = torch.compile(kernels.mtp_shared_head_rmsnorm_ref, dynamic=False)
    rows = []
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev
    print(f"device: {device_name}; torch {torch.__version__}, triton {triton.__version__}")
    print(
        f"{'kernel':<24}{'H':>6}{'T':>7}{'impl':>9}{'gpu_us':>10}{'call_us':>10}{'GB/s':>9}{'copy GB/s':>11}"
        f"{'% copy':>8}"
    )
    for H in HIDDEN:
        for T in TOKENS:
            for name, (nbytes, impls) in norm_cases(H, T, dev, compiled_fused, compiled_head).items():
                rows += case_rows(name, H, T, nbytes, impls, dev, args.no_compile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
