"""DeepSeek V4 model configuration: the config.json fields the MTP draft depends on, and the
one validating loader every reader of a config.json goes through.

A ModelConfig is valid by construction (`__post_init__` checks every field): each field has
its JSON type (a bool is not an integer, "256" is not a number), its sign, a range with an
upper bound far above the released models (mapping/README.md#config-fields; model/presets.py holds Flash and
Pro verbatim) and its relations to other fields. A value out of range, of the wrong type or
contradicting another field is malformed (malformed_config, exit 18); a well-formed
value this tool has no layout for (another routing, expert storage or model type) is
unsupported (unsupported_layout, 35). Each is one line headed by the file the fields
came from (`where`: the checkpoint reader, model/checkpoint.py, passes the path) and keeps
the field in `field`.
"""

from __future__ import annotations

from dataclasses import MISSING, InitVar, dataclass, fields
from typing import Any

from huggingface_hub.constants import CONFIG_NAME

from dsv4.model.config_fields import (
    check_int,
    check_int_list,
    check_positive_float,
    describe,
    malformed,
    require_object,
    unsupported,
)
from dsv4.model.config_v41 import V41_MODEL_TYPE, check_v41, flatten_v41
from dsv4.model.storage import storage_of
from dsv4.model.strictjson import StrictJSONError, loads

# Upper bounds, each far above the released values (Flash / Pro in brackets): they refuse
# a config that would make the tool allocate or loop without bound, never a real model.
MAX_HIDDEN = 1 << 16  # hidden_size [4096 / 7168]
MAX_LAYERS = 1024  # num_hidden_layers [43 / 61]
MAX_NEXTN_LAYERS = 16  # num_nextn_predict_layers [1 / 1]
MAX_VOCAB = 1 << 24  # vocab_size [129280]
MAX_HEADS = 1024  # num_attention_heads [64 / 128], index_n_heads [64]
MAX_HEAD_DIM = 1 << 13  # head_dim [512], index_head_dim [128]
MAX_RANK = 1 << 16  # q_lora_rank [1024 / 1536], o_lora_rank [1024], moe_intermediate_size [2048 / 3072]
MAX_WINDOW = 1 << 20  # sliding_window [128] (the release's max_position_embeddings)
MAX_HC_MULT = 64  # hc_mult [4]
MAX_SINKHORN_ITERS = 1000  # hc_sinkhorn_iters [20]
MAX_EXPERTS = 1 << 12  # n_routed_experts [256 / 384]
MAX_COMPRESS_RATIO = 1 << 16  # compress_ratios entries [0, 4, 128]
MAX_BLOCK = 1 << 16  # quantization_config.weight_block_size entries [128, 128]
MAX_DSPARK_BLOCK = 1 << 10  # dspark_block_size [5]: query tokens of one draft block
MAX_DSPARK_STAGES = MAX_NEXTN_LAYERS  # len(dspark_target_layer_ids) [3], n_mtp_layers [absent]

# The DSpark drafter's fields (mapping/README.md#dspark-source-checkpoint): all four or none
DSPARK_FIELDS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")

SUPPORTED_MODEL_TYPE = "deepseek_v4"
SUPPORTED_MODEL_TYPES = (SUPPORTED_MODEL_TYPE, V41_MODEL_TYPE)  # V4 and V4.1 (model/config_v41.py)
CONFIG = CONFIG_NAME  # the config file's name, everywhere; what a refusal names without a path (a preset)


def _check_model_type(where: str, model_type: Any) -> None:
    if type(model_type) is not str:
        raise malformed(where, "model_type", f"model_type is {describe(model_type)}; expected a string")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise unsupported(
            where,
            "model_type",
            f"model_type {model_type!r}; this tool converts {' and '.join(map(repr, SUPPORTED_MODEL_TYPES))} "
            "checkpoints only",
        )


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_nextn_predict_layers: int
    vocab_size: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    rope_theta: float
    norm_topk_prob: bool = True
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    expert_dtype: str = "fp4"  # absent (or null) in Flash's first revision: absent means fp4
    num_hash_layers: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    compress_ratios: tuple[int, ...] = ()
    weight_block_size: tuple[int, int] = (128, 128)
    model_type: str = SUPPORTED_MODEL_TYPE
    # DSpark-0731 (mapping/README.md#dspark-source-checkpoint); None = absent (an MTP checkpoint)
    dspark_block_size: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] | None = None
    dspark_markov_rank: int | None = None
    n_mtp_layers: int | None = None  # vLLM's stage count (absent in 0731): must equal dspark_stages
    vision_n_layers: int = 0  # > 0: Vision-Exp's tower, and a gate.bias_vl per router (model/native.py)
    # DeepSeek V4.1's stages (model/config_v41.py): their routed experts and top-k; 0 = the main model's
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    where: InitVar[str] = CONFIG  # the file the fields come from: it heads every refusal

    def __post_init__(self, where: str) -> None:
        _check_model_type(where, self.model_type)  # first: another model's fields are not ours to judge
        self._check_ranges(where)
        self._check_dspark(where)
        self._check_relations(where)
        self._check_supported(where)
        check_v41(self, where)

    def _check_ranges(self, where: str) -> None:
        for field, high in (
            ("hidden_size", MAX_HIDDEN),
            ("num_hidden_layers", MAX_LAYERS),
            ("vocab_size", MAX_VOCAB),
            ("num_attention_heads", MAX_HEADS),
            ("head_dim", MAX_HEAD_DIM),
            ("qk_rope_head_dim", MAX_HEAD_DIM),
            ("q_lora_rank", MAX_RANK),
            ("o_groups", MAX_HEADS),
            ("o_lora_rank", MAX_RANK),
            ("sliding_window", MAX_WINDOW),
            ("hc_mult", MAX_HC_MULT),
            ("hc_sinkhorn_iters", MAX_SINKHORN_ITERS),
            ("n_routed_experts", MAX_EXPERTS),
            ("num_experts_per_tok", MAX_EXPERTS),
            ("moe_intermediate_size", MAX_RANK),
        ):
            check_int(where, field, getattr(self, field), 1, high)
        # 0 is well-formed (no MTP layer, no shared expert); _check_supported refuses it
        check_int(where, "num_nextn_predict_layers", self.num_nextn_predict_layers, 0, MAX_NEXTN_LAYERS)
        check_int(where, "n_shared_experts", self.n_shared_experts, 0, MAX_EXPERTS)
        check_int(where, "num_hash_layers", self.num_hash_layers, 0, MAX_LAYERS)
        check_int(where, "index_n_heads", self.index_n_heads, 0, MAX_HEADS)
        check_int(where, "index_head_dim", self.index_head_dim, 0, MAX_HEAD_DIM)
        check_int(where, "vision_n_layers", self.vision_n_layers, 0, MAX_LAYERS)
        check_int(where, "dspark_n_routed_experts", self.dspark_n_routed_experts, 0, MAX_EXPERTS)
        check_int(where, "dspark_num_experts_per_tok", self.dspark_num_experts_per_tok, 0, MAX_EXPERTS)
        check_positive_float(where, "hc_eps", self.hc_eps, below=1)
        check_positive_float(where, "rms_norm_eps", self.rms_norm_eps, below=1)
        check_positive_float(where, "routed_scaling_factor", self.routed_scaling_factor)
        check_positive_float(where, "swiglu_limit", self.swiglu_limit, zero_ok=True)  # 0: no clamp
        check_positive_float(where, "rope_theta", self.rope_theta)
        if type(self.norm_topk_prob) is not bool:
            raise malformed(
                where, "norm_topk_prob", f"norm_topk_prob is {describe(self.norm_topk_prob)}; expected true or false"
            )
        for field in ("scoring_func", "topk_method", "expert_dtype"):
            if type(getattr(self, field)) is not str:
                raise malformed(where, field, f"{field} is {describe(getattr(self, field))}; expected a string")
        # the length rule of compress_ratios depends on num_hidden_layers: _check_relations
        check_int_list(
            where,
            "compress_ratios",
            self.compress_ratios,
            0,
            MAX_COMPRESS_RATIO,
            range(MAX_LAYERS + MAX_NEXTN_LAYERS + 1),
        )
        check_int_list(
            where, "quantization_config.weight_block_size", self.weight_block_size, 1, MAX_BLOCK, range(2, 3)
        )

    def _check_dspark(self, where: str) -> None:
        present = [f for f in DSPARK_FIELDS if getattr(self, f) is not None]
        if present and len(present) < len(DSPARK_FIELDS):
            missing = next(f for f in DSPARK_FIELDS if getattr(self, f) is None)
            raise malformed(
                where,
                missing,
                f"lacks {missing}: a DSpark config has all of {', '.join(DSPARK_FIELDS)} (it has {', '.join(present)})",
            )
        if self.n_mtp_layers is not None:
            check_int(where, "n_mtp_layers", self.n_mtp_layers, 1, MAX_DSPARK_STAGES)
        if not present:
            return
        check_int(where, "dspark_block_size", self.dspark_block_size, 1, MAX_DSPARK_BLOCK)
        check_int(where, "dspark_noise_token_id", self.dspark_noise_token_id, 0, self.vocab_size - 1)
        check_int(where, "dspark_markov_rank", self.dspark_markov_rank, 1, MAX_RANK)
        ids = self.dspark_target_layer_ids
        check_int_list(
            where, "dspark_target_layer_ids", ids, 0, self.num_hidden_layers - 1, range(1, MAX_DSPARK_STAGES + 1)
        )
        assert ids is not None  # _int_list refused anything but a list
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise malformed(
                where,
                "dspark_target_layer_ids",
                f"dspark_target_layer_ids names layer {repeated[0]} twice; expected distinct main layers",
            )
        if self.n_mtp_layers is not None and self.n_mtp_layers != len(ids):
            raise malformed(
                where,
                "n_mtp_layers",
                f"n_mtp_layers is {self.n_mtp_layers} but dspark_target_layer_ids has {len(ids)} entries: the stage "
                "counts disagree (mapping/README.md#dspark-source-checkpoint)",
            )

    def _check_relations(self, where: str) -> None:
        rd, D = self.qk_rope_head_dim, self.head_dim
        if rd > D or rd % 2:
            raise malformed(
                where,
                "qk_rope_head_dim",
                f"qk_rope_head_dim is {rd}; RoPE turns pairs of the last dims of a head: expected an even number <= "
                f"head_dim ({D})",
            )
        if self.num_attention_heads % self.o_groups:
            raise malformed(
                where,
                "o_groups",
                f"o_groups is {self.o_groups}; the output projection splits the heads into groups: expected a "
                f"divisor of num_attention_heads ({self.num_attention_heads})",
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise malformed(
                where,
                "num_experts_per_tok",
                f"num_experts_per_tok is {self.num_experts_per_tok}, more than n_routed_experts "
                f"({self.n_routed_experts})",
            )
        if self.num_hash_layers > self.num_hidden_layers:
            raise malformed(
                where,
                "num_hash_layers",
                f"num_hash_layers is {self.num_hash_layers}, more than num_hidden_layers ({self.num_hidden_layers})",
            )
        if self.compress_ratios and self.is_dspark:
            # mapping/README.md#dspark-source-checkpoint: one entry per main layer, then one per drafter stage
            n, want = len(self.compress_ratios), self.num_hidden_layers + self.dspark_stages
            if n != want:
                raise malformed(
                    where,
                    "compress_ratios",
                    f"compress_ratios has {n} entries; expected one per main layer (num_hidden_layers = "
                    f"{self.num_hidden_layers}) and one per DSpark stage ({self.dspark_stages}): {want}",
                )
        elif self.compress_ratios:
            # mapping/README.md#config-fields: one entry per main layer, then the MTP layer(s)
            n, low, high = (
                len(self.compress_ratios),
                self.num_hidden_layers + 1,
                self.num_hidden_layers + MAX_NEXTN_LAYERS,
            )
            if not low <= n <= high:
                raise malformed(
                    where,
                    "compress_ratios",
                    f"compress_ratios has {n} entries; expected one per main layer (num_hidden_layers = "
                    f"{self.num_hidden_layers}) and one per draft layer: {low}..{high}",
                )

    def _check_supported(self, where: str) -> None:
        if self.num_nextn_predict_layers == 0:
            raise unsupported(
                where,
                "num_nextn_predict_layers",
                "num_nextn_predict_layers is 0: the checkpoint has no MTP draft layer to convert",
            )
        storage_of(self.expert_dtype, where)  # an expert storage this tool has (model/storage.py), or refused
        # vLLM creates ffn.gate.e_score_correction_bias only for noaux_tc routing (NOTES.md),
        # and the draft's router is sqrtsoftplus (model/README.md#moe-routing)
        for field, want in (("topk_method", "noaux_tc"), ("scoring_func", "sqrtsoftplus")):
            if getattr(self, field) != want:
                raise unsupported(
                    where,
                    field,
                    f"topk_method {self.topk_method!r}, scoring_func {self.scoring_func!r}; the XPU MTP layout is "
                    "defined for noaux_tc routing with sqrtsoftplus scores only",
                )
        if self.n_shared_experts != 1:
            raise unsupported(
                where,
                "n_shared_experts",
                f"n_shared_experts is {self.n_shared_experts}; the layouts of this tool have exactly one shared "
                "expert of width moe_intermediate_size (mapping/README.md#names-of-an-mtp-block)",
            )
        drafts = self.compress_ratios[self.num_hidden_layers :]
        if any(drafts):
            raise unsupported(
                where,
                "compress_ratios",
                f"compress_ratios gives the draft layer(s) the ratio(s) {list(drafts)}; the MTP layer has no "
                "compressor (mapping/README.md#config-fields: its entry is 0)",
            )

    @classmethod
    def from_dict(cls, raw: Any, where: str = CONFIG) -> ModelConfig:
        """Validate a parsed config.json read from `where`; malformed_config or
        unsupported_layout (naming `where` and the field) if it is not usable."""
        require_object(where, raw)
        if raw.get("model_type") == V41_MODEL_TYPE:
            raw = flatten_v41(raw, where)
        names = {f.name for f in fields(cls)} - {"weight_block_size"}
        values = {k: v for k, v in raw.items() if k in names}
        for field in ("compress_ratios", "dspark_target_layer_ids"):
            if type(values.get(field)) is list:
                values[field] = tuple(values[field])
        for field in (*DSPARK_FIELDS, "n_mtp_layers"):
            if field in values and values[field] is None:  # None means absent in the dataclass
                raise malformed(
                    where,
                    field,
                    f"{field} is null; expected an integer{' list' if field == 'dspark_target_layer_ids' else ''}",
                )
        quant = raw.get("quantization_config")
        if quant is not None and not isinstance(quant, dict):
            raise malformed(
                where, "quantization_config", f"quantization_config is {describe(quant)}; expected an object"
            )
        if quant and "weight_block_size" in quant:
            block = quant["weight_block_size"]
            values["weight_block_size"] = tuple(block) if type(block) is list else block
        if values.get("expert_dtype", "") is None:
            del values["expert_dtype"]
        _check_model_type(where, values.get("model_type", SUPPORTED_MODEL_TYPE))
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in values]
        if missing:
            raise malformed(where, missing[0], f"lacks required field(s): {', '.join(missing)}")
        return cls(**values, where=where)

    @classmethod
    def from_json(cls, raw: bytes | str, where: str = CONFIG) -> ModelConfig:
        return cls.from_dict(parse_config(raw, where), where)

    @property
    def is_dspark(self) -> bool:
        """A DSpark drafter (DeepSeek-V4-Flash-0731, mapping/README.md#dspark-v4-flash-0731): its
        dspark_* fields are set."""
        return self.dspark_target_layer_ids is not None

    @property
    def is_v41(self) -> bool:
        """A DeepSeek V4.1 drafter (model/config_v41.py)."""
        return self.model_type == V41_MODEL_TYPE

    @property
    def draft_routed_experts(self) -> int:
        """The routed experts of each draft block: V4.1's dspark_n_routed_experts where it is set
        (vLLM deepseek_v41/nvidia/dspark.py:376-379), the main model's otherwise."""
        return self.dspark_n_routed_experts or self.n_routed_experts

    @property
    def draft_experts_per_tok(self) -> int:
        """The experts each token of a draft block routes to: V4.1's dspark_num_experts_per_tok where it
        is set (vLLM deepseek_v41/nvidia/model.py:136-144), the main model's otherwise."""
        return self.dspark_num_experts_per_tok or self.num_experts_per_tok

    @property
    def draft_experts_field(self) -> str:
        """The config field draft_routed_experts comes from, as a refusal names it."""
        return "dspark_n_routed_experts" if self.dspark_n_routed_experts else "n_routed_experts"

    @property
    def dspark_stages(self) -> int:
        """S, the drafter's stages `mtp.0..S-1`: one per target feature layer
        (mapping/README.md#dspark-source-checkpoint)."""
        if self.dspark_target_layer_ids is None:
            raise ValueError("dspark_stages of a config that is not DSpark")
        return len(self.dspark_target_layer_ids)

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.hidden_size

    @property
    def hc_mix(self) -> int:
        """Rows of an hc_{attn,ffn}_fn: n_hc pre, n_hc post, n_hc*n_hc comb."""
        return (2 + self.hc_mult) * self.hc_mult

    def require_draft_blocks(self, blocks: list[str], where: str) -> None:
        """Refuse, naming `where` (its config.json) and the field, a config that promises more
        draft blocks than a checkpoint holds (`blocks`: the prefixes present, e.g. ["mtp.0"])."""
        if len(blocks) < self.num_nextn_predict_layers:
            raise unsupported(
                where,
                "num_nextn_predict_layers",
                f"num_nextn_predict_layers = {self.num_nextn_predict_layers} but the shards hold {len(blocks)} draft "
                f"block(s) ({', '.join(blocks) or 'none'}) (keys and config disagree)",
            )

    def mtp_layer_index(self, i: int) -> int:
        """vLLM numbers MTP block i as decoder layer L = num_hidden_layers + i."""
        return self.num_hidden_layers + i


def parse_config(raw: bytes | str, where: str = CONFIG) -> dict[str, Any]:
    """config.json (read from `where`) as strict JSON whose top level is an object (its fields
    unchecked: that is ModelConfig.from_dict's job, for the readers that need the model's
    fields); malformed_config naming `where` otherwise."""
    try:
        value = loads(raw)
    except StrictJSONError as exc:
        raise malformed(where, None, str(exc)) from None
    require_object(where, value)
    return value
