"""The quantised modules of vLLM's V4 MTP and DSpark draft layers, built with the wheel's own linear and
RoutedExperts classes (cut out by vllm_build) under the target's quant config: their
parameters are what DeepSeekV4MTP.load_weights fills."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch

from .vllm_build import PLATFORMS, TransformOnDraft, imports_from


@dataclass
class Built:
    """One quantised module: where it sits in the module tree, the name the quant config
    saw, the method vLLM chose, and its parameters (or why it could not be built)."""

    path: str
    prefix: str
    kind: str  # linear | experts
    method: str
    params: dict[str, torch.nn.Parameter]
    error: str = ""
    shards: tuple[Any, ...] = (None,)  # a fused linear's shard ids, as load_weights passes them


def _linear_specs(cfg: Any, layout: str, index: int, platform: str) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(module path, quant prefix, class, constructor arguments) of draft layer `index` as
    the wheel builds them. MTP (layer N+i): e_proj/h_proj, nvidia/mtp.py:103-118
    (xpu/mtp.py:84-99, amd/mtp.py:83-98); the block is built with the bare layer prefix
    (nvidia/mtp.py:139-144) under the module mtp_block. DSpark (stage i): main_proj on
    stage 0's call, xpu/dspark.py:66-73; the block is the module layers.{i} built with the
    prefix layers.{N+i} (xpu/dspark.py:77-84). The block: attention.py:252-287; shared
    experts nvidia/model.py:153-168, 323-333, unpadded (a compressed-tensors config has no
    weight_block_size, nvidia/model.py:148-152). NVIDIA's DSpark adds, on stage 0's call,
    context_wkv_proj (every stage's wkv stacked, nvidia/dspark.py:142-150); NVIDIA's and AMD's
    the confidence head, built without the quant config (nvidia/dspark.py:176-180,
    amd/dspark.py:126-131; qwen3_dspark.py:176-183: F32)."""
    head_dim, n_heads, groups = cfg.head_dim, cfg.num_attention_heads, cfg.o_groups
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    h = cfg.hidden_size
    plain = {"bias": False, "return_bias": False}
    if layout == "mtp":
        q = f"model.layers.{index}"
        block = f"{q}.mtp_block"
        top = [
            (f"{q}.{m}", f"{q}.{m}", "ReplicatedLinear", {"input_size": h, "output_size": h, **plain})
            for m in ("e_proj", "h_proj")
        ]
    else:
        q, block = f"model.layers.{cfg.num_hidden_layers + index}", f"model.layers.{index}"
        width = h * len(cfg.dspark_target_layer_ids)
        top = (
            [
                (
                    "model.main_proj",
                    "model.main_proj",
                    "ReplicatedLinear",
                    {"input_size": width, "output_size": h, **plain},
                )
            ]
            if index == 0
            else []
        )
        if index == 0:
            top += _dspark_heads(cfg, platform)
    return [
        *top,
        (
            f"{block}.attn.fused_wqa_wkv",
            f"{q}.attn.fused_wqa_wkv",
            "MergedColumnParallelLinear",
            {"input_size": h, "output_sizes": [cfg.q_lora_rank, head_dim], "bias": False, "disable_tp": True},
        ),
        (
            f"{block}.attn.wq_b",
            f"{q}.attn.wq_b",
            "ColumnParallelLinear",
            {"input_size": cfg.q_lora_rank, "output_size": n_heads * head_dim, **plain},
        ),
        (
            f"{block}.attn.wo_a",
            f"{q}.attn.wo_a",
            "ColumnParallelLinear",
            {"input_size": n_heads * head_dim // groups, "output_size": groups * cfg.o_lora_rank, **plain},
        ),
        (
            f"{block}.attn.wo_b",
            f"{q}.attn.wo_b",
            "RowParallelLinear",
            {"input_size": groups * cfg.o_lora_rank, "output_size": h, **plain},
        ),
        (
            f"{block}.ffn.shared_experts.gate_up_proj",
            f"{q}.ffn.shared_experts.gate_up_proj",
            "MergedColumnParallelLinear",
            {"input_size": h, "output_sizes": [shared] * 2, "bias": False},
        ),
        (
            f"{block}.ffn.shared_experts.down_proj",
            f"{q}.ffn.shared_experts.down_proj",
            "RowParallelLinear",
            {"input_size": shared, "output_size": h, "bias": False},
        ),
    ]


def _dspark_heads(cfg: Any, platform: str) -> list[tuple[str, str, str, dict[str, Any]]]:
    h, plain = cfg.hidden_size, {"bias": False, "return_bias": False}
    out = []
    if platform == "nvidia":
        stages = getattr(cfg, "n_mtp_layers", None) or 3  # nvidia/dspark.py:106
        kwargs = {"input_size": h, "output_sizes": [cfg.head_dim] * stages, **plain, "disable_tp": True}
        out.append(("model.context_wkv_proj", "model.context_wkv_proj", "MergedColumnParallelLinear", kwargs))
    if platform != "xpu" and getattr(cfg, "enable_confidence_head", True):
        kwargs = {"input_size": h + cfg.dspark_markov_rank, "output_size": 1, **plain, "params_dtype": torch.float32}
        name = "model.confidence_head.proj"
        out.append((name, name, "ReplicatedLinear", {**kwargs, "quant_config": None}))
    return out


def _moe_config(cfg: Any) -> Any:
    """FusedMoEConfig's fields RoutedExperts and the MoE methods read, at one process (TP 1,
    EP 1, no EPLB, no padding; gated SiLU: is_act_and_mul, nvidia/model.py:169-176)."""
    inter = cfg.moe_intermediate_size
    return types.SimpleNamespace(
        is_act_and_mul=True,
        activation=types.SimpleNamespace(value="silu"),
        hidden_dim=cfg.hidden_size,
        hidden_dim_unpadded=cfg.hidden_size,
        num_experts=cfg.n_routed_experts,
        num_local_experts=cfg.n_routed_experts,
        num_logical_experts=cfg.n_routed_experts,
        experts_per_token=cfg.num_experts_per_tok,
        intermediate_size=inter,
        intermediate_size_per_partition=inter,
        intermediate_size_per_partition_unpadded=inter,
        in_dtype=torch.bfloat16,
        rocm_aiter_fmoe_enabled=False,
        moe_parallel_config=types.SimpleNamespace(enable_eplb=False, tp_size=1),
        tp_shard_with_padding=False,
        tp_size=1,
        tp_rank=0,
        w13_num_shards=2,
        has_bias=False,
        moe_backend="auto",
        shared_expert_prefix=None,
        device=torch.device("cpu"),
    )


def _expert_map() -> Any:
    # one process holds every expert: global id = local id
    return types.SimpleNamespace(map_global_to_local=lambda e: e, num_fused_shared_experts=0)


def build_layer(ns: dict[str, Any], qc: Any, cfg: Any, layout: str, index: int, platform: str) -> list[Built]:
    """Every quantised module of draft layer `index` (MTP: N+i; DSpark: stage i) under
    quant config `qc`: each built by the wheel's class (its __init__ asks qc for the
    method and runs create_weights)."""
    built = []
    with imports_from(ns):
        torch.set_default_dtype(torch.bfloat16)  # the model dtype, as vLLM sets it while building
        try:
            specs = _linear_specs(cfg, layout, index, platform)
            for path, prefix, cls, kwargs in specs:
                # a spec's own quant_config (None: built without one) wins over qc
                make = lambda c=cls, k=kwargs, p=prefix: ns[c](**{"quant_config": qc, "prefix": p, **k})  # noqa: E731
                built.append(_build(path, prefix, "linear", make))
            experts_cls = type("RoutedExperts", (ns["RoutedExperts"],), {"update_expert_map_info": lambda self: None})
            gate, down, up = PLATFORMS[platform]["ckpt"]
            block_path, block_prefix = specs[-1][0].rsplit(".ffn.", 1)[0], specs[-1][1].rsplit(".ffn.", 1)[0]
            prefix = f"{block_prefix}.ffn.experts"

            def experts() -> Any:
                return experts_cls(
                    prefix,
                    torch.bfloat16,
                    _moe_config(cfg),
                    qc,
                    _expert_map(),
                    ckpt_gate_proj_name=gate,
                    ckpt_down_proj_name=down,
                    ckpt_up_proj_name=up,
                    swiglu_limit=getattr(cfg, "swiglu_limit", None),
                )

            built.append(_build(f"{block_path}.ffn.experts.routed_experts", prefix, "experts", experts))
        finally:
            torch.set_default_dtype(torch.float32)
    return built


def _build(path: str, prefix: str, kind: str, make: Any) -> Built:
    try:
        module = make()
    except (TransformOnDraft, ValueError, NotImplementedError, RuntimeError, AssertionError, KeyError) as exc:
        return Built(path, prefix, kind, "", {}, f"{type(exc).__name__}: {exc}")
    method = type(getattr(module, "scheme", None) or module.quant_method).__name__
    params = {f"{path}.{n}": p for n, p in module.named_parameters(recurse=False)}
    shards = tuple(range(len(module.output_sizes))) if hasattr(module, "output_sizes") else (None,)
    return Built(path, prefix, kind, method, params, shards=shards)
