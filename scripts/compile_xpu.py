"""Compile every launch of the MTP draft's two Triton kernels (model/kernels.py) for an Intel
GPU target with Intel's Triton backend, on a machine without an Intel GPU.

Set up (its own virtualenv: triton-xpu installs the module `triton` and would replace the
project's triton in .venv):

    apt-get install libze1 libze-dev          # Debian 12: 1.8.12-1, the oneAPI Level Zero loader
    python3.11 -m venv /work/xpu-venv         # the triton-xpu 3.3.0b1 wheel used here: cp311, manylinux_2_28 x86_64
    /work/xpu-venv/bin/pip install --pre triton-xpu==3.3.0b1 intel-sycl-rt==2026.2.0 torch==2.13.0
    /work/xpu-venv/bin/python scripts/compile_xpu.py

(--pre: every triton-xpu release on PyPI is a pre-release; torch: the CPU build, for
model/kernels.py's import of torch and the host tensors the launches are bound to.)

What it does: the project's own launch wrappers (`kernels._*_into`) are called with tensors of
the model's shapes and dtypes on the CPU and each `kernel[grid](...)` they make is recorded
instead of launched; its arguments are specialised as Triton's JIT does at a launch
(triton.runtime.jit.specialize_impl: pointer types, 16-byte alignment) and compiled with
`triton.compile(ASTSource, GPUTarget("xpu", PROPS, 32))` down to SPIR-V. Launches: every
entry of `kernels._TUNED` (and its one-row variant where the model uses it, T not divisible
by the entry's rows) and `kernels.untuned_launch`, for both kernels, activations in bf16 and
fp32 (the weights are bf16: model/mtp.py's RMSNorm), at the hidden sizes of Flash and Pro and
their hc_mult (model/presets.py). A launch with cache hints is compiled again without them:
the `hints` column says whether the hints reach Triton's IR and whether the SPIR-V differs.
The `xpu` column marks the launch model/kernels.py gives an XPU device (`launch_config`).

What it shows: the kernels lower to SPIR-V for that target with that backend, per launch.
Compiling loads neither intel-sycl-rt's libsycl nor the Level Zero loader (checked: neither is
mapped into the process after a run); they are what the backend's driver needs to launch.
What it does not show: nothing runs on a device (no Intel GPU, no Level Zero driver here);
no numerics (the SPIR-V is never executed), no timing, no native code (ocloc, which turns
SPIR-V into an Intel GPU's binary, is not installed), no other triton-xpu release (an XPU
build of torch brings its own Triton for Intel GPUs; which one is not checked here).
Prints one line per launch and a summary; exits 1 if any launch fails to compile.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import tempfile
import warnings
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

# model/kernels.py reads TRITON_INTERPRET when its kernels are decorated; compiled code is the
# subject here, and a fresh cache makes every launch compile in this run.
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile_xpu-")
warnings.filterwarnings("ignore", "Failed to initialize NumPy")  # torch without numpy: not needed here

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import specialize_impl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# The device the target describes: Intel Data Center GPU Max (Ponte Vecchio, "pvc"), one of
# the three Intel GPUs SGLang 0.5.23 takes XMX support on (srt/utils/common.py:379-383).
# The dict stands in for torch.xpu.get_device_capability(), which the backend's driver puts
# in GPUTarget.arch (triton/backends/intel/driver.py:739-744, warp size 32); of its fields,
# make_ttgir reads the sub-group sizes and three feature flags
# (triton/backends/intel/compiler.py:257-260): present on this device, as assumed here.
ARCH = "pvc"
PROPS = {
    "name": "Intel(R) Data Center GPU Max 1550",
    "sub_group_sizes": [16, 32],
    "has_subgroup_2d_block_io": True,
    "has_subgroup_matrix_multiply_accumulate": True,
    "has_bfloat16_conversions": True,
}
WARP_SIZE = 32
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def load_project() -> tuple[ModuleType, ModuleType]:
    """model/kernels.py and model/presets.py as dsv4.model.*: the checkout as the package dsv4
    (pyproject's package-dir maps dsv4 to it), so the project need not be installed here."""
    spec = importlib.util.spec_from_file_location("dsv4", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    sys.modules["dsv4"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["dsv4"])
    from dsv4.model import kernels, presets

    return kernels, presets


def xpu_target() -> GPUTarget:
    """The target, with the backend's device probe replaced by the architecture named here.
    XPUBackend.__init__ builds arch_parser.c, a SYCL C++ program, to turn the device's SYCL
    architecture number into a name (triton/backends/intel/compiler.py:134-135); without a
    SYCL compiler, the system's gcc builds it against intel-sycl-rt's headers and the library
    does not load ("undefined symbol: _ZNSt8ios_base4InitD1Ev"). The name serves only to ask
    ocloc for the device's extensions (compiler.py:158), and ocloc is absent."""
    intel = triton.backends.backends["intel"].compiler
    intel.__init__.__globals__["compile_module_from_src"] = lambda src, name: SimpleNamespace(
        parse_device_arch=lambda number: ARCH
    )
    return GPUTarget("xpu", PROPS, WARP_SIZE)


class Recorder:
    """Stands in for a Triton kernel: records the arguments of each `kernel[grid](...)`."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def recorded_launch(kernels: ModuleType, kernel: str, dtype: torch.dtype, H: int, n_hc: int, eps: float, config: Any):
    """(jit function, args, kwargs) of the one launch the project's wrapper makes for `config`."""
    T = config.rows
    e = torch.zeros(T, H, dtype=dtype)
    w = torch.ones(H, dtype=torch.bfloat16)
    recorder = Recorder()
    if kernel == "fused_input":
        fn, kernels._fused_mtp_input_rmsnorm_kernel = kernels._fused_mtp_input_rmsnorm_kernel, recorder
        prev = torch.zeros(T, n_hc, H, dtype=dtype)
        positions = torch.arange(T)
        try:
            kernels._fused_mtp_input_rmsnorm_into(
                e, positions, prev, w, w, torch.empty_like(e), torch.empty_like(prev), eps, n_hc, config
            )
        finally:
            kernels._fused_mtp_input_rmsnorm_kernel = fn
    else:
        fn, kernels._rmsnorm_kernel = kernels._rmsnorm_kernel, recorder
        try:
            kernels._mtp_shared_head_rmsnorm_into(e, w, torch.empty_like(e), eps, config)
        finally:
            kernels._rmsnorm_kernel = fn
    (args, kwargs), *more = recorder.calls
    assert not more, "one launch per call"
    return fn, args, kwargs


def ast_source(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], backend: Any
) -> tuple[ASTSource, dict[str, Any]]:
    """The ASTSource and options Triton's JIT would compile for this launch (jit.py: JITFunction.run)."""
    # positional arguments first, the constexprs by keyword
    bound = dict(zip(fn.arg_names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in fn.arg_names}
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        ty, key = specialize_impl(value, backend.get_arg_specialization, align=not param.do_not_specialize_on_alignment)
        signature[param.name] = ty
        if ty == "constexpr":
            constexprs[param.name] = key
        elif isinstance(key, str):
            attrs[(i,)] = backend.parse_attr(key)
    options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    return ASTSource(fn, signature, constexprs, attrs), options


def launches(kernels: ModuleType, kernel: str, H: int) -> list[tuple[str, Any]]:
    """(when the model makes it, config) for every launch of `kernel` at H."""
    out, low = [], 0
    for t_max, config in kernels._TUNED[(kernel, triton.next_power_of_2(H))]:
        when = f"T>{low}" if t_max >= 1 << 62 else f"T<={t_max}" if low == 0 else f"{low}<T<={t_max}"
        out.append((when, config))
        if config.rows > 1:  # launch_config: one row per program where rows do not divide T
            out.append((f"{when}, T%{config.rows}!=0", config._replace(rows=1)))
        low = t_max
    out.append(("untuned", kernels.untuned_launch(H)))
    return out


def describe(config: Any) -> str:
    hints = "/".join(h for h in (config.load_eviction, config.store_cache, config.store_eviction) if h) or "-"
    return f"w{config.num_warps} r{config.rows} hints={hints}" + (" contiguous" if config.contiguous else "")


class XpuCompiler:
    """Compiles the model's launches of model/kernels.py for `target`."""

    def __init__(self, kernels: ModuleType, target: GPUTarget) -> None:
        self.kernels, self.target, self.backend = kernels, target, make_backend(target)

    def compile(self, kernel: str, dtype: torch.dtype, model: dict[str, Any], config: Any) -> Any:
        H, n_hc, eps = model["hidden_size"], model["hc_mult"], model["rms_norm_eps"]
        source, options = ast_source(*recorded_launch(self.kernels, kernel, dtype, H, n_hc, eps, config), self.backend)
        return triton.compile(source, target=self.target, options=options)

    def hints_verdict(self, kernel: str, dtype: torch.dtype, model: dict[str, Any], config: Any, hinted: Any) -> str:
        """Whether the cache hints reach TTIR, and whether the SPIR-V differs without them."""
        bare = config._replace(load_eviction="", store_cache="", store_eviction="")
        if bare == config:
            return "-"
        plain = self.compile(kernel, dtype, model, bare)
        in_ttir = "in TTIR" if hinted.asm["ttir"] != plain.asm["ttir"] else "not in TTIR"
        same = "SPIR-V identical without" if hinted.asm["spv"] == plain.asm["spv"] else "SPIR-V differs without"
        return f"{in_ttir}, {same}"


def main() -> int:
    kernels, presets = load_project()
    compiler = XpuCompiler(kernels, xpu_target())
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("triton-xpu", "intel-sycl-rt", "torch"))
    print(f"target: GPUTarget('xpu', {ARCH}: {PROPS}, {WARP_SIZE}); {versions}")
    print(f"{'model':<6}{'kernel':<12}{'dtype':<6}{'H':>6} {'when':<22}{'launch':<44}{'xpu':<5}{'SPIR-V':<18}hints")
    failed = compiled = 0
    for name in ("flash", "pro"):
        model = presets.PRESETS[name]
        H = model["hidden_size"]
        for kernel in ("fused_input", "shared_head"):
            xpu = {kernels.launch_config(kernel, H, T, "xpu") for T in (1, 3, 64, 256, 512, 4096, 16384)}
            for dname, dtype in DTYPES.items():
                for when, config in launches(kernels, kernel, H):
                    try:
                        hinted = compiler.compile(kernel, dtype, model, config)
                        result = f"{len(hinted.asm['spv'])} B, {hinted.metadata.threads_per_warp}/warp"
                        hints = compiler.hints_verdict(kernel, dtype, model, config, hinted)
                        compiled += 1
                    except Exception as err:  # the compiler's error is the result to report
                        result, hints = "FAILED", f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                        failed += 1
                    mark = "yes" if config in xpu else ""
                    launch = f"{kernel:<12}{dname:<6}{H:>6} {when:<22}{describe(config):<44}"
                    print(f"{name:<6}{launch}{mark:<5}{result:<18}{hints}")
    print(f"summary: {compiled} launches compiled to SPIR-V for {ARCH}, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
