"""mapping/README.md#mtp-parameters, transcribed once for the tests: the 41 parameters of the XPU MTP
layout. Tests compare the model (the project's authority on the layout) and the planner
against this independent reading of the spec."""

from __future__ import annotations

from dsv4.model.config import ModelConfig


def spec_layout(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    H, V, n, E, I = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult, cfg.n_routed_experts, cfg.moe_intermediate_size
    D, nh, rq, g, ro = cfg.head_dim, cfg.num_attention_heads, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    instruct = cfg.expert_dtype == "fp4"
    s = "F8_E8M0" if instruct else "F32"  # FP8 linears' weight_scale_inv (mapping/README.md#scale-dtypes)
    L = f"model.layers.{cfg.num_hidden_layers}."
    B = L + "mtp_block."
    out = {
        "model.embed_tokens.weight": ("BF16", (V, H)),
        L + "shared_head.head.weight": ("BF16", (V, H)),
        L + "shared_head.norm.weight": ("BF16", (H,)),
        L + "enorm.weight": ("BF16", (H,)),
        L + "hnorm.weight": ("BF16", (H,)),
        L + "e_proj.weight": ("F8_E4M3", (H, H)),
        L + "e_proj.weight_scale_inv": (s, (H // 128, H // 128)),
        L + "h_proj.weight": ("F8_E4M3", (H, H)),
        L + "h_proj.weight_scale_inv": (s, (H // 128, H // 128)),
        L + "hc_head_fn": ("F32", (n, n * H)),
        L + "hc_head_base": ("F32", (n,)),
        L + "hc_head_scale": ("F32", (1,)),
        B + "hc_attn_fn": ("F32", (24, n * H)),
        B + "hc_attn_base": ("F32", (24,)),
        B + "hc_attn_scale": ("F32", (3,)),
        B + "hc_ffn_fn": ("F32", (24, n * H)),
        B + "hc_ffn_base": ("F32", (24,)),
        B + "hc_ffn_scale": ("F32", (3,)),
        B + "attn_norm.weight": ("BF16", (H,)),
        B + "ffn_norm.weight": ("BF16", (H,)),
        B + "attn.attn_sink": ("F32", (nh,)),
        B + "attn.fused_wqa_wkv.weight": ("F8_E4M3", (rq + D, H)),
        B + "attn.fused_wqa_wkv.weight_scale_inv": (s, (rq // 128 + D // 128, H // 128)),
        B + "attn.q_norm.weight": ("BF16", (rq,)),
        B + "attn.kv_norm.weight": ("BF16", (D,)),
        B + "attn.wq_b.weight": ("F8_E4M3", (nh * D, rq)),
        B + "attn.wq_b.weight_scale_inv": (s, (nh * D // 128, rq // 128)),
        B + "attn.wo_a.weight": ("F8_E4M3", (g * ro, nh * D // g)),
        B + "attn.wo_a.weight_scale_inv": (s, (g * ro // 128, nh * D // g // 128)),
        B + "attn.wo_b.weight": ("F8_E4M3", (H, g * ro)),
        B + "attn.wo_b.weight_scale_inv": (s, (H // 128, g * ro // 128)),
        B + "ffn.gate.weight": ("BF16", (E, H)),
        B + "ffn.gate.e_score_correction_bias": ("F32", (E,)),
        B + "ffn.shared_experts.gate_up_proj.weight": ("F8_E4M3", (2 * I, H)),
        B + "ffn.shared_experts.gate_up_proj.weight_scale_inv": (s, (2 * I // 128, H // 128)),
        B + "ffn.shared_experts.down_proj.weight": ("F8_E4M3", (H, I)),
        B + "ffn.shared_experts.down_proj.weight_scale_inv": (s, (H // 128, I // 128)),
    }
    R = B + "ffn.experts.routed_experts."
    if instruct:
        out[R + "w13_weight"] = ("U8", (E, 2 * I, H // 2))
        out[R + "w13_weight_scale"] = ("U8", (E, 2 * I, H // 32))
        out[R + "w2_weight"] = ("U8", (E, H, I // 2))
        out[R + "w2_weight_scale"] = ("U8", (E, H, I // 32))
    else:
        out[R + "w13_weight"] = ("F8_E4M3", (E, 2 * I, H))
        out[R + "w13_weight_scale_inv"] = ("F32", (E, 2 * I // 128, H // 128))
        out[R + "w2_weight"] = ("F8_E4M3", (E, H, I))
        out[R + "w2_weight_scale_inv"] = ("F32", (E, H // 128, I // 128))
    return out
