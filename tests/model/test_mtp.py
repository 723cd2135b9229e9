"""The bundled MTP draft model: its layout is mapping/README.md#mtp-parameters, its quantisation names
mapping/README.md#quantisation-layer-names, its loading is strict, and converted + bundled model
computes what an independent reference computes from the native checkpoint (model/README.md)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from spec02 import spec_layout
from torch import nn

from dsv4.convert.exit_codes import exit_code
from dsv4.convert.pipeline import convert
from dsv4.convert.synth import write_checkpoint
from dsv4.model import kernels
from dsv4.model.config import ModelConfig
from dsv4.model.errors import CheckpointError, DSV4Error
from dsv4.model.layout import target_layout
from dsv4.model.loader import default_device, load_converted
from dsv4.model.mtp import DeepSeekV4MTP, hc_post, quant_layer_names
from dsv4.model.presets import preset_config
from dsv4.model.quantized import Fp8Linear, dequant_packed
from dsv4.model.reference import NativeReference, fp4_weight
from dsv4.model.storage import FP4

INDEX = "model.safetensors.index.json"


def cfg_of(preset: str, variant: str) -> ModelConfig:
    return ModelConfig.from_dict(preset_config(preset, variant))


@pytest.mark.parametrize("variant", ["instruct", "base"])
@pytest.mark.parametrize("preset", ["tiny", "flash", "pro"])
def test_target_layout_is_exactly_the_41_parameters_of_spec_02(preset, variant):
    cfg = cfg_of(preset, variant)
    layout = target_layout(cfg)
    assert len(layout) == 41
    assert layout == spec_layout(cfg)


def test_flash_layout_spot_values():
    layout = target_layout(cfg_of("flash", "instruct"))
    B = "model.layers.43.mtp_block."
    assert layout[B + "attn.fused_wqa_wkv.weight"] == ("F8_E4M3", (1536, 4096))
    assert layout[B + "attn.fused_wqa_wkv.weight_scale_inv"] == ("F8_E8M0", (12, 32))
    assert layout[B + "ffn.experts.routed_experts.w13_weight"] == ("U8", (256, 4096, 2048))
    assert layout["model.layers.43.e_proj.weight_scale_inv"] == ("F8_E8M0", (32, 32))
    base = target_layout(cfg_of("pro", "base"))
    assert base["model.layers.61.mtp_block.ffn.experts.routed_experts.w2_weight_scale_inv"] == ("F32", (384, 56, 24))
    assert base["model.layers.61.e_proj.weight_scale_inv"] == ("F32", (56, 56))


def test_target_layout_builds_nothing_real():
    # a Pro draft is ~7 GB: the layout must come from the meta device, in no time or memory
    layout = target_layout(cfg_of("pro", "instruct"))
    assert layout["model.embed_tokens.weight"] == ("BF16", (129280, 7168))


def test_every_mtp_block_gets_its_own_layer_index():
    raw = preset_config("tiny", "instruct")
    raw["num_nextn_predict_layers"] = 2
    layout = target_layout(ModelConfig.from_dict(raw))
    assert len(layout) == 1 + 2 * 40
    assert {k.split(".")[2] for k in layout if k.startswith("model.layers.")} == {"2", "3"}


# --- quantisation layer names (mapping/README.md#quantisation-layer-names) ----------------
def test_every_linear_carries_its_vllm_quantisation_name():
    with torch.device("meta"):
        model = DeepSeekV4MTP(cfg_of("flash", "instruct"))
    names = quant_layer_names(model)
    L = "model.layers.43"
    assert set(names.values()) == {
        "model.embed_tokens",
        f"{L}.e_proj",
        f"{L}.h_proj",
        f"{L}.shared_head.head",
        f"{L}.attn.fused_wqa_wkv",
        f"{L}.attn.wq_b",
        f"{L}.attn.wo_a",
        f"{L}.attn.wo_b",
        f"{L}.ffn.gate",
        f"{L}.ffn.shared_experts.gate_up_proj",
        f"{L}.ffn.shared_experts.down_proj",
        f"{L}.ffn.experts",
    }
    # module paths carry `.mtp_block.`; vLLM's quantisation prefixes do not
    for path, name in names.items():
        assert name == path.replace(".mtp_block.", ".")


def test_a_linear_built_without_a_name_is_refused():
    with pytest.raises(ValueError, match="without a quantisation layer name"):
        Fp8Linear(256, (256,), torch.float8_e8m0fnu, quant_name="")


def test_a_nameless_linear_inside_the_model_is_caught():
    with torch.device("meta"):
        model = DeepSeekV4MTP(cfg_of("tiny", "instruct"))
    layer = model.model.layers["2"]
    layer.e_proj.quant_name = ""
    with pytest.raises(ValueError, match=r"module model\.layers\.2\.e_proj: empty quantisation layer name"):
        quant_layer_names(model)
    layer.e_proj.quant_name = "model.layers.2.e_proj"
    layer.h_proj = nn.Linear(256, 256, bias=False, device="meta")  # the seed's e_proj/h_proj bug
    with pytest.raises(ValueError, match=r"module model\.layers\.2\.h_proj: Linear has no quantisation layer name"):
        quant_layer_names(model)


# --- tiny checkpoints: native, and converted by the project's converter --------------------
@pytest.fixture(scope="module")
def tiny_pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], tuple[Path, Path]]:
    """(variant, seed) -> (native dir, converted dir)."""
    out = {}
    for variant in ("instruct", "base"):
        for seed in (0, 1, 2):
            root = tmp_path_factory.mktemp(f"{variant}{seed}")
            native = write_checkpoint(root / "native", preset="tiny", variant=variant, seed=seed)
            convert(native, root / "converted")
            out[variant, seed] = (native, root / "converted")
    return out


def draft_inputs(cfg: ModelConfig, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    positions = torch.arange(T)
    prev = torch.randn(T, cfg.hc_dim, generator=g).to(torch.bfloat16)
    return ids, positions, prev


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # bf16 tolerances: a relative ulp (2^-7 ~ 0.8%) twice over, plus a small absolute floor
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("variant", ["instruct", "base"])
def test_converted_bundled_model_matches_the_native_reference(tiny_pairs, variant, seed):
    native, converted = tiny_pairs[variant, seed]
    model = load_converted(converted, "cpu")
    ref = NativeReference(native, "cpu")
    ids, positions, prev = draft_inputs(model.config, T=24, seed=seed)
    h, h_ref = model(ids, positions, prev), ref.forward(ids, positions, prev)
    assert h.shape == (24, model.config.hc_dim) and h.dtype == torch.bfloat16
    assert_bf16_close(h, h_ref)
    logits, logits_ref = model.compute_logits(h), ref.compute_logits(h_ref)
    assert logits.shape == (24, model.config.vocab_size) and logits.dtype == torch.float32
    assert_bf16_close(logits, logits_ref)
    assert torch.equal(logits.argmax(-1), logits_ref.argmax(-1))
    # a second draft step chains on the first one's output
    h2, h2_ref = model(ids, positions, h), ref.forward(ids, positions, h_ref)
    assert_bf16_close(h2, h2_ref)


def test_the_comparison_catches_a_wrong_concat_order(tiny_pairs):
    # negative control: gate_up_proj with w3 first (a plausible converter bug) must not pass
    native, converted = tiny_pairs["instruct", 0]
    model = load_converted(converted, "cpu")
    gu = model.model.layers["2"].mtp_block.ffn.shared_experts.gate_up_proj
    for p in (gu.weight, gu.weight_scale_inv):
        p.data = torch.cat(p.data.chunk(2, dim=0)[::-1])
    ids, positions, prev = draft_inputs(model.config, T=24, seed=0)
    with pytest.raises(AssertionError):
        assert_bf16_close(model(ids, positions, prev), NativeReference(native).forward(ids, positions, prev))


def test_the_draft_applies_the_final_hc_post(tiny_pairs):
    """mapping/README.md#seed-bugs bug 3: the seed returned the block's raw FFN output [T, H]."""
    model = load_converted(tiny_pairs["instruct", 0][1], "cpu")
    cfg, layer = model.config, model.model.layers["2"]
    T, n, H = 10, cfg.hc_mult, cfg.hidden_size
    ids, positions, prev = draft_inputs(cfg, T, seed=5)
    out = model(ids, positions, prev)
    e_n, h_n = kernels.fused_mtp_input_rmsnorm(
        model.model.embed_tokens(ids),
        positions,
        prev.view(T, n, H),
        layer.enorm.weight,
        layer.hnorm.weight,
        cfg.rms_norm_eps,
        n,
    )
    with torch.no_grad():
        f, streams, post, comb, _ = layer.mtp_block(layer.h_proj(h_n) + layer.e_proj(e_n).unsqueeze(-2), positions)
    assert f.shape == (T, H), "what the seed returned"
    assert out.shape == (T, n * H)
    assert torch.equal(out, hc_post(f, streams, post, comb).flatten(1))
    assert not torch.allclose(out.view(T, n, H).float(), streams.float(), atol=0.05), "the post-mix changes the streams"


def test_loaded_tensors_keep_the_file_bytes(tiny_pairs):
    converted = tiny_pairs["instruct", 1][1]
    state = load_converted(converted, "cpu").state_dict()
    weight_map = json.loads((converted / INDEX).read_text())["weight_map"]
    for name, file in weight_map.items():
        with safe_open(converted / file, "pt") as f:
            on_disk = f.get_tensor(name)
        assert state[name].dtype == on_disk.dtype
        assert torch.equal(state[name].view(torch.uint8), on_disk.view(torch.uint8)), name


# --- strict loading ---------------------------------------------------------------------
def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy converted checkpoint src to dst as one shard, after edit(tensors) changed it."""
    weight_map = json.loads((src / INDEX).read_text())["weight_map"]
    tensors = {}
    for name, file in weight_map.items():
        with safe_open(src / file, "pt") as f:
            tensors[name] = f.get_tensor(name)
    edit(tensors)
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, dst / "model-00001-of-00001.safetensors")
    (dst / INDEX).write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors")})
    )
    return dst


B = "model.layers.2.mtp_block."


def _extra_norm_gate(t):
    t[B + "ffn.norm_gate.gate.weight"] = t[B + "ffn.gate.weight"].clone()


def _missing_bias(t):
    del t[B + "ffn.gate.e_score_correction_bias"]


def _wrong_shape(t):
    t[B + "attn.attn_sink"] = torch.zeros(5)


def _wrong_dtype(t):
    # a numeric conversion of E8M0 scales instead of a byte-exact rename
    t["model.layers.2.e_proj.weight_scale_inv"] = t["model.layers.2.e_proj.weight_scale_inv"].float()


@pytest.mark.parametrize(
    ("edit", "error", "code", "key"),
    [
        (_extra_norm_gate, "unexpected_key", 52, B + "ffn.norm_gate.gate.weight"),
        (_missing_bias, "missing_key", 51, B + "ffn.gate.e_score_correction_bias"),
        (_wrong_shape, "shape_mismatch", 53, B + "attn.attn_sink"),
        (_wrong_dtype, "dtype_mismatch", 54, "model.layers.2.e_proj.weight_scale_inv"),
    ],
)
def test_strict_load_rejects(tiny_pairs, tmp_path, edit, error, code, key):
    bad = rewrite(tiny_pairs["instruct", 0][1], tmp_path / "bad", edit)
    with pytest.raises(DSV4Error) as info:
        load_converted(bad, "cpu")
    assert info.value.kind == error
    msg = str(info.value)
    assert key in msg and "\n" not in msg
    assert str(bad) in msg, "the message names the file"
    assert exit_code(info.value) == code


def test_strict_load_rejects_a_shard_tensor_missing_from_the_index(tiny_pairs, tmp_path):
    bad = rewrite(tiny_pairs["instruct", 0][1], tmp_path / "bad", _extra_norm_gate)
    index = json.loads((bad / INDEX).read_text())
    del index["weight_map"][B + "ffn.norm_gate.gate.weight"]
    (bad / INDEX).write_text(json.dumps(index))
    # the loader reads headers through the inventory's reader (model/checkpoint.py), so a
    # shard tensor the index does not list is the inventory's index_mismatch (was the
    # loader's own unexpected_key, "(not listed in ...)")
    with pytest.raises(CheckpointError, match=r"ffn\.norm_gate\.gate\.weight is not listed in") as raised:
        load_converted(bad, "cpu")
    assert raised.value.kind == "index_mismatch"


def test_an_unmodified_rewrite_loads(tiny_pairs, tmp_path):
    # the control for the rejections above: rewrite() itself breaks nothing
    good = rewrite(tiny_pairs["instruct", 0][1], tmp_path / "good", lambda t: None)
    assert isinstance(load_converted(good, "cpu"), DeepSeekV4MTP)


def test_device_preference_is_xpu_then_cuda_then_cpu(monkeypatch):
    # torch.accelerator names the build's accelerator (xpu on an XPU build, cuda on a CUDA one)
    def machine(accelerator):
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: accelerator is not None)
        monkeypatch.setattr(
            torch.accelerator, "current_accelerator", lambda *a, **k: torch.device(accelerator) if accelerator else None
        )

    machine(None)
    assert default_device() == torch.device("cpu")
    machine("cuda")
    assert default_device() == torch.device("cuda")
    machine("xpu")
    assert default_device() == torch.device("xpu")


def test_the_shared_expert_swiglu_is_clamped_like_the_routed_ones():
    """vLLM (SiluAndMulWithClamp) and DeepSeek clamp the shared expert too (NOTES.md)."""
    from dsv4.model.mtp import SharedExperts

    cfg = cfg_of("tiny", "instruct")
    shared = SharedExperts(cfg, "model.layers.2")
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lin in (shared.gate_up_proj, shared.down_proj):
            lin.weight = nn.Parameter(
                (torch.randn(lin.weight.shape, generator=g) * 4).to(torch.float8_e4m3fn), requires_grad=False
            )
            lin.weight_scale_inv = nn.Parameter(
                torch.full(lin.weight_scale_inv.shape, 1.0).to(torch.float8_e8m0fnu), requires_grad=False
            )
    x = (torch.randn(3, H, generator=g) * 4).to(torch.bfloat16)
    gate, up = (x @ shared.gate_up_proj.dequantized().T).float().split(I, dim=-1)
    limit = cfg.swiglu_limit
    assert gate.abs().max() > limit and up.abs().max() > limit  # the clamp has work to do
    clamped = (torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)).to(torch.bfloat16)
    unclamped = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
    w2 = shared.down_proj.dequantized().T
    assert torch.equal(shared(x), clamped @ w2)
    assert not torch.equal(shared(x), unclamped @ w2)


def _upstream_inv_freq(rope_dim: int, theta: float) -> torch.Tensor:
    # vLLM 0.33.0 DeepseekScalingRotaryEmbedding._compute_inv_freq and DeepSeek's
    # precompute_freqs_cis (NOTES.md, "RoPE inverse frequencies")
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


@pytest.mark.parametrize("theta", [10000.0, 40000.0, 160000.0])
def test_rope_inverse_frequencies_are_the_upstream_expression_bit_for_bit(theta):
    from dsv4.model.mtp import rope_inv_freq

    rd = cfg_of("flash", "instruct").qk_rope_head_dim
    upstream = _upstream_inv_freq(rd, theta)
    assert torch.equal(rope_inv_freq(rd, theta), upstream)
    old_form = theta ** (-torch.arange(0, rd, 2, dtype=torch.float32) / rd)
    assert not torch.equal(old_form, upstream), "theta ** (-i / rd) is 1 ulp off in some frequencies"


def test_rope_of_the_model_and_of_the_reference_turn_by_position_times_the_upstream_frequencies():
    # a unit pair (1, 0) in every rotated slot comes out as exactly (cos, sin) of its angle; near
    # position 1e6 one ulp of an inverse frequency moves the angle by about 0.0156 rad
    from dsv4.model.mtp import rope
    from dsv4.model.reference import _rotate

    cfg = cfg_of("flash", "instruct")
    rd, theta = cfg.qk_rope_head_dim, cfg.rope_theta
    positions = torch.tensor([1_000_000, 654_321, 12_345, 1])
    x = torch.zeros(4, 2, 8 + rd)
    x[..., -rd::2] = 1.0
    ang = positions.float()[:, None] * _upstream_inv_freq(rd, theta)  # [T, rd/2]
    want_model = torch.stack((ang.cos(), ang.sin()), dim=-1).flatten(-2)[:, None].expand(4, 2, rd)
    assert torch.equal(rope(x, positions, rd, theta)[..., -rd:], want_model)
    cis = torch.polar(torch.ones(1), ang)
    want_reference = torch.view_as_real(cis).flatten(-2)[:, None].expand(4, 2, rd)
    assert torch.equal(_rotate(x, positions, rd, theta, 1.0)[..., -rd:], want_reference)


def test_fp4_dequantisation_to_bf16_has_the_bits_of_the_fp32_result_and_the_references_values():
    """The model dequantises FP4 experts straight into bf16 (half the memory traffic of an
    fp32 pass): every byte value under every E8M0 scale byte (NaN included) gives the bits
    of the fp32 result rounded to bf16, and the reference's bit-arithmetic decode agrees."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # row r: all 256 bytes
    scale = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 512 // 32)  # row r: scale byte r
    fp32 = dequant_packed(packed, scale, FP4, torch.float32)
    assert torch.equal(dequant_packed(packed, scale, FP4).view(torch.int16), fp32.to(torch.bfloat16).view(torch.int16))
    ref = fp4_weight(packed.view(torch.int8), scale)
    assert torch.equal(fp32.isnan(), ref.isnan()) and torch.equal(fp32.nan_to_num(), ref.nan_to_num())
