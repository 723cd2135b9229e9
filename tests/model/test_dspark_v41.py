"""DeepSeek V4.1's hyper-connections in the bundled model (model/mtp.py Block._input and hc_post) are
vLLM 0.33.0's own torch reference of them, cut out of the wheel (model_executor/kernels/mhc/torch.py:
mhc_pre_delayed_torch, mhc_post_torch): each sublayer's input is the streams weighed by the PREVIOUS
sublayer's pre-mix, stream 0 before the first, while post, comb and the pre-mix handed on are this
sublayer's own."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4.model.config import ModelConfig
from dsv4.model.mtp import Block, hc_post
from dsv4.model.presets import preset_config
from scripts.runtime_loaders.cut import cut
from scripts.runtime_loaders.wheels import Wheel, wheel_cache, wheel_path

MHC_TORCH = "vllm/model_executor/kernels/mhc/torch.py"


@pytest.fixture(scope="module")
def vllm_mhc() -> dict[str, Any]:
    ns: dict[str, Any] = {"torch": torch}
    source = Wheel(wheel_path(wheel_cache(), "vllm")).source(MHC_TORCH)
    cut(source, MHC_TORCH, ["mhc_pre_delayed_torch", "mhc_post_torch"], ns)
    return ns


@pytest.fixture(scope="module")
def stage() -> Block:
    cfg = ModelConfig.from_dict(preset_config("tiny", "v41"))
    with torch.device("meta"):
        block = Block(cfg, f"model.layers.{cfg.num_hidden_layers}")
    gen = torch.Generator().manual_seed(0)
    for sub in ("attn", "ffn"):  # the mHC parameters only: no sublayer runs here
        shapes = {"fn": (cfg.hc_mix, cfg.hc_dim), "base": (cfg.hc_mix,), "scale": (3,)}
        for part, shape in shapes.items():
            std = cfg.hc_dim**-0.5 if part == "fn" else 0.5
            setattr(block, f"hc_{sub}_{part}", torch.nn.Parameter(torch.randn(shape, generator=gen) * std))
    return block


@pytest.mark.parametrize("carried", ["none", "previous"])
def test_a_v41_sublayer_takes_the_streams_as_vllm_does(stage: Block, vllm_mhc: dict[str, Any], carried: str) -> None:
    cfg, T = stage.cfg, 6
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, cfg.hc_mult, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    pre_in = None if carried == "none" else torch.rand(T, cfg.hc_mult, generator=gen) + cfg.hc_eps
    u, post, comb, pre = stage._input(x, "ffn", pre_in)
    fn, scale, base = stage.hc_ffn_fn, stage.hc_ffn_scale, stage.hc_ffn_base
    eps = cfg.hc_eps
    want_post, want_comb, want_u, want_pre = vllm_mhc["mhc_pre_delayed_torch"](
        x, fn, scale, base, cfg.rms_norm_eps, eps, eps, 2.0, cfg.hc_sinkhorn_iters, pre_mix=pre_in
    )
    assert torch.equal(u, want_u) and torch.equal(pre, want_pre)
    assert torch.equal(post, want_post.squeeze(-1)) and torch.equal(comb, want_comb)
    f = torch.randn(T, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(hc_post(f, x, post, comb), vllm_mhc["mhc_post_torch"](f, x, want_post, want_comb))
    if carried == "none":  # the first stage: the embedding's copies, stream 0 taken as it is
        assert torch.equal(u, x[:, 0])
    else:  # weighed by the previous sublayer's pre-mix, not by its own (V4's)
        assert not torch.allclose(u.float(), (pre.unsqueeze(-1) * x.float()).sum(1), atol=1e-2)
