"""The MTP draft's two fused RMSNorm kernels (model/README.md#mtp-draft-step), in Triton, each beside a plain
torch reference that defines its meaning.

* `fused_mtp_input_rmsnorm`: the embedding rows of tokens at position 0 are zeroed before
  their norm (vLLM's mask, so their output is exactly 0), then enorm over the embedding and
  hnorm over each of the n_hc residual streams (RMS over H, one weight for all streams).
  One program per (rows of tokens, task): task 0 = enorm, task 1+j = hnorm of stream j.
* `mtp_shared_head_rmsnorm`: the shared head's norm, one program per rows of tokens.

How many rows per program, warps each and which cache hints: `launch_config`, a table
measured on an H200 for CUDA, the untuned launch on any other device (XPU: not measured).

Both: out of place, fp32 math, one rounding at the store (round to nearest even; a NaN
stays a NaN), T = 0 launches nothing. Every call launches through Triton's public
`kernel[grid](...)`; its host cost per call (binding and specialising the arguments) is
not paid under CUDA-graph replay, which is how a served draft step runs these kernels.

Triton runs on whatever device the tensors are on (CUDA, XPU; CPU only under
TRITON_INTERPRET=1). Where Triton is not importable, or cannot run on the tensors' device,
the torch reference runs instead and a notice says so once (logging: the command line
prints it as one `warning:` line).
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels are an optional extra (pyproject: [kernels]), triton >= 3.4
    triton = None

_warned: set[str] = set()
log = logging.getLogger(__name__)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Row RMSNorm over the last dim: fp32 math, one rounding to x's dtype at the end."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def fused_mtp_input_rmsnorm_ref(
    e: torch.Tensor,
    positions: torch.Tensor,
    prev: torch.Tensor,
    enorm_w: torch.Tensor,
    hnorm_w: torch.Tensor,
    eps: float,
    n_hc: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """e [T, H], positions [T], prev [T, n_hc, H] or [T, n_hc*H] -> (e_out [T, H], h_out like prev)."""
    T, H = e.shape
    e = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(e), e)
    h = rms_norm_ref(prev.reshape(T, n_hc, H), hnorm_w, eps).view(prev.shape)
    return rms_norm_ref(e, enorm_w, eps), h


def mtp_shared_head_rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_ref(x, w, eps)


def triton_usable(device: torch.device) -> str | None:
    """None when the Triton kernels can run on `device`, else the reason they cannot."""
    if triton is None:
        return "triton is not importable"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # on the CPU the torch reference is the fast path: Triton's interpreter is for tests
        return "the tensors are on the CPU, and the Triton kernels are for XPU and CUDA"
    return None


def backend(device: torch.device) -> str:
    """'triton' or 'torch fallback (<reason>)': what the fused norms run as on `device`."""
    why = triton_usable(device)
    return "triton" if why is None else f"torch fallback ({why})"


def _fallback(device: torch.device) -> bool:
    why = triton_usable(device)
    if why is None:
        return False
    if why not in _warned:
        _warned.add(why)
        log.warning("%s; running the torch reference instead", why)
    return True


# Triton reads TRITON_INTERPRET when the kernels are decorated, at import; so do we.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class LaunchConfig(NamedTuple):
    """How one call is launched: `rows` rows of H per program (T divisible by it), `num_warps`
    each; the cache hints of the row loads and stores (Triton's `eviction_policy` of tl.load,
    `cache_modifier` and `eviction_policy` of tl.store; "" = none); `contiguous`: the fused
    kernel's hnorm programs take `rows` adjacent rows of prev (else one stream of `rows` tokens)."""

    num_warps: int
    rows: int
    load_eviction: str = ""
    store_cache: str = ""
    store_eviction: str = ""
    contiguous: bool = False


# Per kernel and BLOCK = next_power_of_2(H): (largest T, config) in increasing T; the first
# entry whose T bound is >= T applies. Chosen on an H200 under CUDA-graph replay against
# vLLM 0.33.0's kernels (4 warps, 1 row, no hints), outputs allocated per call as the model
# does: T <= 64 from h8's warps x rows sweeps (at T in {1, 4, 16, 64}); above, from one sweep
# of 4-16 warps x 1-2 rows x load / store cache hints x contiguous at T in {256, 512, 1024,
# 2048, 4096, 16384}: per range of T the config whose worst ratio to vLLM over the range was
# lowest, with as few entries as that allowed (docs/results/kernels.md, "Against vLLM 0.33.0").
# Loading the rows evict_last was in nearly every range's best; storing .cs with two
# adjacent rows of prev per program is what beats vLLM at H = 7168, T = 256 (sweep: 0.87 of
# vLLM's time, against 1.03 for the previous 4 warps x 1 row). A table, not autotuning: a
# served draft step launches these inside a captured graph, where a first-call search would
# be timed into the capture.
_TUNED: dict[tuple[str, int], tuple[tuple[int, LaunchConfig], ...]] = {
    ("fused_input", 4096): (
        (64, LaunchConfig(8, 1)),
        (256, LaunchConfig(8, 1, load_eviction="evict_last")),
        (1 << 62, LaunchConfig(8, 2, load_eviction="evict_last", store_cache=".cs")),
    ),
    ("fused_input", 8192): (
        (64, LaunchConfig(4, 1)),
        (256, LaunchConfig(4, 2, load_eviction="evict_last", store_cache=".cs", contiguous=True)),
        # only at T = 512 (35 MiB read, 35 MiB written): evict_first loads and evict_last
        # stores, 0.89-0.93 of vLLM's time in six timings, 1.04-1.07 at T = 256 and 1024
        (512, LaunchConfig(8, 1, load_eviction="evict_first", store_eviction="evict_last")),
        (1 << 62, LaunchConfig(8, 1, load_eviction="evict_last", store_cache=".cs")),
    ),
    ("shared_head", 4096): (
        (64, LaunchConfig(8, 1)),
        (256, LaunchConfig(8, 1, load_eviction="evict_last")),
        (1 << 62, LaunchConfig(16, 2, load_eviction="evict_last", store_eviction="evict_last")),
    ),
    ("shared_head", 8192): (
        (64, LaunchConfig(16, 1)),
        (256, LaunchConfig(16, 1, load_eviction="evict_last")),
        (1 << 62, LaunchConfig(8, 1, load_eviction="evict_last", store_eviction="evict_last")),
    ),
}


# The device types (torch.device.type, the names torch.accelerator uses too) the table applies
# to: CUDA, where it was measured, and the CPU, where the kernels run only in Triton's
# interpreter (the tests), which must run the launches CUDA makes. Any other device gets
# `untuned_launch` until the table is measured there. XPU, decided without an Intel GPU:
# nothing in the table was timed on one (its warps and rows per program were traded against
# an H200's SMs and vLLM's CUDA kernels; on Intel's backend a warp is a sub-group of 32
# work-items on an Xe core), and 9 of its 13 entries carry cache hints that Intel's backend
# drops: with triton-xpu 3.3.0b1 they reach Triton's IR, yet each hinted launch's
# SPIR-V is byte-identical to the same launch without them (NOTES.md, "XPU: the kernels
# compiled for an Intel GPU target"). The untuned launch, one row per program, no hints,
# rests on no measurement. Every launch, the table's and the untuned one, compiles for an
# Intel GPU target (scripts/compile_xpu.py); none has run on one.
_TUNED_DEVICE_TYPES = frozenset({"cuda", "cpu"})


def untuned_launch(H: int) -> LaunchConfig:
    """The launch from before the table: one row per program, BLOCK / 512 warps (1 to 8), no hints."""
    return LaunchConfig(max(1, min(8, triton.next_power_of_2(H) // 512)), 1)


def launch_config(kernel: str, H: int, T: int, device_type: str) -> LaunchConfig:
    """The launch of `kernel` ('fused_input' or 'shared_head') for T rows of H on a device of
    `device_type`: the table's where it applies (`_TUNED_DEVICE_TYPES`), else `untuned_launch`."""
    table = _TUNED.get((kernel, triton.next_power_of_2(H)), ()) if device_type in _TUNED_DEVICE_TYPES else ()
    config = next((c for t_max, c in table if T <= t_max), None) or untuned_launch(H)
    return config if T % config.rows == 0 else config._replace(rows=1)


if triton is not None:
    # The interpreter's fp32 -> bf16 cast truncates; compiled code is asked for round to
    # nearest even, which the interpreter gets by integer arithmetic instead: the same bits
    # as torch's .to(bfloat16) for every finite value and infinity. (On an H200 the integer
    # rounding cost 2.7-8.6% of device time at T <= 256 against the cast.)
    _INTERPRETED = tl.constexpr(_INTERPRET)

    @triton.jit
    def _to_bf16_rtne(y):
        if _INTERPRETED:
            bits = y.to(tl.uint32, bitcast=True)
            rounded = bits + 0x7FFF + ((bits >> 16) & 1)
            # a NaN is not rounded: adding could carry its all-ones exponent and mantissa into
            # the sign (0x7FFFFFFF -> 0x8000 = -0); it keeps its sign and top mantissa bits,
            # and the quiet bit (0x00400000) keeps the bf16 mantissa nonzero, so a NaN
            bits = tl.where(y != y, bits | 0x00400000, rounded)  # y != y: y is a NaN
            out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            out = y.to(tl.bfloat16, fp_downcast_rounding="rtne")
        return out

    @triton.jit
    def _rms_rows(
        x,
        w_ptr,
        out_ptr,
        rows,
        offs,
        mask,
        eps,
        H: tl.constexpr,
        STORE_CACHE: tl.constexpr,
        STORE_EVICTION: tl.constexpr,
    ):
        # x [ROWS, BLOCK] fp32 of the rows `rows` (of H each); one weight for all rows, loaded
        # before the reduction (after it, as vLLM does, was up to 8.7% slower at T <= 256)
        w = tl.load(w_ptr + offs, mask=offs < H, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)
        y = x * rstd[:, None] * w[None, :]
        if out_ptr.dtype.element_ty == tl.bfloat16:
            out = _to_bf16_rtne(y)
        else:
            out = y.to(out_ptr.dtype.element_ty)
        tl.store(
            out_ptr + rows[:, None] * H + offs[None, :],
            out,
            mask=mask,
            cache_modifier=STORE_CACHE,
            eviction_policy=STORE_EVICTION,
        )

    @triton.jit
    def _fused_mtp_input_rmsnorm_kernel(
        e_ptr, pos_ptr, prev_ptr, ew_ptr, hw_ptr, eo_ptr, ho_ptr, eps,
        H: tl.constexpr, N_HC: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, CONTIGUOUS: tl.constexpr,
        LOAD_EVICTION: tl.constexpr, STORE_CACHE: tl.constexpr, STORE_EVICTION: tl.constexpr,
    ):  # fmt: skip
        # program (i, task): tokens i*ROWS ... i*ROWS+ROWS-1; task 0 = enorm, 1+j = hnorm of stream j
        t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        task = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        mask = (offs < H)[None, :]
        if task == 0:
            keep = tl.load(pos_ptr + t) != 0
            x = tl.load(e_ptr + t[:, None] * H + offs[None, :], mask=mask, other=0.0, eviction_policy=LOAD_EVICTION).to(
                tl.float32
            )
            # zero before the norm: 0 * rsqrt(0 + eps) is exactly 0, whatever the weight
            x = tl.where(keep[:, None], x, 0.0)
            _rms_rows(x, ew_ptr, eo_ptr, t, offs, mask, eps, H, STORE_CACHE, STORE_EVICTION)
        else:
            if CONTIGUOUS:
                # rows (i*N_HC + task-1)*ROWS ... +ROWS-1 of prev seen as [T*N_HC, H]
                rows = (tl.program_id(0).to(tl.int64) * N_HC + task - 1) * ROWS + tl.arange(0, ROWS)
            else:
                rows = t * N_HC + task - 1
            x = tl.load(
                prev_ptr + rows[:, None] * H + offs[None, :], mask=mask, other=0.0, eviction_policy=LOAD_EVICTION
            ).to(tl.float32)
            _rms_rows(x, hw_ptr, ho_ptr, rows, offs, mask, eps, H, STORE_CACHE, STORE_EVICTION)

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr, w_ptr, out_ptr, eps, H: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
        LOAD_EVICTION: tl.constexpr, STORE_CACHE: tl.constexpr, STORE_EVICTION: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offs = tl.arange(0, BLOCK)
        mask = (offs < H)[None, :]
        x = tl.load(x_ptr + t[:, None] * H + offs[None, :], mask=mask, other=0.0, eviction_policy=LOAD_EVICTION).to(
            tl.float32
        )
        _rms_rows(x, w_ptr, out_ptr, t, offs, mask, eps, H, STORE_CACHE, STORE_EVICTION)


def _hints(config: LaunchConfig) -> dict[str, str]:
    return {
        "LOAD_EVICTION": config.load_eviction,
        "STORE_CACHE": config.store_cache,
        "STORE_EVICTION": config.store_eviction,
    }


def _fused_mtp_input_rmsnorm_into(
    e: torch.Tensor, positions: torch.Tensor, prev: torch.Tensor, enorm_w: torch.Tensor, hnorm_w: torch.Tensor,
    e_out: torch.Tensor, h_out: torch.Tensor, eps: float, n_hc: int, config: LaunchConfig,
) -> None:  # fmt: skip
    """The fused kernel on contiguous tensors, T > 0, into e_out and h_out."""
    T, H = e.shape
    _fused_mtp_input_rmsnorm_kernel[(T // config.rows, 1 + n_hc)](
        e, positions, prev, enorm_w, hnorm_w, e_out, h_out, eps,
        H=H, N_HC=n_hc, BLOCK=triton.next_power_of_2(H), ROWS=config.rows, CONTIGUOUS=config.contiguous,
        **_hints(config), num_warps=config.num_warps,
    )  # fmt: skip


def _mtp_shared_head_rmsnorm_into(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, eps: float, config: LaunchConfig
) -> None:
    """The shared-head kernel on contiguous tensors, T > 0, into out."""
    T, H = x.shape
    _rmsnorm_kernel[(T // config.rows,)](
        x,
        w,
        out,
        eps,
        H=H,
        BLOCK=triton.next_power_of_2(H),
        ROWS=config.rows,
        **_hints(config),
        num_warps=config.num_warps,
    )


def fused_mtp_input_rmsnorm(
    e: torch.Tensor,
    positions: torch.Tensor,
    prev: torch.Tensor,
    enorm_w: torch.Tensor,
    hnorm_w: torch.Tensor,
    eps: float,
    n_hc: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """e [T, H], positions [T], prev [T, n_hc, H] (or flat [T, n_hc*H]) -> (e_out [T, H],
    h_out shaped like prev). Semantics: `fused_mtp_input_rmsnorm_ref`."""
    if _fallback(e.device):
        return fused_mtp_input_rmsnorm_ref(e, positions, prev, enorm_w, hnorm_w, eps, n_hc)
    T, H = e.shape
    e, prev, positions = e.contiguous(), prev.contiguous(), positions.contiguous()
    enorm_w, hnorm_w = enorm_w.contiguous(), hnorm_w.contiguous()
    # two allocations: one buffer sliced into both outputs measured 21 us SLOWER per call on
    # the H200 host (slicing and view cost more there than a second torch.empty_like)
    e_out = torch.empty_like(e)
    h_out = torch.empty_like(prev)
    if T == 0:
        return e_out, h_out
    _fused_mtp_input_rmsnorm_into(
        e, positions, prev, enorm_w, hnorm_w, e_out, h_out, eps, n_hc, launch_config("fused_input", H, T, e.device.type)
    )
    return e_out, h_out


def mtp_shared_head_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> RMSNorm(x) * w [T, H]. Semantics: `mtp_shared_head_rmsnorm_ref`."""
    if _fallback(x.device):
        return mtp_shared_head_rmsnorm_ref(x, w, eps)
    T, H = x.shape
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty_like(x)
    if T == 0:
        return out
    _mtp_shared_head_rmsnorm_into(x, w, out, eps, launch_config("shared_head", H, T, x.device.type))
    return out
