"""The native DeepSeek V4 checkpoint format (mapping/README.md#native-checkpoint-format, and
mapping/README.md#dspark-source-checkpoint for the DSpark drafter of V4-Flash-0731): every
tensor's name, dtype and shape.

This is the one place the source format is written down. The synthetic checkpoint writer
produces exactly this layout, the planner checks a real checkpoint's draft tensors (MTP
blocks or DSpark stages) against it, and `--reverse` uses it to split fused tensors back
into their native parts.
"""

from __future__ import annotations

from dsv4.model.config import CONFIG, ModelConfig
from dsv4.model.storage import DENSE_LINEAR, ExpertStorage, storage_of

# name -> (safetensors dtype, shape)
Layout = dict[str, tuple[str, tuple[int, ...]]]


def expert_storage(cfg: ModelConfig) -> ExpertStorage:
    """How `cfg`'s routed experts are stored (model/storage.py); an unknown expert_dtype is refused."""
    return storage_of(cfg.expert_dtype, CONFIG)


def variant_of(cfg: ModelConfig) -> str:
    """The release kind whose expert storage `cfg` names: "instruct" (FP4 experts), "base" ("FP8 mixed")."""
    return expert_storage(cfg).release


def _fp8_linear(out: Layout, name: str, rows: int, cols: int, cfg: ModelConfig, scale_dtype: str) -> None:
    out[f"{name}.weight"] = (DENSE_LINEAR.weight_dtype, (rows, cols))
    out[f"{name}.scale"] = (scale_dtype, DENSE_LINEAR.scale_shape(rows, cols, cfg.weight_block_size))


def _expert_linear(out: Layout, name: str, rows: int, cols: int, cfg: ModelConfig) -> None:
    storage = expert_storage(cfg)
    out[f"{name}.weight"] = (storage.weight_dtype, storage.weight_shape(rows, cols))
    out[f"{name}.scale"] = (storage.scale_dtype, storage.scale_shape(rows, cols, cfg.weight_block_size))


def fp8_scale_dtype(cfg: ModelConfig) -> str:
    """The dense FP8 linears' scale dtype: E8M0 bytes beside FP4 experts (instruct), F32 values beside FP8 ones."""
    return expert_storage(cfg).linear_scale_dtype


def block_layout(cfg: ModelConfig, prefix: str, experts: int | None = None) -> Layout:
    """Tensors every decoder block has (main layer or MTP), names relative to `prefix`; its MoE
    has `experts` routed experts (default: the main model's n_routed_experts)."""
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, experts or cfg.n_routed_experts
    D, nh, rq = cfg.head_dim, cfg.num_attention_heads, cfg.q_lora_rank
    g, ro = cfg.o_groups, cfg.o_lora_rank
    sdt = fp8_scale_dtype(cfg)
    out: Layout = {}
    for sub in ("attn", "ffn"):
        out[f"{prefix}hc_{sub}_fn"] = ("F32", (cfg.hc_mix, cfg.hc_dim))
        out[f"{prefix}hc_{sub}_base"] = ("F32", (cfg.hc_mix,))
        out[f"{prefix}hc_{sub}_scale"] = ("F32", (3,))
    out[f"{prefix}attn_norm.weight"] = ("BF16", (H,))
    out[f"{prefix}ffn_norm.weight"] = ("BF16", (H,))
    out[f"{prefix}attn.attn_sink"] = ("F32", (nh,))
    _fp8_linear(out, f"{prefix}attn.wq_a", rq, H, cfg, sdt)
    out[f"{prefix}attn.q_norm.weight"] = ("BF16", (rq,))
    _fp8_linear(out, f"{prefix}attn.wq_b", nh * D, rq, cfg, sdt)
    _fp8_linear(out, f"{prefix}attn.wkv", D, H, cfg, sdt)
    out[f"{prefix}attn.kv_norm.weight"] = ("BF16", (D,))
    _fp8_linear(out, f"{prefix}attn.wo_a", g * ro, nh * D // g, cfg, sdt)
    _fp8_linear(out, f"{prefix}attn.wo_b", H, g * ro, cfg, sdt)
    out[f"{prefix}ffn.gate.weight"] = ("BF16", (E, H))
    for e in range(E):
        for w, (rows, cols) in (("w1", (I, H)), ("w2", (H, I)), ("w3", (I, H))):
            name = f"{prefix}ffn.experts.{e}.{w}"
            _expert_linear(out, name, rows, cols, cfg)
    _fp8_linear(out, f"{prefix}ffn.shared_experts.w1", I, H, cfg, sdt)
    _fp8_linear(out, f"{prefix}ffn.shared_experts.w2", H, I, cfg, sdt)
    _fp8_linear(out, f"{prefix}ffn.shared_experts.w3", I, H, cfg, sdt)
    return out


def mtp_layout(cfg: ModelConfig, i: int, *, with_emb_head: bool = False) -> Layout:
    """All tensors of MTP block `mtp.{i}.` (39 + 6E). Base checkpoints may add emb/head."""
    H = cfg.hidden_size
    p = f"mtp.{i}."
    out: Layout = {
        f"{p}enorm.weight": ("BF16", (H,)),
        f"{p}hnorm.weight": ("BF16", (H,)),
        f"{p}norm.weight": ("BF16", (H,)),
    }
    _fp8_linear(out, f"{p}e_proj", H, H, cfg, fp8_scale_dtype(cfg))
    _fp8_linear(out, f"{p}h_proj", H, H, cfg, fp8_scale_dtype(cfg))
    out[f"{p}hc_head_fn"] = ("F32", (cfg.hc_mult, cfg.hc_dim))
    out[f"{p}hc_head_base"] = ("F32", (cfg.hc_mult,))
    out[f"{p}hc_head_scale"] = ("F32", (1,))
    out.update(block_layout(cfg, p))
    out[f"{p}ffn.gate.bias"] = ("F32", (cfg.n_routed_experts,))
    if with_emb_head:
        out[f"{p}emb.tok_emb.weight"] = ("BF16", (cfg.vocab_size, H))
        out[f"{p}head.weight"] = ("BF16", (cfg.vocab_size, H))
    return out


def dspark_stage_layout(cfg: ModelConfig, s: int) -> Layout:
    """All tensors of DSpark stage `mtp.{s}.` (mapping/README.md#dspark-source-checkpoint): one V4 block (29 + 6E,
    E = cfg.draft_routed_experts) plus, in stage 0, the projection of the target features (main_proj,
    main_norm) and, in the last stage S-1, the head (norm, and hc_head_* but in V4.1) and the Markov and
    confidence heads. V4.1 names its Markov factors markov_head.embed/head (vLLM
    deepseek_v41/nvidia/dspark.py:502-511 maps them to markov_w1/w2) and has no hc_head (:132-136)."""
    H, V, R, E = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank, cfg.draft_routed_experts
    T = len(cfg.dspark_target_layer_ids)
    p = f"mtp.{s}."
    out = block_layout(cfg, p, E)
    out[f"{p}ffn.gate.bias"] = ("F32", (E,))
    out.update(_vision_bias(cfg, p, E))
    if s == 0:
        _fp8_linear(out, f"{p}main_proj", H, T * H, cfg, fp8_scale_dtype(cfg))
        out[f"{p}main_norm.weight"] = ("BF16", (H,))
    if s == cfg.dspark_stages - 1:
        out[f"{p}norm.weight"] = ("BF16", (H,))
        if not cfg.is_v41:
            out[f"{p}hc_head_fn"] = ("F32", (cfg.hc_mult, cfg.hc_dim))
            out[f"{p}hc_head_base"] = ("F32", (cfg.hc_mult,))
            out[f"{p}hc_head_scale"] = ("F32", (1,))
        for factor in ("embed", "head") if cfg.is_v41 else ("markov_w1", "markov_w2"):
            out[f"{p}markov_head.{factor}.weight"] = ("BF16", (V, R))
        out[f"{p}confidence_head.proj.weight"] = ("BF16", (1, H + R))
    return out


def _vision_bias(cfg: ModelConfig, prefix: str, experts: int) -> Layout:
    """A router's bias for image tokens, in every MoE of a model with a vision tower (vLLM
    deepseek_v4/nvidia/model.py:311-318 creates it F32 [n_routed_experts of that MoE], hash layers
    included)."""
    return {f"{prefix}ffn.gate.bias_vl": ("F32", (experts,))} if cfg.vision_n_layers > 0 else {}


def vision_layout(cfg: ModelConfig) -> Layout:
    """The main model's vision tensors, one under each prefix the release has (vision.* the
    encoder, aligner.* its projection into the text model, image_* the image embeddings). No
    draft reads them and no layout of this tool holds them, so these names and shapes only stand
    for the release's in synthetic checkpoints (every table skips the whole prefix)."""
    if cfg.vision_n_layers == 0:
        return {}
    H = cfg.hidden_size
    return {
        "vision.patch_embed.weight": ("BF16", (H, H)),
        "aligner.proj.weight": ("BF16", (H, H)),
        "image_newline": ("BF16", (H,)),
    }


def draft_layout(cfg: ModelConfig, *, with_emb_head: bool = False) -> Layout:
    """Every native tensor a draft is made of: the top-level ones and each MTP block, or
    each DSpark stage for a DSpark config (`with_emb_head`: Base's optional MTP emb/head)."""
    layout = top_level_layout(cfg)
    if cfg.is_dspark:
        for s in range(cfg.dspark_stages):
            layout.update(dspark_stage_layout(cfg, s))
    else:
        for i in range(cfg.num_nextn_predict_layers):
            layout.update(mtp_layout(cfg, i, with_emb_head=with_emb_head))
    return layout


SHARED = ("embed.weight", "head.weight")  # the top-level tensors a draft shares with the main model


def standalone_draft_layout(cfg: ModelConfig) -> Layout:
    """A standalone draft directory (`--target draft`): every MTP block or DSpark stage
    under its native name, plus the shared embed.weight and head.weight (a runtime takes the
    target's; the bundled model and `--target xpu` need them). No main-model tensor and no
    Base MTP emb/head (copies of the top-level two)."""
    top = top_level_layout(cfg)
    layout = {name: top[name] for name in SHARED}
    layout.update((k, v) for k, v in draft_layout(cfg).items() if k not in top)
    return layout


def top_level_layout(cfg: ModelConfig) -> Layout:
    """The main model's tensors outside its layers; V4.1's has no learned hc_head (vLLM
    deepseek_v41/nvidia/model.py:1146 collapses the copies with the last layer's pre-mix)."""
    V, H = cfg.vocab_size, cfg.hidden_size
    out: Layout = {"embed.weight": ("BF16", (V, H)), "head.weight": ("BF16", (V, H)), "norm.weight": ("BF16", (H,))}
    if not cfg.is_v41:
        out["hc_head_fn"] = ("F32", (cfg.hc_mult, cfg.hc_dim))
        out["hc_head_base"] = ("F32", (cfg.hc_mult,))
        out["hc_head_scale"] = ("F32", (1,))
    return out


def main_layer_layout(cfg: ModelConfig, j: int) -> Layout:
    """Main decoder layer `layers.{j}.`: the block plus hash routing or score bias, plus the
    compressor/indexer its compress ratio calls for."""
    H, D, rq = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
    Di, nih = cfg.index_head_dim, cfg.index_n_heads
    p = f"layers.{j}."
    out = block_layout(cfg, p)
    out.update(_vision_bias(cfg, p, cfg.n_routed_experts))
    if j < cfg.num_hash_layers:
        out[f"{p}ffn.gate.tid2eid"] = ("I64", (cfg.vocab_size, cfg.num_experts_per_tok))
    else:
        out[f"{p}ffn.gate.bias"] = ("F32", (cfg.n_routed_experts,))
    ratio = cfg.compress_ratios[j] if j < len(cfg.compress_ratios) else 0
    if ratio:
        # overlapping windows (ratio 4) compress twice the width
        width = 2 * D if ratio == 4 else D
        c = f"{p}attn.compressor."
        out[f"{c}ape"] = ("F32", (ratio, width))
        out[f"{c}wkv.weight"] = ("BF16", (width, H))
        out[f"{c}wgate.weight"] = ("BF16", (width, H))
        out[f"{c}norm.weight"] = ("BF16", (D,))
    if ratio == 4:
        x = f"{p}attn.indexer."
        _fp8_linear(out, f"{x}wq_b", nih * Di, rq, cfg, fp8_scale_dtype(cfg))
        out[f"{x}weights_proj.weight"] = ("BF16", (nih, H))
        out[f"{x}compressor.ape"] = ("F32", (4, 2 * Di))
        out[f"{x}compressor.wkv.weight"] = ("BF16", (2 * Di, H))
        out[f"{x}compressor.wgate.weight"] = ("BF16", (2 * Di, H))
        out[f"{x}compressor.norm.weight"] = ("BF16", (Di,))
    return out
