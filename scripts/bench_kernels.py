"""Benchmark the fused MTP norm kernels against torch eager and torch.compile of the same
math, beside a device-to-device copy measured in the same run.

    python scripts/bench_kernels.py [--device cuda] [--json OUT.json]

Two timings per case:
* gpu_us: device time per call from triton.testing.do_bench (CUDA/XPU events around each
  call, L2 flushed between calls, mean over repetitions). GB/s = bytes moved / gpu time.
Implementations: triton = the kernels as the model calls them (cached launch after the
first call); tl-jit = the same kernel through Triton's ordinary `kernel[grid](...)` launch;
eager / compile = the torch reference, eager and under torch.compile.
* call_us: wall clock per call over N back-to-back calls with one synchronisation at the
  end: what a caller pays, host launch overhead included (launch-bound at small T).
Bytes moved = every input row read once + every output row written once (+ weights).
The copy moves the same number of bytes (read + write) with `dst.copy_(src)`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import triton.testing

from dsv4.model import kernels

N_HC = 4
EPS = 1e-6
TOKENS = (1, 16, 256, 4096, 16384)
HIDDEN = (4096, 7168)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    args = ap.parse_args()
    dev = torch.device(args.device)
    assert kernels.backend(dev) == "triton", kernels.backend(dev)

    # one compiled graph per shape (dynamic=False): allow all 10 shapes without falling back
    torch._dynamo.config.recompile_limit = 64
    compiled_fused = torch.compile(kernels.fused_mtp_input_rmsnorm_ref, dynamic=False)
    compiled_head = torch.compile(kernels.mtp_shared_head_rmsnorm_ref, dynamic=False)
    rows = []
    print(f"device: {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else dev}; torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'kernel':<24}{'H':>6}{'T':>7}{'impl':>9}{'gpu_us':>10}{'call_us':>10}{'GB/s':>9}{'copy GB/s':>11}{'% copy':>8}")
    for H in HIDDEN:
        for T in TOKENS:
            e = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
            prev = torch.randn(T, N_HC, H, device=dev, dtype=torch.bfloat16)
            pos = torch.arange(T, device=dev)
            w1 = torch.randn(H, device=dev, dtype=torch.bfloat16)
            w2 = torch.randn(H, device=dev, dtype=torch.bfloat16)
            block, warps = kernels._launch_params(H)

            def jit_fused() -> None:
                # Triton's own launch path, for comparison with the cached launch in kernels.py
                eo, ho = torch.empty_like(e), torch.empty_like(prev)
                kernels._fused_mtp_input_rmsnorm_kernel[(T, 1 + N_HC)](e, pos, prev, w1, w2, eo, ho, EPS, H=H, N_HC=N_HC, BLOCK=block, num_warps=warps)

            def jit_head() -> None:
                out = torch.empty_like(e)
                kernels._rmsnorm_kernel[(T,)](e, w1, out, EPS, H=H, BLOCK=block, num_warps=warps)

            cases = {
                "fused_mtp_input_rmsnorm": (
                    2 * (1 + N_HC) * T * H * 2 + 2 * H * 2 + T * 8,
                    {
                        "triton": lambda: kernels.fused_mtp_input_rmsnorm(e, pos, prev, w1, w2, EPS, N_HC),
                        "tl-jit": jit_fused,
                        "eager": lambda: kernels.fused_mtp_input_rmsnorm_ref(e, pos, prev, w1, w2, EPS, N_HC),
                        "compile": lambda: compiled_fused(e, pos, prev, w1, w2, EPS, N_HC),
                    },
                ),
                "mtp_shared_head_rmsnorm": (
                    2 * T * H * 2 + H * 2,
                    {
                        "triton": lambda: kernels.mtp_shared_head_rmsnorm(e, w1, EPS),
                        "tl-jit": jit_head,
                        "eager": lambda: kernels.mtp_shared_head_rmsnorm_ref(e, w1, EPS),
                        "compile": lambda: compiled_head(e, w1, EPS),
                    },
                ),
            }
            for name, (nbytes, impls) in cases.items():
                src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
                dst = torch.empty_like(src)
                copy_gbs = nbytes / (gpu_us(lambda: dst.copy_(src)) * 1e3)
                for impl, fn in impls.items():
                    if impl == "compile" and args.no_compile:
                        continue
                    fn()  # compile / JIT outside the timing
                    g = gpu_us(fn)
                    c = call_us(fn, dev, n=200 if T >= 4096 else 2000)
                    gbs = nbytes / (g * 1e3)
                    rows.append({"kernel": name, "H": H, "T": T, "impl": impl, "gpu_us": g, "call_us": c, "GBps": gbs, "copy_GBps": copy_gbs, "bytes": nbytes})
                    print(f"{name:<24}{H:>6}{T:>7}{impl:>9}{g:>10.2f}{c:>10.2f}{gbs:>9.0f}{copy_gbs:>11.0f}{100 * gbs / copy_gbs:>7.0f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
