"""The bundled DeepSeek V4 MTP draft model, in vLLM 0.33.0's XPU runtime layout.

Its `state_dict()` names, shapes and dtypes ARE the target layout of mapping/README.md#mtp-parameters; a
converted checkpoint loads into it with no remap (see loader.py), and `layout.py` derives
the target layout from it. The math follows model/README.md. Deviations from DeepSeek's reference
code (inference/model.py), all deliberate:

* Linears dequantise their FP8 / FP4 weights to bf16 and multiply bf16 activations; the
  reference quantises activations to FP8 (per 128 block) and runs FP8 GEMMs. Same
  weights, slightly different rounding.
* The FP8 rounding that the reference simulates on the non-rope KV dims is NOT done.
* The routing weight scales the SwiGLU output before w2, as DeepSeek does.
* Attention has no KV cache: the T tokens of one call are one sequence, attended causally
  within the sliding window by token index; `positions` drive RoPE and the
  positions == 0 embedding mask, as in vLLM.
* The shared expert's SwiGLU is clamped by swiglu_limit like the routed experts' (vLLM and
  DeepSeek both clamp it; NOTES.md, item 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.model import kernels
from dsv4.model.config import ModelConfig
from dsv4.model.dtypes import TORCH_DTYPES
from dsv4.model.native import expert_storage, fp8_scale_dtype
from dsv4.model.quantized import (
    Bf16Linear,
    Embedding,
    Fp8Linear,
    QuantLayer,
    RoutedExperts,
    weight_param,
)


def fp8_linear_scale_dtype(cfg: ModelConfig) -> torch.dtype:
    """vLLM 0.33 registers FP8 `weight_scale_inv` as E8M0 beside FP4 experts (instruct) and
    as float32 beside FP8 experts (Base), matching the bytes on disk (mapping/README.md#scale-dtypes)."""
    return TORCH_DTYPES[fp8_scale_dtype(cfg)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = weight_param((dim,), torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm_ref(x, self.weight, self.eps)


# --- mHC (model/README.md#hyper-connections) ---------------------------------------------
def hc_mixes(
    x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Streams [T, n, H] -> (pre [T, n], post [T, n], comb [T, n, n]), fp32 (vLLM
    model_executor/kernels/mhc/torch.py:20-39)."""
    n, eps_hc = cfg.hc_mult, cfg.hc_eps
    xf = x.flatten(-2).float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
    m = (xf @ fn.T) * r
    pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + eps_hc
    post = 2 * torch.sigmoid(m[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = m[:, 2 * n :].view(-1, n, n) * scale[2] + base[2 * n :].view(n, n)
    comb = torch.softmax(comb, dim=-1) + eps_hc
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps_hc)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps_hc)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps_hc)
    return pre, post, comb


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Streams [T, n, H] weighed by pre [T, n] -> [T, H]: sum_k pre_k X_k in fp32, cast back."""
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


def hc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k * f + sum_j comb[j, k] * X_j, fp32, cast back: [T, n, H]."""
    mixed = torch.einsum("tjk,tjh->tkh", comb, x.float())
    return (post.unsqueeze(-1) * f.float().unsqueeze(1) + mixed).to(x.dtype)


def hc_head(
    x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float, hc_eps: float
) -> torch.Tensor:
    """Streams [T, n, H] -> [T, H]: a pre-style weighted sum, no Sinkhorn."""
    xf = x.flatten(-2).float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid((xf @ fn.T) * r * scale[0] + base) + hc_eps
    return hc_collapse(x, pre)


# --- attention (model/README.md#attention) -----------------------------------------------
def rope_inv_freq(rope_dim: int, theta: float) -> torch.Tensor:
    """The RoPE inverse frequencies 1 / theta^(i / rope_dim), i = 0, 2, ..., rope_dim - 2: fp32,
    on the CPU, in the expression vLLM and DeepSeek use (NOTES.md, "RoPE inverse frequencies"),
    so bit-identical with both; theta^(-i / rope_dim) is 1 ulp off in some frequencies."""
    return 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)


def rope(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE (pairs (0,1), (2,3), ...) on the last `rope_dim` dims; out of place.
    x: [T, ..., D]; positions: [T]."""
    inv_freq = rope_inv_freq(rope_dim, theta).to(x.device)
    ang = positions.float().unsqueeze(-1) * inv_freq  # [T, rope_dim/2]
    ang = ang.view(ang.shape[0], *([1] * (x.dim() - 2)), ang.shape[1])
    cos, sin = ang.cos(), ang.sin()
    if inverse:
        sin = -sin
    r = x[..., -rope_dim:].float().unflatten(-1, (rope_dim // 2, 2))
    x0, x1 = r[..., 0], r[..., 1]
    rot = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rot.to(x.dtype)), dim=-1)


# q [T, n_h, D], kv [T, D], attn_sink [n_h] -> o [T, n_h, D]: who attends to what
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sink_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [T, n_h, D], kv [S, D] (K = V), visible [T, S] bool -> o [T, n_h, D]. Query t sees
    the keys s with visible[t, s]; the per-head sink joins the softmax denominator and
    carries no value."""
    T, nh, D = q.shape
    qf = q.float().transpose(0, 1)  # [n_h, T, D]
    kf = kv.float()  # [S, D]
    scores = (qf @ kf.T) * D**-0.5  # [n_h, T, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    sink_col = sink.float().view(nh, 1, 1).expand(nh, T, 1)
    p = torch.softmax(torch.cat((scores, sink_col), dim=-1), dim=-1)[..., :-1]
    return (p @ kf).transpose(0, 1).to(q.dtype)


def sliding_window_sink_attention(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, window: int, chunk: int = 256
) -> torch.Tensor:
    """q [T, n_h, D], kv [T, D] (K = V) -> o [T, n_h, D]. Token t sees s in (t-window, t].
    Queries go in chunks so the score block stays [n_h, chunk, chunk+window] at any T."""
    T = q.shape[0]
    out = torch.empty_like(q)
    for s0 in range(0, T, chunk):
        s1 = min(T, s0 + chunk)
        k0 = max(0, s0 - window + 1)
        t_idx = torch.arange(s0, s1, device=q.device).unsqueeze(-1)
        s_idx = torch.arange(k0, s1, device=q.device).unsqueeze(0)
        visible = (s_idx <= t_idx) & (s_idx > t_idx - window)
        out[s0:s1] = sink_attention(q[s0:s1], kv[k0:s1], sink, visible)
    return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_prefix: str) -> None:
        super().__init__()
        self.cfg = cfg
        H, D, nh, rq = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.q_lora_rank
        g, ro = cfg.o_groups, cfg.o_lora_rank
        sdt, blk = fp8_linear_scale_dtype(cfg), cfg.weight_block_size
        p = f"{layer_prefix}.attn"
        self.attn_sink = weight_param((nh,), torch.float32)
        # wq_a and wkv read the same input: one fused GEMM (rows: r_q of wq_a, then D of wkv)
        self.fused_wqa_wkv = Fp8Linear(H, (rq, D), sdt, f"{p}.fused_wqa_wkv", blk)
        self.q_norm = RMSNorm(rq, cfg.rms_norm_eps)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.wq_b = Fp8Linear(rq, (nh * D,), sdt, f"{p}.wq_b", blk)
        self.wo_a = Fp8Linear(nh * D // g, (g * ro,), sdt, f"{p}.wo_a", blk)
        self.wo_b = Fp8Linear(g * ro, (H,), sdt, f"{p}.wo_b", blk)

    def _latent(self, kv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rope(self.kv_norm(kv), positions, self.cfg.qk_rope_head_dim, self.cfg.rope_theta)

    def latent_kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """kv_norm(wkv(x)) with RoPE at `positions` [T, D]: the latent other tokens attend to
        (the wkv rows of fused_wqa_wkv; the wq_a rows are computed and dropped)."""
        return self._latent(self.fused_wqa_wkv(x)[..., self.cfg.q_lora_rank :], positions)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. `attend` replaces the causal sliding window over the T tokens
        (the DSpark block attends to a context and to itself, non-causally)."""
        cfg = self.cfg
        T = x.shape[0]
        nh, D, g, rd = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.qk_rope_head_dim
        qa, kv = self.fused_wqa_wkv(x).split([cfg.q_lora_rank, D], dim=-1)
        q = self.wq_b(self.q_norm(qa)).view(T, nh, D)
        q = kernels.rms_norm_ref(q, None, cfg.rms_norm_eps)  # weightless, per head
        q = rope(q, positions, rd, cfg.rope_theta)
        kv = self._latent(kv, positions)
        if attend is None:
            o = sliding_window_sink_attention(q, kv, self.attn_sink, cfg.sliding_window)
        else:
            o = attend(q, kv, self.attn_sink)
        o = rope(o, positions, rd, cfg.rope_theta, inverse=True)
        wo_a = self.wo_a.dequantized(o.dtype).view(g, cfg.o_lora_rank, nh * D // g)
        o = torch.einsum("tgd,grd->tgr", o.reshape(T, g, nh * D // g), wo_a)
        return self.wo_b(o.flatten(1))


# --- MoE (model/README.md#moe-routing) ---------------------------------------------------
class Gate(QuantLayer):
    def __init__(self, cfg: ModelConfig, quant_name: str) -> None:
        super().__init__(quant_name)
        E = cfg.draft_routed_experts
        self.weight = weight_param((E, cfg.hidden_size), torch.bfloat16)
        self.e_score_correction_bias = weight_param((E,), torch.float32)
        if cfg.is_v41 and cfg.vision_n_layers > 0:
            # V4.1's router (vLLM deepseek_v4/nvidia/model.py:311-318, which deepseek_v41/nvidia/model.py:129
            # derives from) holds a bias for image tokens beside a tower; a text draft never reads it. The
            # 0731-family layout is vLLM's XPU router, which has none (mapping/xpu_dspark.toml skips it).
            self.bias_vl = weight_param((E,), torch.float32)


class SharedExperts(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_prefix: str) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size
        sdt, blk = fp8_linear_scale_dtype(cfg), cfg.weight_block_size
        p = f"{layer_prefix}.ffn.shared_experts"
        self.inter, self.limit = I, cfg.swiglu_limit
        self.gate_up_proj = Fp8Linear(H, (I, I), sdt, f"{p}.gate_up_proj", blk)
        self.down_proj = Fp8Linear(I, (H,), sdt, f"{p}.down_proj", blk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up_proj(x).float().split(self.inter, dim=-1)
        if self.limit > 0:
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        return self.down_proj((F.silu(g) * u).to(x.dtype))


class Experts(QuantLayer):
    """vLLM's FusedMoE: the quantisation name is `...ffn.experts`; the tensors sit one level
    down, in `routed_experts` (vLLM 0.33.0)."""

    def __init__(self, cfg: ModelConfig, quant_name: str) -> None:
        super().__init__(quant_name)
        E, H, I = cfg.draft_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.routed_experts = RoutedExperts(expert_storage(cfg), E, H, I, cfg.weight_block_size)


class MoE(nn.Module):
    """Routes with sqrtsoftplus scores and noaux_tc selection: ModelConfig refuses any other
    scoring_func or topk_method (model/README.md#moe-routing)."""

    routing_log: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig, layer_prefix: str) -> None:
        super().__init__()
        self.cfg = cfg
        p = f"{layer_prefix}.ffn"
        self.gate = Gate(cfg, f"{p}.gate")
        self.shared_experts = SharedExperts(cfg, layer_prefix)
        self.experts = Experts(cfg, f"{p}.experts")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]); the bias picks experts, never weighs them."""
        cfg = self.cfg
        scores = torch.sqrt(F.softplus(x.float() @ self.gate.weight.float().T))
        selection = scores + self.gate.e_score_correction_bias
        idx = torch.topk(selection, cfg.draft_experts_per_tok, dim=-1).indices
        if self.routing_log is not None:  # a comparison with the reference (model/parity.py)
            idx = self.routing_log(selection, idx)
        w = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w * cfg.routed_scaling_factor, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        I, limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        w, idx = self.route(x)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        experts = self.experts.routed_experts
        # Only experts some token routes to are dequantised (one at a time).
        for e in torch.unique(idx).tolist():
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            w13, w2 = experts.expert_weights(e, x.dtype)
            gate, up = (x[tok] @ w13.T).float().split(I, dim=-1)
            if limit > 0:
                gate = gate.clamp(max=limit)
                up = up.clamp(-limit, limit)
            act = F.silu(gate) * up * w[tok, slot].unsqueeze(-1)
            y.index_add_(0, tok, (act.to(x.dtype) @ w2.T).float())
        y += self.shared_experts(x).float()
        return y.to(x.dtype)


# --- the MTP layer -----------------------------------------------------------------------
def _hc_params(module: nn.Module, sub: str, cfg: ModelConfig) -> None:
    setattr(module, f"hc_{sub}_fn", weight_param((cfg.hc_mix, cfg.hc_dim), torch.float32))
    setattr(module, f"hc_{sub}_base", weight_param((cfg.hc_mix,), torch.float32))
    setattr(module, f"hc_{sub}_scale", weight_param((3,), torch.float32))


class Block(nn.Module):
    """The decoder block (`mtp_block`). Module paths carry `.mtp_block.`, quantisation names
    do not: vLLM hands the block the layer's prefix (mapping/README.md#quantisation-layer-names)."""

    def __init__(self, cfg: ModelConfig, layer_prefix: str) -> None:
        super().__init__()
        self.cfg = cfg
        _hc_params(self, "attn", cfg)
        _hc_params(self, "ffn", cfg)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_prefix)
        self.ffn = MoE(cfg, layer_prefix)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend | None = None,
        carried: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Streams [T, n, H] -> (ffn output [T, H], streams before the ffn mix, post, comb, the ffn
        sublayer's pre-mix [T, n]). Like vLLM's block it leaves the LAST hc_post to the caller.
        `attend`: Attention's. `carried`: V4.1's pre-mix of the sublayer before this block (_input)."""
        u, post, comb, pre = self._input(x, "attn", carried)
        x = hc_post(self.attn(self.attn_norm(u), positions, attend), x, post, comb)
        u, post, comb, pre = self._input(x, "ffn", pre)
        return self.ffn(self.ffn_norm(u)), x, post, comb, pre

    def _input(
        self, x: torch.Tensor, sub: str, carried: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sublayer `sub`'s input [T, H], post, comb and its own pre-mix. V4 collapses the streams with
        that pre-mix; V4.1 (SGLang configs/deepseek_v41.py:47 hc_pre_from_prev_sublayer) with the
        PREVIOUS sublayer's, `carried`, and takes stream 0 where none came before (the first stage:
        vLLM deepseek_v41/nvidia/model.py:522-524, 564, 649; kernels/mhc/torch.py:40-44)."""
        mixes = (getattr(self, f"hc_{sub}_{part}") for part in ("fn", "scale", "base"))
        pre, post, comb = hc_mixes(x, *mixes, self.cfg)
        if not self.cfg.is_v41:
            return hc_collapse(x, pre), post, comb, pre
        return (x[:, 0] if carried is None else hc_collapse(x, carried)), post, comb, pre


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_prefix: str) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Bf16Linear(cfg.hidden_size, cfg.vocab_size, f"{layer_prefix}.shared_head.head")


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_prefix: str) -> None:
        super().__init__()
        self.cfg = cfg
        H, blk, sdt = cfg.hidden_size, cfg.weight_block_size, fp8_linear_scale_dtype(cfg)
        self.enorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps)
        self.e_proj = Fp8Linear(H, (H,), sdt, f"{layer_prefix}.e_proj", blk)
        self.h_proj = Fp8Linear(H, (H,), sdt, f"{layer_prefix}.h_proj", blk)
        self.hc_head_fn = weight_param((cfg.hc_mult, cfg.hc_dim), torch.float32)
        self.hc_head_base = weight_param((cfg.hc_mult,), torch.float32)
        self.hc_head_scale = weight_param((1,), torch.float32)
        self.shared_head = SharedHead(cfg, layer_prefix)
        self.mtp_block = Block(cfg, layer_prefix)

    def forward(self, e: torch.Tensor, positions: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """e [T, H] embeddings, prev [T, n*H] -> streams [T, n*H] (model/README.md#mtp-draft-step)."""
        cfg = self.cfg
        T, n, H = e.shape[0], cfg.hc_mult, cfg.hidden_size
        e_n, h_n = kernels.fused_mtp_input_rmsnorm(
            e, positions, prev.reshape(T, n, H), self.enorm.weight, self.hnorm.weight, cfg.rms_norm_eps, n
        )
        x = self.h_proj(h_n) + self.e_proj(e_n).unsqueeze(-2)
        f, x, post, comb, _ = self.mtp_block(x, positions)
        # the post-mix the seed XPU draft never applied (mapping/README.md#seed-bugs bug 3)
        return hc_post(f, x, post, comb).flatten(1)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        x = h.reshape(h.shape[0], cfg.hc_mult, cfg.hidden_size)
        y = hc_head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, cfg.rms_norm_eps, cfg.hc_eps)
        y = kernels.mtp_shared_head_rmsnorm(y, self.shared_head.norm.weight, cfg.rms_norm_eps)
        return self.shared_head.head.forward_fp32(y)


class MTPModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, "model.embed_tokens")
        self.layers = nn.ModuleDict()
        for i in range(cfg.num_nextn_predict_layers):
            L = cfg.mtp_layer_index(i)
            self.layers[str(L)] = MTPLayer(cfg, f"model.layers.{L}")


class DeepSeekV4MTP(nn.Module):
    """The draft model. `forward` runs MTP block `spec_step_idx % num_nextn_predict_layers`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = MTPModel(cfg)

    def _layer(self, spec_step_idx: int) -> MTPLayer:
        cfg = self.config
        L = cfg.mtp_layer_index(spec_step_idx % cfg.num_nextn_predict_layers)
        return self.model.layers[str(L)]  # type: ignore[return-value]

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        """input_ids [T], positions [T], previous_hidden_states [T, n_hc*H] -> [T, n_hc*H]."""
        e = self.model.embed_tokens(input_ids)
        prev = previous_hidden_states.to(e.dtype)
        return self._layer(spec_step_idx)(e, positions, prev)

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        """[T, n_hc*H] -> fp32 logits [T, V]."""
        return self._layer(spec_step_idx).compute_logits(hidden_states)


def quant_layer_names(model: nn.Module) -> dict[str, str]:
    """Module path -> quantisation layer name for every linear-like module.

    Raises ValueError for a QuantLayer whose name is empty and for any plain nn.Linear or
    nn.Embedding, which would carry no name at all (the seed's e_proj/h_proj bug).
    """
    out: dict[str, str] = {}
    for path, mod in model.named_modules():
        if isinstance(mod, QuantLayer):
            if not mod.quant_name:
                raise ValueError(f"module {path}: empty quantisation layer name")
            out[path] = mod.quant_name
        elif isinstance(mod, (nn.Linear, nn.Embedding)):
            raise ValueError(f"module {path}: {type(mod).__name__} has no quantisation layer name")
    return out
