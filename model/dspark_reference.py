"""An independent plain-torch DSpark draft step that reads a NATIVE 0731 checkpoint directly.

Like reference.py for the MTP draft, it checks the whole chain (converter + bundled model)
against something that shares none of it: it reads the native names (`embed.weight`,
`head.weight`, `mtp.{s}.*`) with safetensors, keeps DeepSeek's structure (separate wq_a and
wkv, per-expert w1/w2/w3), takes the model-level tensors from the stage mapping/README.md#xpu-dspark-layout names
(main_proj and main_norm from stage 0; norm, hc_head and markov_head from stage S-1), and
uses no Triton kernel, no mapping table and no code of the bundled model (mtp.py, dspark.py).
The block math (mHC, MoE, quantised formats) is reference.py's; the attention is written
out here for DSpark: the query block attends to the context window and to all its own
positions over the full score matrix, with no mask at all.

DeepSeek V4.1's drafter (vLLM deepseek_v41/nvidia/dspark.py) is read in its own native names:
each sublayer's streams are weighed by the previous sublayer's pre-mix (the first by its first
stream; reference.py `_sublayer`), the last stage's streams are collapsed by its FFN's pre-mix
instead of an hc_head, the Markov factors are markov_head.embed/head, and the confidence head
scores each drafted token.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import torch

from dsv4.model.checkpoint import Checkpoint
from dsv4.model.config import ModelConfig
from dsv4.model.reference import VOCAB_SLICE, NativeReference, _norm, _rotate, fp8_weight, require_expert_decoding


class ReferenceBlock(NamedTuple):
    hidden_states: torch.Tensor  # [B, n_hc*H]
    base_logits: torch.Tensor  # [B, V] fp32
    logits: torch.Tensor  # [B, V] fp32, with the Markov bias
    draft_tokens: torch.Tensor  # [B]
    confidence: torch.Tensor | None = None  # [B] fp32 (V4.1)


class _StageReference(NativeReference):
    """reference.py's block math for one stage `mtp.{s}.`, with DSpark's attention.

    NativeReference.__init__ reads a whole checkpoint for one MTP block; a stage instead
    shares the tensors its DSparkReference read, so it sets the same attributes itself."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], prefix: str, device: torch.device) -> None:
        self.cfg, self.t, self.p, self.device = cfg, tensors, prefix, device
        self.context_kv: torch.Tensor | None = None  # [C, D], set before each forward

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        kv = _norm(self._linear(x, "attn.wkv"), self.w("attn.kv_norm.weight"), cfg.rms_norm_eps)
        return _rotate(kv, positions, cfg.qk_rope_head_dim, cfg.rope_theta, 1.0)

    def _attention(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        assert self.context_kv is not None
        T, nh, D, rd, g = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.o_groups
        eps = cfg.rms_norm_eps
        q = self._linear(_norm(self._linear(x, "attn.wq_a"), self.w("attn.q_norm.weight"), eps), "attn.wq_b")
        q = _rotate(_norm(q.view(T, nh, D), None, eps), positions, rd, cfg.rope_theta, 1.0)
        kv = torch.cat((self.context_kv, self.latent(x, positions))).float()  # context, then the block
        scores = torch.einsum("thd,sd->hts", q.float(), kv) / math.sqrt(D)  # every key, no mask
        sink = self.w("attn.attn_sink").float().view(nh, 1, 1).expand(nh, T, 1)
        lse = torch.logsumexp(torch.cat((scores, sink), -1), -1, keepdim=True)
        o = torch.einsum("hts,sd->thd", torch.exp(scores - lse), kv).to(x.dtype)
        o = _rotate(o, positions, rd, cfg.rope_theta, -1.0)
        wo_a = self._fp8("attn.wo_a").view(g, cfg.o_lora_rank, -1)
        o = torch.einsum("tgd,grd->tgr", o.reshape(T, g, -1), wo_a.to(x.dtype))
        return self._linear(o.reshape(T, -1), "attn.wo_b")

    def _fp8(self, name: str) -> torch.Tensor:
        return fp8_weight(self.w(f"{name}.weight"), self.w(f"{name}.scale"), self.cfg.weight_block_size)

    def run(
        self, X: torch.Tensor, positions: torch.Tensor, context_kv: torch.Tensor, carried: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Streams [B, n, H] -> (streams after this stage's attention and FFN sublayers, the FFN's
        pre-mix); `carried`: the pre-mix of the sublayer before (V4.1)."""
        self.context_kv = context_kv
        X, pre = self._sublayer(X, "attn", positions, carried)
        return self._sublayer(X, "ffn", positions, pre)


class DSparkReference:
    """The DSpark draft computed straight from a native checkpoint directory."""

    def __init__(self, native_dir: str | Path, device: str | torch.device = "cpu") -> None:
        checkpoint = Checkpoint(native_dir)
        self.cfg = cfg = checkpoint.model_config
        if not cfg.is_dspark:
            raise ValueError(f"{checkpoint.config_path}: not a DSpark config (no dspark_* fields)")
        require_expert_decoding(cfg, str(checkpoint.config_path))
        self.device = torch.device(device)
        stages = tuple(f"mtp.{s}." for s in range(cfg.dspark_stages))
        wanted = sorted(
            k for k in checkpoint.headers.tensors if k in ("embed.weight", "head.weight") or k.startswith(stages)
        )
        # on the CPU, views of safetensors' private map of each shard: a page is read when first touched
        self.t: dict[str, torch.Tensor] = checkpoint.load_tensors(wanted, device)
        self.stages = [_StageReference(cfg, self.t, p, self.device) for p in stages]

    @torch.no_grad()
    def hidden_states(
        self, features: torch.Tensor, context_positions: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        cfg, first = self.cfg, self.stages[0]
        B, n = ids.shape[0], cfg.hc_mult
        window = context_positions >= positions[0] - cfg.sliding_window  # [prefix - window, prefix)
        main_x = first._linear(features[window].to(torch.bfloat16), "main_proj")
        main_x = _norm(main_x, first.w("main_norm.weight"), cfg.rms_norm_eps)
        X = self.t["embed.weight"][ids][:, None, :].repeat(1, n, 1)
        pre = None
        for stage in self.stages:
            X, pre = stage.run(X, positions, stage.latent(main_x, context_positions[window]), pre)
        if cfg.is_v41:  # no hc_head: the last FFN's pre-mix weighs the streams
            return (X.float() * pre[..., None]).sum(1).to(X.dtype)
        return X.reshape(B, -1)

    @torch.no_grad()
    def base_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        cfg, last = self.cfg, self.stages[-1]
        y = hidden_states
        if not cfg.is_v41:
            X = hidden_states.view(hidden_states.shape[0], cfg.hc_mult, cfg.hidden_size)
            flat = X.reshape(X.shape[0], -1).float()
            mix = flat @ last.w("hc_head_fn").T / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
            pre = torch.sigmoid(mix * last.w("hc_head_scale")[0] + last.w("hc_head_base")) + cfg.hc_eps
            y = (X.float() * pre[..., None]).sum(1).to(X.dtype)
        y = _norm(y, last.w("norm.weight"), cfg.rms_norm_eps).float()
        head = self.t["head.weight"]
        logits = torch.empty(y.shape[0], head.shape[0], dtype=torch.float32, device=y.device)
        for a in range(0, head.shape[0], VOCAB_SLICE):  # bf16 -> fp32 is exact: the full fp32 product
            logits[:, a : a + VOCAB_SLICE] = y @ head[a : a + VOCAB_SLICE].float().T
        return logits

    @torch.no_grad()
    def forward(self, features: torch.Tensor, context_positions: torch.Tensor, anchor: int) -> ReferenceBlock:
        cfg, last = self.cfg, self.stages[-1]  # the heads come from stage S-1 (mapping/README.md#xpu-dspark-layout)
        B = cfg.dspark_block_size
        assert B is not None
        ids = torch.tensor([anchor] + [cfg.dspark_noise_token_id] * (B - 1), device=self.device)
        positions = int(context_positions[-1]) + 1 + torch.arange(B, device=self.device)
        h = self.hidden_states(features, context_positions, ids, positions)
        U = self.base_logits(h)
        factors = ("embed", "head") if cfg.is_v41 else ("markov_w1", "markov_w2")
        w1, w2 = (last.w(f"markov_head.{f}.weight").float() for f in factors)
        L, tokens, prev = torch.empty_like(U), [], anchor
        for k in range(B):
            L[k] = U[k] + w2 @ w1[prev]
            prev = int(L[k].argmax())
            tokens.append(prev)
        drafted = torch.tensor(tokens, device=self.device)
        return ReferenceBlock(h, U, L, drafted, self.confidence(h, [anchor, *tokens[:-1]]) if cfg.is_v41 else None)

    def confidence(self, hidden_states: torch.Tensor, prev: list[int]) -> torch.Tensor:
        """V4.1: sigmoid of the confidence head over [h_k, embed[prev_k]] in fp32, for each position k."""
        last = self.stages[-1]
        markov = last.w("markov_head.embed.weight")[torch.tensor(prev, device=self.device)]
        x = torch.cat((hidden_states, markov), dim=-1).float()
        return torch.sigmoid(x @ last.w("confidence_head.proj.weight").float().T)[:, 0]
