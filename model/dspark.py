"""The bundled DSpark draft model (DeepSeek-V4-Flash-0731), in vLLM 0.33.0's XPU runtime layout, and
DeepSeek V4.1's DSpark drafter in the same names.

Its `state_dict()` names, shapes and dtypes ARE mapping/README.md#xpu-dspark-layout's 98 parameters (at 0731 size):
`layout.py` derives the DSpark target layout from it and a converted checkpoint loads into
it with no remap (loader.py). The stages are V4 decoder blocks, mtp.py's `Block`, numbered
by list index (`model.layers.{s}`, no `mtp_block.` level). The math follows model/README.md#dspark-forward
on top of model/README.md's block math; the deviations of mtp.py's docstring apply here too
(bf16 dequantised weights, no FP8 KV simulation). Beyond them:

* No KV cache: one call drafts one block. The context K/V are recomputed from the target
  features passed in, and only the last `sliding_window` context positions are kept (what
  vLLM's sliding-window cache would still hold).
* Greedy drafting only (argmax); vLLM's sampling replaces it with a Gumbel draw.

DeepSeek V4.1's drafter (cfg.is_v41) follows vLLM 0.33.0's models/deepseek_v41/nvidia/dspark.py; no
runtime loads it in these names (vLLM has no XPU V4.1), which keep the 0731 layout's wherever the
stage is the same. Where V4.1 differs: each sublayer's input is collapsed with the previous
sublayer's pre-mix (mtp.py Block._input); there is no hc_head, the streams after the last stage are
collapsed with the last FFN's pre-mix (dspark.py:238-244) and the block's hidden states are that
[B, H]; the stages' MoE has dspark_n_routed_experts experts, top dspark_num_experts_per_tok
(nvidia/model.py:136-144); a confidence head scores each drafted token (dspark.py:147-152, 356-361).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dsv4.model import kernels
from dsv4.model.config import ModelConfig
from dsv4.model.mtp import Block, RMSNorm, fp8_linear_scale_dtype, hc_collapse, hc_head, hc_post, sink_attention
from dsv4.model.quantized import Bf16Linear, Embedding, Fp8Linear, weight_param


class DraftBlock(NamedTuple):
    """One drafted block of B positions."""

    hidden_states: torch.Tensor  # [B, n_hc*H] residual streams after the last hc_post (before hc_head);
    # V4.1: [B, H], those streams collapsed with the last FFN's pre-mix
    base_logits: torch.Tensor  # [B, V] fp32: U = lm_head(norm(hc_head(streams))) (V4.1: of the collapsed)
    logits: torch.Tensor  # [B, V] fp32: L_k = U[k] + the Markov head's bias for the previous token
    draft_tokens: torch.Tensor  # [B] int64: argmax of L_k, left to right
    confidence: torch.Tensor | None = None  # [B] fp32, V4.1: the probability draft token k is accepted


def block_visibility(n_context: int, block_size: int, device: torch.device | None = None) -> torch.Tensor:
    """[B, n_context + B] bool: which keys each block query sees. DSpark's block attention is
    NOT causal: every query sees the whole context window and every block position, later
    ones included (vLLM v1/attention/backends/mla/sparse_swa.py:1234-1320)."""
    return torch.ones(block_size, n_context + block_size, dtype=torch.bool, device=device)


class MarkovHead(nn.Module):
    """A rank-R bigram bias: the previous token's row of markov_w1, times markov_w2^T."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        V, R = cfg.vocab_size, cfg.dspark_markov_rank
        assert R is not None
        self.markov_w1 = Embedding(V, R, "model.markov_head.markov_w1")
        self.markov_w2 = Bf16Linear(R, V, "model.markov_head.markov_w2")

    def bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev: a token id (0-dim) -> fp32 [V]: markov_w1[prev] @ markov_w2^T."""
        return self.markov_w2.forward_fp32(self.markov_w1(prev.view(1)))[0]


class ConfidenceHead(nn.Module):
    """V4.1's acceptance score: sigmoid(proj(cat(h_k, markov_w1[prev_k]))) in fp32, h_k the collapsed
    pre-norm hidden state (vLLM qwen3_dspark.py:185-189, deepseek_v41/nvidia/dspark.py:356-361; the
    speculator passes the Markov embedding of each position's previous token, v1/worker/gpu/spec_decode/
    dspark/speculator.py:186-207)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.dspark_markov_rank is not None
        self.proj = Bf16Linear(cfg.hidden_size + cfg.dspark_markov_rank, 1, "model.confidence_head.proj")

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """hidden [B, H], markov_embed [B, R] -> [B] fp32 probabilities."""
        return torch.sigmoid(self.proj.forward_fp32(torch.cat((hidden, markov_embed), dim=-1))[:, 0])


class DSparkModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.dspark_target_layer_ids is not None
        H, n, T = cfg.hidden_size, cfg.hc_mult, len(cfg.dspark_target_layer_ids)
        self.embed_tokens = Embedding(cfg.vocab_size, H, "model.embed_tokens")
        # the target features: T hidden states of the target, concatenated
        self.main_proj = Fp8Linear(T * H, (H,), fp8_linear_scale_dtype(cfg), "model.main_proj", cfg.weight_block_size)
        self.main_norm = RMSNorm(H, cfg.rms_norm_eps)
        # An nn.ModuleList: parameters are named model.layers.{s}. vLLM builds stage s with the
        # layer prefix model.layers.{N+s} (xpu/dspark.py, DSparkDeepseekV4Model.__init__), so
        # that is its quantisation names' prefix, as for the MTP block (NOTES.md).
        self.layers = nn.ModuleList(
            Block(cfg, f"model.layers.{cfg.num_hidden_layers + s}") for s in range(cfg.dspark_stages)
        )
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        if not cfg.is_v41:  # V4.1 has no learned hc_head (vLLM deepseek_v41/nvidia/dspark.py:132-136)
            self.hc_head_fn = weight_param((n, cfg.hc_dim), torch.float32)
            self.hc_head_base = weight_param((n,), torch.float32)
            self.hc_head_scale = weight_param((1,), torch.float32)
        self.markov_head = MarkovHead(cfg)
        if cfg.is_v41:  # vLLM's XPU 0731 class has none (mapping/xpu_dspark.toml skips it)
            self.confidence_head = ConfidenceHead(cfg)


class DSparkDraft(nn.Module):
    """The DSpark drafter: target features of a context + an anchor token -> B draft tokens."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not cfg.is_dspark:
            raise ValueError(
                "DSparkDraft needs a DSpark config (the dspark_* fields of mapping/README.md#dspark-source-checkpoint)"
            )
        self.config = cfg
        self.model = DSparkModel(cfg)
        self.lm_head = Bf16Linear(cfg.hidden_size, cfg.vocab_size, "lm_head")

    @property
    def hidden_width(self) -> int:
        """Columns of a block's hidden states: the n_hc streams, or V4.1's collapsed H."""
        cfg = self.config
        return cfg.hidden_size if cfg.is_v41 else cfg.hc_dim

    def block_ids(self, anchor: int | torch.Tensor) -> torch.Tensor:
        """[anchor, noise x (B-1)]: the query block's token ids (model/README.md#dspark-forward step 3)."""
        cfg = self.config
        assert cfg.dspark_block_size is not None and cfg.dspark_noise_token_id is not None
        ids = torch.full(
            (cfg.dspark_block_size,), cfg.dspark_noise_token_id, dtype=torch.long, device=self.lm_head.weight.device
        )
        ids[0] = anchor
        return ids

    def block_positions(self, context_positions: torch.Tensor) -> torch.Tensor:
        """p+1 .. p+B after the last context position p."""
        B = self.config.dspark_block_size
        assert B is not None
        return context_positions[-1] + 1 + torch.arange(B, device=context_positions.device)

    def main_x(self, features: torch.Tensor) -> torch.Tensor:
        """[T_ctx, T*H] target features (cat of h_l over dspark_target_layer_ids) -> [T_ctx, H]."""
        m = self.model
        x = m.main_proj(features.to(torch.bfloat16))
        return kernels.mtp_shared_head_rmsnorm(x, m.main_norm.weight, self.config.rms_norm_eps)

    @torch.no_grad()
    def hidden_states(
        self, features: torch.Tensor, context_positions: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The S stages over the query block `ids` at `positions` [B] -> streams [B, n_hc*H]
        (V4.1: collapsed, [B, H]).

        features [T_ctx, T*H], context_positions [T_ctx] (increasing, all before positions[0]);
        only the context positions inside the sliding window of the block's start are seen."""
        cfg = self.config
        B, n, H = ids.shape[0], cfg.hc_mult, cfg.hidden_size
        in_window = context_positions >= positions[0] - cfg.sliding_window
        ctx_positions = context_positions[in_window]
        main_x = self.main_x(features[in_window])
        visible = block_visibility(ctx_positions.shape[0], B, ids.device)
        x = self.model.embed_tokens(ids).unsqueeze(1).expand(B, n, H).contiguous()
        pre = None  # V4.1's carried pre-mix: none before the first stage
        for stage in self.model.layers:
            # context K/V come from the target features, never from draft hidden states
            context_kv = stage.attn.latent_kv(main_x, ctx_positions)

            def attend(
                q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, ctx: torch.Tensor = context_kv
            ) -> torch.Tensor:
                return sink_attention(q, torch.cat((ctx, kv)), sink, visible)

            f, x, post, comb, pre = stage(x, positions, attend, pre)
            x = hc_post(f, x, post, comb)  # vLLM fuses it into the next hc_pre; the last one after the loop
        return hc_collapse(x, pre) if cfg.is_v41 else x.flatten(1)

    @torch.no_grad()
    def base_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """streams [B, n_hc*H] -> fp32 U [B, V] = lm_head(norm(hc_head(streams))); V4.1's collapsed
        [B, H] -> lm_head(norm(h)) (vLLM deepseek_v41/nvidia/dspark.py:339-341)."""
        cfg, m = self.config, self.model
        y = hidden_states
        if not cfg.is_v41:
            x = hidden_states.reshape(hidden_states.shape[0], cfg.hc_mult, cfg.hidden_size)
            y = hc_head(x, m.hc_head_fn, m.hc_head_scale, m.hc_head_base, cfg.rms_norm_eps, cfg.hc_eps)
        y = kernels.mtp_shared_head_rmsnorm(y, m.norm.weight, cfg.rms_norm_eps)
        return self.lm_head.forward_fp32(y)

    @torch.no_grad()
    def markov_decode(self, base_logits: torch.Tensor, anchor: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy, left to right from prev = anchor: L_k = U[k] + markov(prev), tok_k = argmax
        L_k, prev = tok_k. -> (L [B, V] fp32, tokens [B])."""
        prev = torch.as_tensor(anchor, device=base_logits.device)
        logits = torch.empty_like(base_logits)
        tokens = torch.empty(base_logits.shape[0], dtype=torch.long, device=base_logits.device)
        for k in range(base_logits.shape[0]):
            logits[k] = base_logits[k] + self.model.markov_head.bias(prev)
            prev = tokens[k] = logits[k].argmax()
        return logits, tokens

    @torch.no_grad()
    def confidence(self, hidden_states: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """V4.1: each drafted token's acceptance probability [B], given the token before each position
        (`prev` [B]: the anchor, then the draft tokens but the last); None for a drafter without the head."""
        m = self.model
        if not self.config.is_v41:
            return None
        return m.confidence_head(hidden_states, m.markov_head.markov_w1(prev))

    @torch.no_grad()
    def forward(
        self, features: torch.Tensor, context_positions: torch.Tensor, anchor: int | torch.Tensor
    ) -> DraftBlock:
        """Draft B tokens after the context (model/README.md#dspark-forward).

        features [T_ctx, T*H]: the target's h_l for l in dspark_target_layer_ids, concatenated
        (`target_features`); context_positions [T_ctx]; anchor: the last sampled token, at
        position context_positions[-1] + 1."""
        positions = self.block_positions(context_positions)
        return self.heads(self.hidden_states(features, context_positions, self.block_ids(anchor), positions), anchor)

    @torch.no_grad()
    def heads(self, hidden_states: torch.Tensor, anchor: int | torch.Tensor) -> DraftBlock:
        """The block from its hidden states: base logits, the greedy Markov chain from `anchor` and
        (V4.1) each drafted token's confidence, given the token the chain put before it."""
        base = self.base_logits(hidden_states)
        logits, tokens = self.markov_decode(base, anchor)
        prev = torch.cat((torch.as_tensor(anchor, device=tokens.device).view(1), tokens[:-1]))
        return DraftBlock(hidden_states, base, logits, tokens, self.confidence(hidden_states, prev))


def target_features(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """[h_l for l in dspark_target_layer_ids], each [T_ctx, H] -> [T_ctx, T*H] (main_proj's input)."""
    return torch.cat(per_layer, dim=-1)
