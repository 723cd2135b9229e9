"""The fused MTP norm kernels agree with their torch references (model/README.md#mtp-draft-step).

On a machine without a GPU the Triton kernels run in the interpreter (conftest.py);
with one, on the GPU. Either way the kernel must be within one bf16 ulp of the reference
on every element: the only allowed difference is the order of the fp32 sum of squares
(both round to nearest even at the store).
"""

import logging
import warnings

import pytest
import torch

from dsv4.model import kernels

DEVICE = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
EPS = 1e-6
N_HC = 4


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in bf16 units in the last place (+0 and -0 equal)."""
    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
    if a.numel() == 0:
        return 0

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.view(torch.int16).int()
        return torch.where(bits < 0, -(bits + 32768), bits)  # sign-magnitude -> monotonic

    return int((ordered(a) - ordered(b)).abs().max())


def _bf(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bfloat16)


def test_ulp_measure_counts_bf16_steps_across_zero():
    assert bf16_ulps(_bf(1.0), _bf(1.0)) == 0
    assert bf16_ulps(_bf(0.0), _bf(-0.0)) == 0
    assert bf16_ulps(_bf(1.0), _bf(1.0078125)) == 1  # bf16 spacing at 1 is 2^-7
    assert bf16_ulps(_bf(1.0), _bf(1.015625)) == 2
    tiny = torch.tensor([1], dtype=torch.int16).view(torch.bfloat16)  # smallest subnormal
    assert bf16_ulps(tiny, -tiny) == 2


def _inputs(T: int, H: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    e = (torch.randn(T, H, generator=g) * 3).to(torch.bfloat16)
    prev = (torch.randn(T, N_HC, H, generator=g) * 5).to(torch.bfloat16)
    # about a third of the tokens start a sequence (position 0)
    positions = torch.randint(0, 3, (T,), generator=g) * torch.randint(1, 100, (T,), generator=g)
    ew = (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16)
    hw = (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16)
    return tuple(t.to(DEVICE) for t in (e, positions, prev, ew, hw))


SHAPES = [(0, 64), (1, 1), (1, 7), (3, 129), (17, 256), (5, 1000), (33, 4096), (2, 7168)]


@pytest.mark.parametrize(("T", "H"), SHAPES)
def test_fused_input_rmsnorm_matches_reference_within_one_ulp(T, H):
    e, positions, prev, ew, hw = _inputs(T, H, seed=T * 1000 + H)
    e_in, prev_in = e.clone(), prev.clone()
    e_out, h_out = kernels.fused_mtp_input_rmsnorm(e, positions, prev, ew, hw, EPS, N_HC)
    e_ref, h_ref = kernels.fused_mtp_input_rmsnorm_ref(e, positions, prev, ew, hw, EPS, N_HC)
    assert e_out.shape == (T, H) and e_out.dtype == torch.bfloat16
    assert h_out.shape == (T, N_HC, H) and h_out.dtype == torch.bfloat16
    assert bf16_ulps(e_out, e_ref) <= 1
    assert bf16_ulps(h_out, h_ref) <= 1
    assert torch.equal(e, e_in) and torch.equal(prev, prev_in), "the kernel must not write its inputs"


def test_fused_input_rmsnorm_accepts_flat_previous_hidden_states():
    e, positions, prev, ew, hw = _inputs(6, 96, seed=1)
    _, h_3d = kernels.fused_mtp_input_rmsnorm(e, positions, prev, ew, hw, EPS, N_HC)
    _, h_flat = kernels.fused_mtp_input_rmsnorm(e, positions, prev.flatten(1), ew, hw, EPS, N_HC)
    assert h_flat.shape == (6, N_HC * 96)
    assert torch.equal(h_flat.view(6, N_HC, 96), h_3d)


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data start 2 bytes past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0 and out.is_contiguous()
    return out


def test_repeated_and_unaligned_calls_agree_with_the_reference():
    # Triton specialises on 16-byte alignment: an unaligned input after aligned ones gets its own kernel
    e, positions, prev, ew, hw = _inputs(11, 520, seed=11)
    e_ref, h_ref = kernels.fused_mtp_input_rmsnorm_ref(e, positions, prev, ew, hw, EPS, N_HC)
    for args in ((e, prev), (e, prev), (_unaligned(e), _unaligned(prev)), (e, prev)):
        e_out, h_out = kernels.fused_mtp_input_rmsnorm(args[0], positions, args[1], ew, hw, EPS, N_HC)
        assert bf16_ulps(e_out, e_ref) <= 1 and bf16_ulps(h_out, h_ref) <= 1
    for x in (e, e, _unaligned(e), e):
        assert bf16_ulps(kernels.mtp_shared_head_rmsnorm(x, ew, EPS), kernels.rms_norm_ref(e, ew, EPS)) <= 1


class _CountingKernel:
    """Stands in for a Triton kernel and counts launches through Triton's `kernel[grid](...)`."""

    def __init__(self, kernel):
        self.kernel, self.jit_launches = kernel, 0

    def __getitem__(self, grid):
        self.jit_launches += 1
        return self.kernel[grid]


def test_every_call_launches_through_tritons_public_kernel_grid_launch(monkeypatch):
    if kernels.triton_usable(DEVICE) is not None:
        pytest.skip(kernels.triton_usable(DEVICE))
    counting = _CountingKernel(kernels._rmsnorm_kernel)
    monkeypatch.setattr(kernels, "_rmsnorm_kernel", counting)
    x, _, _, w, _ = _inputs(8, 640, seed=4)
    outs = [kernels.mtp_shared_head_rmsnorm(x, w, EPS) for _ in range(3)]
    outs.append(kernels.mtp_shared_head_rmsnorm(x[:5], w, EPS))  # other T: same compiled kernel
    outs.append(kernels.mtp_shared_head_rmsnorm(_unaligned(x), w, EPS))
    assert counting.jit_launches == 5, "one kernel[grid](...) launch per call, no launch around Triton's"
    assert (
        all(torch.equal(o, outs[0]) for o in outs[1:3])
        and torch.equal(outs[3], outs[0][:5])
        and torch.equal(outs[4], outs[0])
    )


def test_launches_of_one_shape_with_other_warps_each_match_the_reference(monkeypatch):
    if kernels.triton_usable(DEVICE) is not None:
        pytest.skip(kernels.triton_usable(DEVICE))
    counting = _CountingKernel(kernels._rmsnorm_kernel)
    monkeypatch.setattr(kernels, "_rmsnorm_kernel", counting)
    Config = kernels.LaunchConfig
    monkeypatch.setattr(kernels, "_TUNED", {("shared_head", 1024): ((4, Config(2, 1)), (1 << 62, Config(8, 1)))})
    x, _, _, w, _ = _inputs(8, 640, seed=6)
    for T in (4, 8, 4, 8):
        assert bf16_ulps(kernels.mtp_shared_head_rmsnorm(x[:T], w, EPS), kernels.rms_norm_ref(x[:T], w, EPS)) <= 1
    assert counting.jit_launches == 4


def test_non_contiguous_inputs_are_accepted():
    e, positions, prev, ew, hw = _inputs(4, 64, seed=5)
    e_t = e.t().contiguous().t()  # same values, column-major
    e_out, _ = kernels.fused_mtp_input_rmsnorm(e_t, positions, prev, ew, hw, EPS, N_HC)
    e_ref, _ = kernels.fused_mtp_input_rmsnorm_ref(e, positions, prev, ew, hw, EPS, N_HC)
    assert bf16_ulps(e_out, e_ref) <= 1


def test_position_zero_embedding_rows_are_exactly_zero_and_streams_are_not_masked():
    T, H = 9, 200
    e, _, prev, ew, hw = _inputs(T, H, seed=7)
    positions = torch.tensor([0, 5, 0, 1, 2, 0, 9, 3, 4], device=DEVICE)
    e_out, h_out = kernels.fused_mtp_input_rmsnorm(e, positions, prev, ew, hw, EPS, N_HC)
    masked = positions == 0
    assert torch.equal(e_out[masked], torch.zeros_like(e_out[masked]))
    assert not torch.signbit(e_out[masked]).any(), "masked rows are +0, not -0"
    assert (e_out[~masked] != 0).any(dim=-1).all()
    # the mask is the embedding's only (vLLM): the residual streams of those tokens are normed
    assert bf16_ulps(h_out[masked], kernels.rms_norm_ref(prev[masked], hw, EPS)) <= 1
    assert (h_out[masked] != 0).any()


def test_each_stream_is_normed_over_hidden_not_over_all_streams():
    T, H = 2, 64
    e, positions, _, ew, hw = _inputs(T, H, seed=3)
    prev = torch.ones(T, N_HC, H, dtype=torch.bfloat16, device=DEVICE)
    prev[:, 1] *= 100  # a stream with a larger scale must still come out at unit RMS
    hw = torch.ones_like(hw)
    _, h_out = kernels.fused_mtp_input_rmsnorm(e, positions, prev, ew, hw, EPS, N_HC)
    assert torch.equal(h_out, torch.ones_like(h_out))


@pytest.mark.parametrize(("T", "H"), SHAPES)
def test_shared_head_rmsnorm_matches_reference_within_one_ulp(T, H):
    g = torch.Generator().manual_seed(H + T)
    x = (torch.randn(T, H, generator=g) * 4).to(torch.bfloat16).to(DEVICE)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16).to(DEVICE)
    x_in = x.clone()
    out = kernels.mtp_shared_head_rmsnorm(x, w, EPS)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    assert bf16_ulps(out, kernels.mtp_shared_head_rmsnorm_ref(x, w, EPS)) <= 1
    assert torch.equal(x, x_in)


def test_references_are_fp32_math_with_one_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 300, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(300, generator=g)).to(torch.bfloat16)
    x64 = x.double()
    exact = x64 / torch.sqrt(x64.square().mean(-1, keepdim=True) + EPS) * w.double()
    assert bf16_ulps(kernels.mtp_shared_head_rmsnorm_ref(x, w, EPS), exact.to(torch.bfloat16)) <= 1


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError(f"kernel launched with grid {grid} for T = 0")


def test_zero_tokens_launch_nothing(monkeypatch):
    if kernels.triton_usable(DEVICE) is not None:
        pytest.skip(kernels.triton_usable(DEVICE))
    monkeypatch.setattr(kernels, "_fused_mtp_input_rmsnorm_kernel", _NoLaunch())
    monkeypatch.setattr(kernels, "_rmsnorm_kernel", _NoLaunch())
    e, positions, prev, ew, hw = _inputs(0, 128, seed=0)
    e_out, h_out = kernels.fused_mtp_input_rmsnorm(e, positions, prev, ew, hw, EPS, N_HC)
    assert e_out.shape == (0, 128) and h_out.shape == (0, N_HC, 128)
    assert kernels.mtp_shared_head_rmsnorm(e, ew, EPS).shape == (0, 128)


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_without_triton_the_torch_reference_runs_and_says_so_once(monkeypatch):
    monkeypatch.setattr(kernels, "triton", None)
    monkeypatch.setattr(kernels, "_warned", set())
    e, positions, prev, ew, hw = _inputs(5, 64, seed=2)
    notices = ListHandler()
    kernels.log.addHandler(notices)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                e_out, h_out = kernels.fused_mtp_input_rmsnorm(e, positions, prev, ew, hw, EPS, N_HC)
                out = kernels.mtp_shared_head_rmsnorm(e, ew, EPS)
    finally:
        kernels.log.removeHandler(notices)
    # one notice through logging (the CLI prints it as one line), no Python warning
    assert [(r.name, r.levelname, r.getMessage()) for r in notices.records] == [
        ("dsv4.model.kernels", "WARNING", "triton is not importable; running the torch reference instead")
    ]
    assert caught == []
    e_ref, h_ref = kernels.fused_mtp_input_rmsnorm_ref(e, positions, prev, ew, hw, EPS, N_HC)
    assert torch.equal(e_out, e_ref) and torch.equal(h_out, h_ref)
    assert torch.equal(out, kernels.mtp_shared_head_rmsnorm_ref(e, ew, EPS))
    assert kernels.backend(DEVICE) == "torch fallback (triton is not importable)"


TUNED = sorted(
    {(kernel, block, config) for (kernel, block), entries in kernels._TUNED.items() for _, config in entries}
)


@pytest.mark.parametrize(("kernel", "block", "config"), TUNED)
def test_every_tuned_launch_config_matches_the_reference(kernel, block, config):
    # each config of the table, launched through the model's wrapper for a small T (a
    # multiple of its rows per program): on any device, whichever launch it would pick
    if kernels.triton_usable(DEVICE) is not None:
        pytest.skip(kernels.triton_usable(DEVICE))
    H = {4096: 4096, 8192: 7168}.get(block, block - 3)
    T = 3 * config.rows
    e, positions, prev, ew, hw = _inputs(T, H, seed=block + config.num_warps + config.rows)
    if kernel == "fused_input":
        got = (torch.empty_like(e), torch.empty_like(prev))
        kernels._fused_mtp_input_rmsnorm_into(e, positions, prev, ew, hw, *got, EPS, N_HC, config)
        want = kernels.fused_mtp_input_rmsnorm_ref(e, positions, prev, ew, hw, EPS, N_HC)
    else:
        got, want = (torch.empty_like(e),), (kernels.mtp_shared_head_rmsnorm_ref(e, ew, EPS),)
        kernels._mtp_shared_head_rmsnorm_into(e, ew, got[0], EPS, config)
    assert all(bf16_ulps(g, w) <= 1 for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("kernel", ["fused_input", "shared_head"])
def test_xpu_gets_the_untuned_launch_at_every_T_and_cuda_the_table(kernel):
    # until the table is measured on an Intel GPU (model/kernels.py, _TUNED_DEVICE_TYPES)
    Ts = (1, 3, 64, 65, 256, 257, 512, 513, 4096, 16385)
    for H in (4096, 7168):
        untuned = kernels.untuned_launch(H)
        assert untuned == kernels.LaunchConfig(8, 1), "one row per program, BLOCK / 512 warps up to 8, no hints"
        assert {kernels.launch_config(kernel, H, T, "xpu") for T in Ts} == {untuned}
        table = kernels._TUNED[(kernel, 4096 if H == 4096 else 8192)]
        on_cuda = {kernels.launch_config(kernel, H, T, "cuda") for T in Ts}
        assert on_cuda == {c for _, c in table} | {c._replace(rows=1) for _, c in table if c.rows > 1}
        assert on_cuda == {kernels.launch_config(kernel, H, T, "cpu") for T in Ts}, "the interpreter runs CUDA's"


def test_each_call_chooses_its_launch_by_its_tensors_device_type(monkeypatch):
    if kernels.triton_usable(DEVICE) is not None:
        pytest.skip(kernels.triton_usable(DEVICE))
    asked = []

    def recording(kernel, H, T, device_type):
        asked.append((kernel, H, T, device_type))
        return kernels.untuned_launch(H)

    monkeypatch.setattr(kernels, "launch_config", recording)
    e, positions, prev, ew, hw = _inputs(5, 96, seed=8)
    kernels.fused_mtp_input_rmsnorm(e, positions, prev, ew, hw, EPS, N_HC)
    kernels.mtp_shared_head_rmsnorm(e, ew, EPS)
    assert asked == [("fused_input", 96, 5, DEVICE.type), ("shared_head", 96, 5, DEVICE.type)]


HINTED = [
    kernels.LaunchConfig(4, 2, contiguous=True),
    kernels.LaunchConfig(4, 4, load_eviction="evict_first", store_cache=".cs", contiguous=True),
    kernels.LaunchConfig(2, 1, load_eviction="evict_last", store_eviction="evict_first"),
    kernels.LaunchConfig(8, 2, load_eviction="evict_last", store_eviction="evict_last"),
]


@pytest.mark.parametrize("config", HINTED)
def test_cache_hints_and_programs_on_adjacent_rows_of_prev_do_not_change_the_result(monkeypatch, config):
    # hnorm programs on `rows` adjacent rows of prev (contiguous) must still cover every
    # (token, stream) row exactly once; cache hints change where data lives, not the math
    T, H = 12, 1000
    monkeypatch.setattr(kernels, "_TUNED", {(k, 1024): ((1 << 62, config),) for k in ("fused_input", "shared_head")})
    e, positions, prev, ew, hw = _inputs(T, H, seed=config.rows + config.num_warps)
    got = kernels.fused_mtp_input_rmsnorm(e, positions, prev, ew, hw, EPS, N_HC)
    want = kernels.fused_mtp_input_rmsnorm_ref(e, positions, prev, ew, hw, EPS, N_HC)
    assert all(bf16_ulps(g, w) <= 1 for g, w in zip(got, want, strict=True))
    assert bf16_ulps(kernels.mtp_shared_head_rmsnorm(e, ew, EPS), kernels.mtp_shared_head_rmsnorm_ref(e, ew, EPS)) <= 1


def test_launch_config_takes_the_first_bound_at_or_above_T_and_one_row_where_rows_do_not_divide_T(monkeypatch):
    Config = kernels.LaunchConfig
    monkeypatch.setattr(kernels, "_TUNED", {("shared_head", 1024): ((16, Config(2, 1)), (1 << 62, Config(8, 4)))})
    assert kernels.launch_config("shared_head", 1000, 16, "cuda") == Config(2, 1)
    assert kernels.launch_config("shared_head", 1000, 20, "cuda") == Config(8, 4)
    assert kernels.launch_config("shared_head", 1000, 18, "cuda") == Config(8, 1)
    assert kernels.launch_config("fused_input", 1000, 20, "cuda") == Config(2, 1), "untuned: 1 row, BLOCK / 512 warps"


@pytest.mark.parametrize("T", [8, 6])
def test_several_rows_per_program_norm_each_row_by_its_own_rms(monkeypatch, T):
    # 4 rows per program; at T = 6 (not a multiple of 4) one row per program, every row written
    monkeypatch.setattr(
        kernels, "_TUNED", {(k, 1024): ((1 << 62, kernels.LaunchConfig(4, 4)),) for k in ("fused_input", "shared_head")}
    )
    e, positions, prev, ew, hw = _inputs(T, 1000, seed=T)
    prev[:, 2] *= 64  # rows of one program at very different scales
    e_out, h_out = kernels.fused_mtp_input_rmsnorm(e, positions, prev, ew, hw, EPS, N_HC)
    e_ref, h_ref = kernels.fused_mtp_input_rmsnorm_ref(e, positions, prev, ew, hw, EPS, N_HC)
    assert bf16_ulps(e_out, e_ref) <= 1 and bf16_ulps(h_out, h_ref) <= 1
    assert bf16_ulps(kernels.mtp_shared_head_rmsnorm(e, ew, EPS), kernels.rms_norm_ref(e, ew, EPS)) <= 1


# fp32 NaNs whose exponent and top mantissa bits are all ones and whose low 16 bits are
# >= 0x8000: adding the rounding increment carries into the sign (or out of the word);
# and NaNs whose mantissa lies in the low 16 bits only: rounding them gives infinity
NAN_BITS = [0x7FFFFFFF, 0xFFFFFFFF, 0xFFFF8000, 0x7FFF8001, 0x7FFF8000, 0x7F800001, 0xFF800001, 0x7FC00000]


def _f32_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.uint32).view(torch.float32)


def test_nan_patterns_are_nans():
    assert torch.isnan(_f32_from_bits(NAN_BITS)).all()


if kernels.triton is not None:
    import triton
    import triton.language as tl

    from dsv4.model.kernels import _to_bf16_rtne

    @triton.jit
    def _round_to_bf16_kernel(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
        # the kernels' own fp32 -> bf16 rounding, on each element of x
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, _to_bf16_rtne(tl.load(x_ptr + offs, mask=offs < N)), mask=offs < N)


def test_kernel_bf16_rounding_keeps_every_nan_a_nan_and_rounds_the_rest_like_torch():
    if kernels.triton_usable(DEVICE) is not None:
        pytest.skip(kernels.triton_usable(DEVICE))
    # every fp32 high half (sign, exponent, top 7 mantissa bits) with low halves at and
    # around the rounding boundary (ties go to even), then the NaNs above
    high = torch.arange(1 << 16, dtype=torch.int64) << 16
    low = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = torch.cat(((high[:, None] | low[None, :]).flatten(), torch.tensor(NAN_BITS, dtype=torch.int64)))
    x = bits.to(torch.uint32).view(torch.float32).to(DEVICE)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    _round_to_bf16_kernel[(triton.cdiv(x.numel(), 4096),)](x, out, x.numel(), BLOCK=4096)
    nan = torch.isnan(x)
    assert torch.isnan(out[nan]).all(), (
        f"NaN in, not NaN out: {[hex(b) for b in bits[nan.cpu() & ~torch.isnan(out).cpu()].tolist()[:4]]}"
    )
    want = x[~nan].to(torch.bfloat16)
    assert torch.equal(out[~nan].view(torch.int16), want.view(torch.int16)), (
        "finite values and infinities: torch's bits"
    )


@pytest.mark.parametrize("nan_bits", NAN_BITS, ids=hex)
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")  # signalling NaNs, numpy
def test_a_nan_weight_gives_nan_from_every_kernel_path_that_rounds(nan_bits):
    # y = x * rstd * w: a NaN weight (fp32, so every NaN bit pattern can be fed) makes its
    # column NaN before the bf16 rounding of enorm, of each hnorm and of the shared head
    T, H, col = 4, 96, 5
    e, positions, prev, _, _ = _inputs(T, H, seed=9)
    w = torch.ones(H, dtype=torch.float32)
    w[col] = _f32_from_bits([nan_bits])[0]
    w = w.to(DEVICE)
    e_out, h_out = kernels.fused_mtp_input_rmsnorm(e, positions, prev, w, w, EPS, N_HC)
    head = kernels.mtp_shared_head_rmsnorm(e, w, EPS)
    paths = {"enorm": e_out, "hnorm": h_out, "shared head": head}
    assert {
        name: out[..., col].flatten().tolist() for name, out in paths.items() if not torch.isnan(out[..., col]).all()
    } == {}
    assert not any(torch.isnan(out[..., col + 1 :]).any() for out in paths.values())
