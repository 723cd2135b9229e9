"""An independent plain-torch MTP step that reads a NATIVE checkpoint directly.

It exists to check the whole chain (converter + bundled model) against something that
shares none of it: it reads the native names (`embed.weight`, `head.weight`, `mtp.{i}.*`)
with safetensors, keeps DeepSeek's structure (separate wq_a and wkv, per-expert w1/w2/w3,
shared_experts.w1/w2/w3), uses no Triton kernel, no mapping table and none of the bundled
model's code, and decodes the quantised formats its own way (E8M0 as 2^(byte-127), e2m1
codes by bit arithmetic rather than a table). The math is model/README.md, the same contract the
bundled model follows, with two choices made differently where the spec allows either:
the routing weight scales the expert's output after w2 (the bundled model scales before),
and attention is computed over the full [T, T] score matrix per call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv4.model.checkpoint import Checkpoint
from dsv4.model.config import ModelConfig
from dsv4.model.errors import CheckpointError

VOCAB_SLICE = 8192  # rows of the head upcast to fp32 at once in compute_logits: 128 MiB at Flash size


def _e8m0_value(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.float32:  # Base checkpoints store FP8 scales as F32 values
        return scale
    byte = scale.view(torch.uint8).float()
    return torch.where(byte == 255, torch.nan, torch.exp2(byte - 127))


def fp8_weight(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP8 e4m3 [out, in] with a [ceil(out/bn), ceil(in/bk)] scale grid -> fp32 [out, in]."""
    bn, bk = block
    rows, cols = w.shape
    pr, pc = -rows % bn, -cols % bk
    wf = w.float()
    if pr or pc:  # ragged edges only: padding copies the whole matrix
        wf = F.pad(wf, (0, pc, 0, pr))
    blocks = wf.view((rows + pr) // bn, bn, (cols + pc) // bk, bk)
    return blocks.mul_(_e8m0_value(scale)[:, None, :, None]).view(rows + pr, cols + pc)[:rows, :cols]


def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (integers 0..15) -> fp32 values, by bit arithmetic: bit 3 the sign, bits
    2-1 the exponent (bias 1; 0 is subnormal), bit 0 the mantissa."""
    sign = 1.0 - 2.0 * (codes >> 3).float()
    exp, man = ((codes & 7) >> 1).float(), (codes & 1).float()
    return sign * torch.where(exp == 0, 0.5 * man, torch.exp2(exp - 1) * (1 + 0.5 * man))


def fp4_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [out, in/2] (low nibble first) with per-32 E8M0 scales -> fp32 [out, in].

    Each of the 256 byte values is decoded once (its two codes by _e2m1's bit arithmetic)
    and the bytes pick their pair: the same values as decoding every code, without a dozen
    [out, in] temporaries per expert matrix (the smoke's reference decodes ~150 of them)."""
    byte = torch.arange(256, device=packed.device)
    pairs = torch.stack((_e2m1(byte & 15), _e2m1(byte >> 4)), dim=-1)  # byte -> (low, high) values
    codes = packed.view(torch.uint8)
    rows, cols = codes.shape[0], 2 * codes.shape[1]
    # index_select of flat rows: the same gather as pairs[codes], 2x faster on the CPU (half the reference's forward)
    vals = pairs.index_select(0, codes.flatten().int()).view(rows, cols // 32, 32)
    return vals.mul_(_e8m0_value(scale).unsqueeze(-1)).view(rows, cols)


# expert_dtype -> the routed experts' decoding, written here independently of model/storage.py
# (the registry the bundled model decodes by): a storage this reference does not decode
# itself is refused by name, never read as another
EXPERT_DECODING: dict[str, Callable[[torch.Tensor, torch.Tensor, ModelConfig], torch.Tensor]] = {
    "fp4": lambda weight, scale, cfg: fp4_weight(weight, scale),
    "fp8": lambda weight, scale, cfg: fp8_weight(weight, scale, cfg.weight_block_size),
}


def require_expert_decoding(cfg: ModelConfig, where: str) -> None:
    """Refuse (unsupported_layout) a checkpoint whose expert storage this reference has no decoding of."""
    if cfg.expert_dtype not in EXPERT_DECODING:
        raise CheckpointError(
            f"{where}: expert_dtype {cfg.expert_dtype!r}: the independent reference decodes "
            f"{' and '.join(EXPERT_DECODING)} experts only, so --native cannot compare against it",
            kind="unsupported_layout",
            path=where,
            field="expert_dtype",
        )


def _norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * w.float() if w is not None else out).to(x.dtype)


def _rotate(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float, sign: float) -> torch.Tensor:
    """DeepSeek's complex-multiplication RoPE on adjacent pairs of the last rope_dim dims."""
    freqs = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=x.device) / rope_dim)
    cis = torch.polar(torch.ones(1, device=x.device), sign * torch.outer(positions.float(), freqs))  # [T, r/2]
    if x.dim() == 3:
        cis = cis.unsqueeze(1)
    z = torch.view_as_complex(x[..., -rope_dim:].float().reshape(*x.shape[:-1], rope_dim // 2, 2).contiguous())
    rot = torch.view_as_real(z * cis).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rope_dim], rot), dim=-1)


class NativeReference:
    """The MTP draft computed straight from a native checkpoint directory."""

    routing_log: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __init__(self, native_dir: str | Path, device: str | torch.device = "cpu", block_index: int = 0) -> None:
        checkpoint = Checkpoint(native_dir)
        self.cfg = checkpoint.model_config
        require_expert_decoding(self.cfg, str(checkpoint.config_path))
        self.device = torch.device(device)
        self.p = f"mtp.{block_index}."
        listed = checkpoint.headers.tensors
        # Base checkpoints also carry mtp.{i}.emb.tok_emb / head: the draft uses the top-level ones
        own = {k for k in listed if k.startswith(self.p) and not k.startswith((f"{self.p}emb.", f"{self.p}head."))}
        # on the CPU, views of safetensors' private map of each shard: a page is read when first touched
        self.t: dict[str, torch.Tensor] = checkpoint.load_tensors(sorted({"embed.weight", "head.weight"} | own), device)

    def w(self, name: str) -> torch.Tensor:
        return self.t[self.p + name]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        W = fp8_weight(self.w(f"{name}.weight"), self.w(f"{name}.scale"), self.cfg.weight_block_size)
        return x @ W.to(x.dtype).T

    def _hc_weights(self, X: torch.Tensor, sub: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, n = self.cfg, self.cfg.hc_mult
        fn, scale, base = self.w(f"hc_{sub}_fn"), self.w(f"hc_{sub}_scale"), self.w(f"hc_{sub}_base")
        flat = X.reshape(X.shape[0], -1).float()
        mix = F.linear(flat, fn) / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + cfg.hc_eps
        post = 2 * torch.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = (mix[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n)
        comb = comb.softmax(-1) + cfg.hc_eps
        comb = comb / (comb.sum(1, keepdim=True) + cfg.hc_eps)
        for _ in range(1, cfg.hc_sinkhorn_iters):
            comb = comb / (comb.sum(2, keepdim=True) + cfg.hc_eps)
            comb = comb / (comb.sum(1, keepdim=True) + cfg.hc_eps)
        return pre, post, comb

    def _attention(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        T, nh, D, rd, g = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.o_groups
        eps = cfg.rms_norm_eps
        q = self._linear(_norm(self._linear(x, "attn.wq_a"), self.w("attn.q_norm.weight"), eps), "attn.wq_b")
        q = _norm(q.view(T, nh, D), None, eps)
        kv = _norm(self._linear(x, "attn.wkv"), self.w("attn.kv_norm.weight"), eps)
        q = _rotate(q, positions, rd, cfg.rope_theta, 1.0)
        kv = _rotate(kv, positions, rd, cfg.rope_theta, 1.0)
        scores = torch.einsum("thd,sd->hts", q.float(), kv.float()) / math.sqrt(D)
        t = torch.arange(T, device=x.device)
        dist = t[:, None] - t[None, :]
        scores = scores.masked_fill(~((dist >= 0) & (dist < cfg.sliding_window)), -math.inf)
        sink = self.w("attn.attn_sink").float()
        lse = torch.logsumexp(torch.cat((scores, sink.view(nh, 1, 1).expand(nh, T, 1)), -1), -1, keepdim=True)
        o = torch.einsum("hts,sd->thd", torch.exp(scores - lse), kv.float()).to(x.dtype)
        o = _rotate(o, positions, rd, cfg.rope_theta, -1.0)
        wo_a = fp8_weight(self.w("attn.wo_a.weight"), self.w("attn.wo_a.scale"), cfg.weight_block_size)
        o = torch.einsum("tgd,grd->tgr", o.reshape(T, g, -1), wo_a.to(x.dtype).view(g, cfg.o_lora_rank, -1))
        return self._linear(o.reshape(T, -1), "attn.wo_b")

    def _expert(self, x: torch.Tensor, name: str, limit: float, storage: str = "fp8") -> torch.Tensor:
        """One SwiGLU expert, its linears stored as `storage` (the shared expert is FP8 in every release)."""

        def lin(v: torch.Tensor, w: str) -> torch.Tensor:
            W = EXPERT_DECODING[storage](self.w(f"{name}.{w}.weight"), self.w(f"{name}.{w}.scale"), self.cfg)
            return v @ W.to(v.dtype).T

        a, b = lin(x, "w1").float(), lin(x, "w3").float()
        if limit > 0:
            a, b = torch.clamp(a, max=limit), torch.clamp(b, min=-limit, max=limit)
        return lin((F.silu(a) * b).to(x.dtype), "w2")

    def _moe(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        s = F.softplus(x.float() @ self.w("ffn.gate.weight").float().T).sqrt()
        selection = s + self.w("ffn.gate.bias")
        _, idx = selection.topk(cfg.draft_experts_per_tok, dim=-1)
        if self.routing_log is not None:  # logged for the comparison with the model (model/parity.py)
            idx = self.routing_log(selection, idx)
        wts = s.gather(-1, idx)
        if cfg.norm_topk_prob:
            wts = wts / wts.sum(-1, keepdim=True)
        wts = wts * cfg.routed_scaling_factor
        y = self._expert(x, "ffn.shared_experts", cfg.swiglu_limit).float()
        for e in range(cfg.draft_routed_experts):
            rows, slots = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out = self._expert(x[rows], f"ffn.experts.{e}", cfg.swiglu_limit, cfg.expert_dtype).float()
                y.index_add_(0, rows, out * wts[rows, slots, None])
        return y.to(x.dtype)

    def _sublayer(
        self, X: torch.Tensor, sub: str, positions: torch.Tensor, carried: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Streams -> (streams after sublayer `sub`, its pre-mix). V4 weighs the streams into the
        sublayer by that pre-mix; V4.1 by the previous sublayer's, `carried`, and takes the first
        stream where there is none (the first DSpark stage)."""
        pre, post, comb = self._hc_weights(X, sub)
        weights = carried if self.cfg.is_v41 else pre
        u = X[:, 0] if weights is None else (X.float() * weights[..., None]).sum(1).to(X.dtype)
        u = _norm(u, self.w(f"{sub}_norm.weight"), self.cfg.rms_norm_eps)
        f = self._attention(u, positions) if sub == "attn" else self._moe(u)
        out = post[..., None] * f.float()[:, None, :] + torch.einsum("tjk,tjh->tkh", comb, X.float())
        return out.to(X.dtype), pre

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden_states: torch.Tensor
    ) -> torch.Tensor:
        cfg = self.cfg
        T, n, H = input_ids.shape[0], cfg.hc_mult, cfg.hidden_size
        e = self.t["embed.weight"][input_ids]
        e = e * (positions != 0)[:, None].to(e.dtype)  # vLLM's mask: no embedding at position 0
        e = _norm(e, self.w("enorm.weight"), cfg.rms_norm_eps)
        h = _norm(previous_hidden_states.view(T, n, H).to(e.dtype), self.w("hnorm.weight"), cfg.rms_norm_eps)
        X = self._linear(h, "h_proj") + self._linear(e, "e_proj")[:, None, :]
        X, _ = self._sublayer(X, "attn", positions)
        X, _ = self._sublayer(X, "ffn", positions)
        return X.reshape(T, n * H)

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        X = hidden_states.view(hidden_states.shape[0], cfg.hc_mult, cfg.hidden_size)
        flat = X.reshape(X.shape[0], -1).float()
        mix = F.linear(flat, self.w("hc_head_fn")) / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        pre = torch.sigmoid(mix * self.w("hc_head_scale")[0] + self.w("hc_head_base")) + cfg.hc_eps
        y = (X.float() * pre[..., None]).sum(1).to(X.dtype)
        y = _norm(y, self.w("norm.weight"), cfg.rms_norm_eps)
        # A slice of the vocabulary at a time: an fp32 copy of the whole head would be 2 GB
        # at Flash size. bf16 -> fp32 is exact, so this is the full fp32 product.
        head, yf = self.t["head.weight"], y.float()
        logits = torch.empty(yf.shape[0], head.shape[0], dtype=torch.float32, device=yf.device)
        for a in range(0, head.shape[0], VOCAB_SLICE):
            logits[:, a : a + VOCAB_SLICE] = yf @ head[a : a + VOCAB_SLICE].float().T
        return logits
