"""vLLM 0.33.0's DeepSeek V4.1 DSpark loaders (DSparkV41DraftModel: models/deepseek_v41/{nvidia,amd}/dspark.py,
registry.py:677-680) on a V4.1 draft directory, its quantised parameters built by vLLM's own V4.1
quant config and create_weights, every value compared with the native checkpoint's."""

from __future__ import annotations

import copy
import json
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import UsageError
from .cut import cut
from .recording import Recorder
from .serve_runs import Fill, ServeReport, _feed, _Named, _read, _recording, _same, filled_parameters
from .vllm_build import PLATFORMS, _compile_namespace, imports_from
from .vllm_build_cuts import IMPORTED_INSIDE
from .vllm_layer import Built, _build, _expert_map, _linear_specs, _moe_config
from .vllm_runs import stand_in_layer, vllm_namespace
from .wheels import Wheel

V41 = "vllm/models/deepseek_v41/"
Q = "vllm/model_executor/layers/quantization/"
# per loader: the platform, the loader's cuts (its class's load_weights and name mapping, and what they call)
V41_LOADERS: dict[str, dict[str, Any]] = {
    "vllm-nvidia-v41-dspark": {
        "platform": "nvidia",
        "cuts": {
            V41 + "nvidia/dspark.py": [
                "_EXPERT_SCALE_RE",
                "DSparkDeepseekV4ForCausalLM.load_weights",
                "DSparkDeepseekV4ForCausalLM._remap_dspark_name",
            ],
            V41 + "nvidia/model.py": [
                "DeepseekV4Model._pad_shared_expert_weight",
                "_linear_scale_param_name",
                "_use_sequence_parallel",
            ],
            "vllm/config/kernel.py": [
                "FLASHINFER_MOE_EP_CUTEDSL",
                "FLASHINFER_MOE_EP_DEEP_GEMM",
                "FLASHINFER_MOE_EP_BACKENDS",
                "NATIVE_MEGA_MOE_BACKENDS",
                "MEGA_MOE_BACKENDS",
            ],
            "vllm/model_executor/models/utils.py": ["extract_layer_index"],
        },
        # the sink's padded head count: FlashMLA's FP8 decode kernel takes 64 or 128 heads
        "attention": (V41 + "nvidia/flashmla.py", "DeepseekV4FlashMLAAttention"),
    },
    "vllm-amd-v41-dspark": {
        "platform": "amd",
        "cuts": {
            V41 + "amd/dspark.py": [
                "_EXPERT_SCALE_RE",
                "DSparkDeepseekV4ForCausalLM.load_weights",
                "DSparkDeepseekV4ForCausalLM.process_weights_after_loading",
                "DSparkDeepseekV4ForCausalLM._remap_dspark_name",
            ],
            V41 + "amd/model.py": [
                "DeepseekV4Model._pad_shared_expert_weight",
                "_linear_scale_param_name",
                "_use_sequence_parallel",
            ],
        },
        "attention": (V41 + "amd/rocm.py", "DeepseekV41ROCMAiterMLAAttention"),
    },
}
# V4.1's quant config and what its get_quant_method returns, added to vllm_build's namespace
V41_BUILD_CUTS: dict[str, list[str]] = {
    Q + "utils/mxfp8_utils.py": ["MXFP8_VALUE_DTYPE", "MXFP8_SCALE_DTYPE", "MXFP8_BLOCK_SIZE"],
    Q + "fp8.py": ["ACTIVATION_SCHEMES", "Fp8Config.__init__", "Fp8Config.from_config"],
    Q + "mxfp4.py": [
        "Mxfp4MoEMethod.__init__",
        "Mxfp4MoEMethod._encode_mxfp4_weight_scale",
        "Mxfp4MoEMethod.get_scale_weight_loader",
        "Mxfp4MoEMethod.create_weights",
    ],
    V41 + "quant_config.py": ["_DEEPSEEK_V4_EXPERT_DTYPES", "_EXPERTS_LAYER_RE", "DeepseekV4FP8Config"],
    "vllm/model_executor/model_loader/weight_utils.py": [
        "default_weight_loader",
        "load_attention_sink",
        "make_attention_sink",
    ],
    "vllm/transformers_utils/configs/deepseek_v41.py": ["DeepseekV41Config"],
}
V41_IMPORTED_INSIDE = [
    *IMPORTED_INSIDE,
    "vllm.config",
    "vllm.logger",
    "vllm.model_executor.layers.quantization.modelopt",
]
# a V4.1 linear's scale: one E8M0 byte per 32x32 block, each grid row repeated over the 32
# output rows it covers when loaded (KMxfp8Static.get_scale_weight_loader, modelopt.py:2316-2330)
SCALE_ROWS = 32
EXPERT_SCALE = re.compile(r"\.experts\.\d+\.w[123]\.scale$")


class _PreTrainedConfig:
    """transformers' PreTrainedConfig as DeepseekV41Config uses it: keyword arguments become attributes."""

    def __init__(self, **kwargs: Any) -> None:
        for k, v in kwargs.items():
            setattr(self, k, v)


def v41_namespace(wheel: Wheel, platform: str) -> dict[str, Any]:
    """vllm_build's namespace (compiled afresh: this run's vLLM config is the draft's) plus V41_BUILD_CUTS."""
    ns = _compile_namespace(wheel, platform)
    ns["PreTrainedConfig"] = _PreTrainedConfig
    scratch = dict(ns)  # QuantizationConfig was cut by members: its get_from_keys_or added to that class
    cut(
        wheel.source(Q + "base_config.py"),
        f"{wheel.path.name}/{Q}base_config.py",
        ["QuantizationConfig.get_from_keys_or"],
        scratch,
    )
    ns["QuantizationConfig"].get_from_keys_or = scratch["QuantizationConfig"].__dict__["get_from_keys_or"]
    scratch["QuantizationConfig"] = ns["QuantizationConfig"]  # the name its body calls get_from_keys on
    for member, names in V41_BUILD_CUTS.items():
        cut(wheel.source(member), f"{wheel.path.name}/{member}", names, ns)
    # mxfp4.py:487-523: the Kimi-K3 SiTU paths (a SiTU activation; V4.1's experts are SiLU)
    ns["_use_k3_situ_aiter"] = ns["_use_k3_situ_int4_gfx942"] = lambda _moe: False
    ns["select_deepseek_v4_mxfp4_moe_backend"] = lambda _moe: (None, None)
    # the vLLM config the cut-out code reads: the model's hf_config (the draft's, set per run) for the
    # quant config's expert dtype and MoE override (quant_config.py:66-108), one process for
    # _use_sequence_parallel (nvidia/model.py:261-271), the model dtype for ModelOptLinearMethod
    vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(dtype=torch.bfloat16, hf_config=None, hf_text_config=None),
        kernel_config=types.SimpleNamespace(linear_backend="auto", moe_backend="auto"),
        parallel_config=types.SimpleNamespace(
            pipeline_parallel_size=1, enable_expert_parallel=False, tensor_parallel_size=1, data_parallel_size=1
        ),
        lora_config=None,
        quant_config=None,
    )
    ns["get_current_vllm_config"] = ns["get_current_vllm_config_or_none"] = lambda: vllm_config
    ns["_vllm_config"] = vllm_config
    return ns


def flat_config(ns: dict[str, Any], config: dict[str, Any]) -> Any:
    """DRAFT's config.json as vLLM's DeepseekV41Config holds it: text_config flattened onto it, the
    vision fields from vision_config, expert_dtype from quantization_config (configs/deepseek_v41.py:20-62)."""
    return ns["DeepseekV41Config"](**copy.deepcopy(config))


@dataclass
class V41Report(ServeReport):
    # the count load_weights logs, "DSpark draft model loaded: %d params" (nvidia/dspark.py:487,
    # amd/dspark.py:516); -1: none (it raised)
    runtime_loaded: int = -1
    dropped: list[str] = field(default_factory=list)  # fed, and the runtime's draft has no place for it


def _plain(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, loader: Any, init: float | None = None
) -> tuple[str, Any]:
    p = torch.nn.Parameter(
        torch.empty(shape, dtype=dtype) if init is None else torch.full(shape, init, dtype=dtype), requires_grad=False
    )
    p.weight_loader = loader
    return name, p


def unquantised(ns: dict[str, Any], cfg: Any, spec: dict[str, Any], stages: int, experts: int) -> dict[str, Any]:
    """The draft's parameters outside its linear and expert modules, as the wheel's modules define
    them; each without a weight_loader of its own gets default_weight_loader, which load_weights
    uses for such a parameter (dspark.py:481). Per stage (model.layers.{s}): hc_* F32
    (nvidia/model.py:440-485, amd/model.py:232-275), attn_norm / ffn_norm / q_norm / kv_norm RMSNorm
    weights in the model dtype (layernorm.py:63-67), the attention sink F32 over the platform's
    padded heads, -inf past the checkpoint's (attention.py:367-369, weight_utils.py:1568-1592),
    the gate's e_score_correction_bias with topk_method noaux_tc and bias_vl with a vision tower,
    F32 [dspark experts] (deepseek_v4/nvidia/model.py:301-318, amd/model.py:644-656). Model level:
    main_norm and norm (nvidia/dspark.py:106, 137), the Markov head's markov_w1 (an nn.Embedding)
    and markov_w2 (a ParallelLMHead built without quant config, disable_tp: its loader copies the
    whole [draft_vocab, rank] weight, its padding rows to a multiple of 64 zero, none at vocab 512 or
    129280, vocab_parallel_embedding.py:481-520), qwen3_dspark.py:71-79."""
    default = ns["default_weight_loader"]
    padded = ns[spec["attention"][1]].get_padded_num_q_heads(cfg.num_attention_heads)
    h, bf16, f32 = cfg.hidden_size, torch.bfloat16, torch.float32
    mix, hc = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.hidden_size
    out = []
    for s in range(stages):
        p = f"model.layers.{s}."
        for k in ("attn", "ffn"):
            out += [_plain(f"{p}hc_{k}_fn", (mix, hc), f32, default), _plain(f"{p}hc_{k}_base", (mix,), f32, default)]
            out.append(_plain(f"{p}hc_{k}_scale", (3,), f32, default))
        for norm, width in (
            ("attn_norm", h),
            ("ffn_norm", h),
            ("attn.q_norm", cfg.q_lora_rank),
            ("attn.kv_norm", cfg.head_dim),
        ):
            out.append(_plain(f"{p}{norm}.weight", (width,), bf16, default))
        out.append(_plain(f"{p}attn.attn_sink", (padded,), f32, ns["load_attention_sink"], -float("inf")))
        if getattr(cfg, "topk_method", None) == "noaux_tc":
            out.append(_plain(f"{p}ffn.gate.e_score_correction_bias", (experts,), f32, default))
        if getattr(cfg, "vision_n_layers", 0) > 0:
            out.append(_plain(f"{p}ffn.gate.bias_vl", (experts,), f32, default))
    vocab, rank = cfg.vocab_size, cfg.dspark_markov_rank
    draft_vocab = getattr(cfg, "draft_vocab_size", None) or vocab
    out += [_plain("model.main_norm.weight", (h,), bf16, default), _plain("model.norm.weight", (h,), bf16, default)]
    out.append(_plain("model.markov_head.markov_w1.weight", (vocab, rank), bf16, default))
    out.append(_plain("model.markov_head.markov_w2.weight", (draft_vocab, rank), bf16, default))
    return dict(out)


def build_modules(ns: dict[str, Any], qc: Any, cfg: Any, platform: str, stages: int) -> list[Built]:
    """Every linear and expert module of the draft, built by the wheel's classes: each quantised one
    under V4.1's DeepseekV4FP8Config (its get_quant_method gives ModelOptLinearMethod(kMxfp8Static)
    for a linear and Mxfp4MoEMethod for the experts, quant_config.py:221-261). Per stage: V4's DSpark
    block, whose constructor arguments V4.1 repeats (attention.py:371-410; shared experts
    deepseek_v4/nvidia/model.py:320-333), with main_proj on stage 0 (nvidia/dspark.py:98-105,
    amd/dspark.py:92-99): vllm_layer._linear_specs for the xpu platform, the one without V4's
    context_wkv_proj and confidence head; the gate, a GateLinear (a ReplicatedLinear whose weight is
    ReplicatedLinear's: gate_linear.py:93-101) without quant config; the routed experts with the
    stage's dspark_n_routed_experts (nvidia/model.py:136-144, amd/model.py:98-116). Model level: the
    confidence head's proj, a ReplicatedLinear in F32 without quant config (qwen3_dspark.py:176-183)."""
    experts_cfg = types.SimpleNamespace(**vars(cfg))
    experts_cfg.n_routed_experts = getattr(cfg, "dspark_n_routed_experts", 0) or cfg.n_routed_experts
    experts_cfg.num_experts_per_tok = getattr(cfg, "dspark_num_experts_per_tok", 0) or cfg.num_experts_per_tok
    unquantised = {"bias": False, "return_bias": False, "quant_config": None}
    head = {"input_size": cfg.hidden_size + cfg.dspark_markov_rank, "output_size": 1, "params_dtype": torch.float32}
    name = "model.confidence_head.proj"
    specs = [(name, name, "ReplicatedLinear", {**head, **unquantised})]
    for s in range(stages):
        q = f"model.layers.{cfg.num_hidden_layers + s}"
        gate = {"input_size": cfg.hidden_size, "output_size": experts_cfg.n_routed_experts, **unquantised}
        specs += [
            *_linear_specs(cfg, "dspark", s, "xpu"),
            (f"model.layers.{s}.ffn.gate", f"{q}.ffn.gate", "ReplicatedLinear", gate),
        ]
    built = []
    with imports_from(ns, V41_IMPORTED_INSIDE):
        torch.set_default_dtype(torch.bfloat16)  # the model dtype, as vLLM sets it while building
        try:
            for path, prefix, cls, kwargs in specs:  # a spec's own quant_config (None) wins over qc
                make = lambda c=cls, k=kwargs, p=prefix: ns[c](**{"quant_config": qc, "prefix": p, **k})  # noqa: E731
                built.append(_build(path, prefix, "linear", make))
            for s in range(stages):
                q = f"model.layers.{cfg.num_hidden_layers + s}"
                built.append(_experts(ns, qc, experts_cfg, platform, f"model.layers.{s}", q))
        finally:
            torch.set_default_dtype(torch.float32)
    return built


def _experts(ns: dict[str, Any], qc: Any, cfg: Any, platform: str, path: str, prefix: str) -> Built:
    experts_cls = type("RoutedExperts", (ns["RoutedExperts"],), {"update_expert_map_info": lambda self: None})
    gate, down, up = PLATFORMS[platform]["ckpt"]
    moe = _moe_config(cfg)
    moe.max_capture_size = 0  # read by Mxfp4MoEMethod.__init__ only for its kernels (mxfp4.py:582)

    def make() -> Any:
        return experts_cls(
            f"{prefix}.ffn.experts",
            torch.bfloat16,
            moe,
            qc,
            _expert_map(),
            ckpt_gate_proj_name=gate,
            ckpt_down_proj_name=down,
            ckpt_up_proj_name=up,
            swiglu_limit=getattr(cfg, "swiglu_limit", None),
        )

    return _build(f"{path}.ffn.experts.routed_experts", f"{prefix}.ffn.experts", "experts", make)


def stage_count(cfg: Any) -> int:
    """The draft's layers: n_mtp_layers, else num_nextn_predict_layers, else 3 (nvidia/dspark.py:85-89,
    amd/dspark.py:79-83)."""
    return getattr(cfg, "n_mtp_layers", None) or getattr(cfg, "num_nextn_predict_layers", None) or 3


def v41_run(wheel: Wheel, loader: str, draft: Path, native: Path) -> V41Report:
    """vLLM's V4.1 `loader` (V41_LOADERS) on DRAFT: its parameters built as above, every DRAFT tensor
    through the wheel's load_weights into them, then each parameter's parts and value accounted."""
    spec = V41_LOADERS[loader]
    report = V41Report(loader)
    build_ns = v41_namespace(wheel, spec["platform"])
    file, cls = spec["attention"]
    cut(wheel.source(file), f"{wheel.path.name}/{file}", [f"{cls}.get_padded_num_q_heads"], build_ns)
    cfg = flat_config(build_ns, json.loads((draft / "config.json").read_text()))
    vllm_config = build_ns["_vllm_config"]
    vllm_config.model_config.hf_config = vllm_config.model_config.hf_text_config = cfg
    config_cls = build_ns["DeepseekV4FP8Config"]
    # the registry's deepseek_v4_fp8 on CUDA and ROCm is V4.1's class (quantization/__init__.py:120-131), which
    # claims a V4.1 config's fp8 quantization_config (quant_config.py:163-192); the draft's own dict is parsed
    # (models/utils.py:985-1007)
    if config_cls.override_quantization_method(cfg.quantization_config, None, cfg) != config_cls.get_name():
        raise UsageError(f"{draft}: quantization_config is no DeepSeek fp8 one vLLM's V4.1 class claims")
    with imports_from(build_ns, V41_IMPORTED_INSIDE):
        qc = config_cls.from_config(cfg.quantization_config)
    vllm_config.quant_config = qc
    stages = stage_count(cfg)
    experts = getattr(cfg, "dspark_n_routed_experts", 0) or cfg.n_routed_experts
    built = build_modules(build_ns, qc, cfg, spec["platform"], stages)
    report.methods = {b.prefix: b.method or b.error for b in built}
    report.errors += [f"{b.prefix}: {b.error}" for b in built if b.error]
    table = {n: p for b in built for n, p in b.params.items()} | unquantised(build_ns, cfg, spec, stages, experts)
    rec, fills = Recorder(), {}
    for name, param in table.items():
        _recording(param, name, fills, rec)
    model, counts = _model(wheel, spec, rec, table, cfg, qc, vllm_config, stages)
    with imports_from(build_ns, V41_IMPORTED_INSIDE):  # RoutedExperts.weight_loader imports inside
        fed = _feed(model, draft, rec, report, model.completeness)
    # the runtime's count where its load_weights ran through; one that raised would stop vLLM there
    report.runtime_loaded = counts[0] if counts and not report.errors else -1
    reached = {f.tensor for fs in fills.values() for f in fs}
    errored = {e.split(":", 1)[0] for e in report.errors}
    # a name outside mtp.* is the target's: _remap_dspark_name gives None for it (dspark.py:495-497)
    unreached = [t for t in fed if t not in reached and t not in errored]
    report.skipped = [t for t in unreached if t.startswith("mtp.")]
    report.dropped = [t for t in unreached if not t.startswith("mtp.")]
    _account(built, table, fills, _read(native, reached), experts, report)
    return report


def _model(
    wheel: Wheel,
    spec: dict[str, Any],
    rec: Recorder,
    table: dict[str, Any],
    cfg: Any,
    qc: Any,
    vllm_config: Any,
    stages: int,
) -> tuple[Any, list[int]]:
    """The cut-out class mixed with a stand-in holding what its load_weights reads: the attributes its
    __init__ sets (dspark.py:284-298), computed by the wheel's own functions where it calls one."""
    completeness = [True]
    ns = vllm_namespace(wheel, spec["cuts"], rec, completeness)
    ns["dict"] = lambda x=(), **k: x.table if isinstance(x, _Named) else dict(x, **k)
    counts: list[int] = []
    base = ns["DSparkDeepseekV4ForCausalLM"]

    class StandIn:
        def named_parameters(self) -> _Named:
            return _Named(table)

    def load_weights(self: Any, weights: Any) -> set[str]:
        loaded = base.load_weights(self, weights)
        counts.append(len(loaded))
        return loaded

    model = type("DSparkDeepseekV4ForCausalLM", (base, StandIn), {"load_weights": load_weights})()
    model.completeness = completeness
    model.config, model.quant_config = cfg, qc
    model.linear_scale_name = ns["_linear_scale_param_name"](vllm_config, getattr(cfg, "expert_dtype", "fp4"))
    block = getattr(qc, "weight_block_size", None)
    model.pad_shared_expert = block is not None and not ns["_use_sequence_parallel"](vllm_config)
    head = types.SimpleNamespace() if getattr(cfg, "enable_confidence_head", True) else None  # dspark.py:147-152
    model.model = types.SimpleNamespace(layers=[stand_in_layer() for _ in range(stages)], confidence_head=head)
    return model, counts


def native_value(fed: str, native: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
    """What a parameter part fed from `fed` holds when it equals the native checkpoint: a linear's
    E8M0 scale grid's bytes with each row repeated over its 32 output rows (SCALE_ROWS), an expert's
    E8M0 scale and e2m1 pairs as bytes (uint8 parameters, mxfp4.py:671-733), FP8 bytes, anything else
    the native tensor in the parameter's dtype (a BF16 confidence head in F32)."""
    t = native.get(fed)
    if t is None:
        return None
    if fed.endswith(".scale"):
        if t.dtype not in (torch.uint8, torch.float8_e8m0fnu):
            return None  # no byte of a uint8 scale parameter is an F32 scale
        t = t.view(torch.uint8)
        return t if EXPERT_SCALE.search(fed) else t.repeat_interleave(SCALE_ROWS, dim=0)
    if dtype == torch.uint8 and t.dtype == torch.int8:
        return t.view(torch.uint8)
    return t.to(dtype)


def expected_value(name: str, param: Any, fills: list[Fill], native: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The parameter as the native values would fill it at TP 1: shards stacked in id order along dim 0,
    experts by id with w13 = w1 then w3, the attention sink padded with -inf (weight_utils.py:1581)."""
    values = {(f.shard, f.expert): native_value(f.tensor, native, param.data.dtype) for f in fills}
    if any(v is None for v in values.values()):
        return None
    if any(f.expert is not None for f in fills):
        out = param.data.clone()
        for e in sorted({f.expert for f in fills}):
            out[e] = torch.cat([values[(s, e)] for s in ("w1", "w3", "w2") if (s, e) in values])
        return out
    out = torch.cat([values[k] for k in sorted(values, key=lambda k: -1 if k[0] is None else k[0])])
    if name.endswith(".attn_sink"):
        out = torch.cat([out, torch.full((param.numel() - out.numel(),), -float("inf"), dtype=out.dtype)])
    return out


def _account(
    built: list[Built],
    table: dict[str, Any],
    fills: dict[str, list[Fill]],
    native: dict[str, torch.Tensor],
    n_experts: int,
    report: V41Report,
) -> None:
    for name, param in filled_parameters(built, table, fills, n_experts, report):
        try:
            expected = expected_value(name, param, fills[name], native)
            exact = expected is not None and _same(expected.reshape(param.data.shape), param.data)
        except RuntimeError:  # the native values do not even have the parameter's shape
            exact = False
        if not exact:
            report.inexact.append(name)
