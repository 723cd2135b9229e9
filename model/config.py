"""DeepSeek V4 model configuration: the config.json fields the MTP draft depends on, and the
one validating loader every reader of a config.json goes through.

A ModelConfig is valid by construction (`__post_init__` checks every field): each field has
its JSON type (a bool is not an integer, "256" is not a number), its sign, a range with an
upper bound far above the released models (mapping/README.md#config-fields; model/presets.py holds Flash and
Pro verbatim) and its relations to other fields. A value out of range, of the wrong type or
contradicting another field is malformed (malformed_config); a well-formed value this tool
has no layout for (another routing, expert storage or model type) is unsupported
(unsupported_layout). Both name the field; `config_errors` adds the file's name.
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from dsv4.model.errors import CheckpointError
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
EXPERT_DTYPES = ("fp4", "fp8")  # instruct (FP4 experts) and Base ("FP8 mixed")

_SHORT = reprlib.Repr()  # values in messages stay short, however large the JSON value
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 40
_SHORT.maxlist = _SHORT.maxtuple = 4
_SHORT.maxdict, _SHORT.maxlevel = 3, 2


def _describe(value: Any) -> str:
    """A value as an error message shows it: in JSON spelling, short however large it is,
    with its JSON kind where that is the fault."""
    kind = {
        bool: "a boolean",
        str: "a string",
        list: "a list",
        tuple: "a list",
        dict: "an object",
        type(None): "null",
    }.get(type(value))
    if value is None:
        return "null"
    if type(value) in (bool, str):
        shown = json.dumps(value[:41] if type(value) is str else value)
        shown = shown[:40] + '..."' if len(shown) > 42 else shown
    else:
        shown = _SHORT.repr(value)
    return f"{shown} ({kind})" if kind else shown


def _int(field: str, value: Any, low: int, high: int) -> None:
    # bool is a subclass of int in Python; in config.json `true` is not a count
    if type(value) is not int:
        raise CheckpointError(
            f"{field} is {_describe(value)}; expected an integer in {low}..{high}", kind="malformed_config", field=field
        )
    if not low <= value <= high:
        raise CheckpointError(
            f"{field} is {value}; expected an integer in {low}..{high}", kind="malformed_config", field=field
        )


def _positive_float(field: str, value: Any, *, zero_ok: bool = False, below: float | None = None) -> None:
    # a JSON integer is a number too (rope_theta is 10000 in the release); one past 2^63 would
    # overflow the float math that uses it
    number = (type(value) is int and abs(value) < 2**63) or (type(value) is float and math.isfinite(value))
    ok = number and (value >= 0 if zero_ok else value > 0) and (below is None or value < below)
    if not ok:
        want = f"a finite number {'>= 0' if zero_ok else '> 0'}" + (f" and < {below:g}" if below is not None else "")
        raise CheckpointError(f"{field} is {_describe(value)}; expected {want}", kind="malformed_config", field=field)


def _int_list(field: str, value: Any, low: int, high: int, lengths: range) -> None:
    """A JSON list of integers (held as a tuple), its length in `lengths`."""
    if type(value) is not tuple:
        raise CheckpointError(
            f"{field} is {_describe(value)}; expected a list of integers in {low}..{high}",
            kind="malformed_config",
            field=field,
        )
    if len(value) not in lengths:
        want = f"{lengths.start}..{lengths.stop - 1}" if len(lengths) > 1 else f"exactly {lengths.start}"
        raise CheckpointError(
            f"{field} has {len(value)} entr{'y' if len(value) == 1 else 'ies'}; expected {want}",
            kind="malformed_config",
            field=field,
        )
    for k, item in enumerate(value):
        _int(f"{field}[{k}]", item, low, high)


def _require_object(value: Any) -> None:
    if not isinstance(value, dict):
        raise CheckpointError(f"the top level is {_describe(value)}; expected a JSON object", kind="malformed_config")


def _check_model_type(model_type: Any) -> None:
    if type(model_type) is not str:
        raise CheckpointError(
            f"model_type is {_describe(model_type)}; expected a string", kind="malformed_config", field="model_type"
        )
    if model_type != SUPPORTED_MODEL_TYPE:
        hint = (
            " (DeepSeek V4.1: vLLM 0.33.0 has no XPU draft model for it, mapping/README.md#later-drafters-dspark-and-v41)"
            if model_type == "deepseek_v41"
            else ""
        )
        raise CheckpointError(
            f"model_type {model_type!r}{hint}; this tool converts {SUPPORTED_MODEL_TYPE!r} checkpoints only",
            kind="unsupported_layout",
            field="model_type",
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

    def __post_init__(self) -> None:
        _check_model_type(self.model_type)  # first: another model's fields are not ours to judge
        self._check_ranges()
        self._check_dspark()
        self._check_relations()
        self._check_supported()

    def _check_ranges(self) -> None:
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
            _int(field, getattr(self, field), 1, high)
        # 0 is well-formed (no MTP layer, no shared expert); _check_supported refuses it
        _int("num_nextn_predict_layers", self.num_nextn_predict_layers, 0, MAX_NEXTN_LAYERS)
        _int("n_shared_experts", self.n_shared_experts, 0, MAX_EXPERTS)
        _int("num_hash_layers", self.num_hash_layers, 0, MAX_LAYERS)
        _int("index_n_heads", self.index_n_heads, 0, MAX_HEADS)
        _int("index_head_dim", self.index_head_dim, 0, MAX_HEAD_DIM)
        _positive_float("hc_eps", self.hc_eps, below=1)
        _positive_float("rms_norm_eps", self.rms_norm_eps, below=1)
        _positive_float("routed_scaling_factor", self.routed_scaling_factor)
        _positive_float("swiglu_limit", self.swiglu_limit, zero_ok=True)  # 0: no clamp
        _positive_float("rope_theta", self.rope_theta)
        if type(self.norm_topk_prob) is not bool:
            raise CheckpointError(
                f"norm_topk_prob is {_describe(self.norm_topk_prob)}; expected true or false",
                kind="malformed_config",
                field="norm_topk_prob",
            )
        for field in ("scoring_func", "topk_method", "expert_dtype"):
            if type(getattr(self, field)) is not str:
                raise CheckpointError(
                    f"{field} is {_describe(getattr(self, field))}; expected a string",
                    kind="malformed_config",
                    field=field,
                )
        # the length rule of compress_ratios depends on num_hidden_layers: _check_relations
        _int_list(
            "compress_ratios", self.compress_ratios, 0, MAX_COMPRESS_RATIO, range(MAX_LAYERS + MAX_NEXTN_LAYERS + 1)
        )
        _int_list("quantization_config.weight_block_size", self.weight_block_size, 1, MAX_BLOCK, range(2, 3))

    def _check_dspark(self) -> None:
        present = [f for f in DSPARK_FIELDS if getattr(self, f) is not None]
        if present and len(present) < len(DSPARK_FIELDS):
            missing = next(f for f in DSPARK_FIELDS if getattr(self, f) is None)
            raise CheckpointError(
                f"lacks {missing}: a DSpark config has all of {', '.join(DSPARK_FIELDS)} (it has {', '.join(present)})",
                kind="malformed_config",
                field=missing,
            )
        if self.n_mtp_layers is not None:
            _int("n_mtp_layers", self.n_mtp_layers, 1, MAX_DSPARK_STAGES)
        if not present:
            return
        _int("dspark_block_size", self.dspark_block_size, 1, MAX_DSPARK_BLOCK)
        _int("dspark_noise_token_id", self.dspark_noise_token_id, 0, self.vocab_size - 1)
        _int("dspark_markov_rank", self.dspark_markov_rank, 1, MAX_RANK)
        ids = self.dspark_target_layer_ids
        _int_list("dspark_target_layer_ids", ids, 0, self.num_hidden_layers - 1, range(1, MAX_DSPARK_STAGES + 1))
        assert ids is not None  # _int_list refused anything but a list
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise CheckpointError(
                f"dspark_target_layer_ids names layer {repeated[0]} twice; expected distinct main layers",
                kind="malformed_config",
                field="dspark_target_layer_ids",
            )
        if self.n_mtp_layers is not None and self.n_mtp_layers != len(ids):
            raise CheckpointError(
                f"n_mtp_layers is {self.n_mtp_layers} but dspark_target_layer_ids has {len(ids)} entries: the stage counts disagree (mapping/README.md#dspark-source-checkpoint)",
                kind="malformed_config",
                field="n_mtp_layers",
            )

    def _check_relations(self) -> None:
        rd, D = self.qk_rope_head_dim, self.head_dim
        if rd > D or rd % 2:
            raise CheckpointError(
                f"qk_rope_head_dim is {rd}; RoPE turns pairs of the last dims of a head: expected an even number <= head_dim ({D})",
                kind="malformed_config",
                field="qk_rope_head_dim",
            )
        if self.num_attention_heads % self.o_groups:
            raise CheckpointError(
                f"o_groups is {self.o_groups}; the output projection splits the heads into groups: expected a divisor of num_attention_heads ({self.num_attention_heads})",
                kind="malformed_config",
                field="o_groups",
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise CheckpointError(
                f"num_experts_per_tok is {self.num_experts_per_tok}, more than n_routed_experts ({self.n_routed_experts})",
                kind="malformed_config",
                field="num_experts_per_tok",
            )
        if self.num_hash_layers > self.num_hidden_layers:
            raise CheckpointError(
                f"num_hash_layers is {self.num_hash_layers}, more than num_hidden_layers ({self.num_hidden_layers})",
                kind="malformed_config",
                field="num_hash_layers",
            )
        if self.compress_ratios and self.is_dspark:
            # mapping/README.md#dspark-source-checkpoint: one entry per main layer, then one per drafter stage
            n, want = len(self.compress_ratios), self.num_hidden_layers + self.dspark_stages
            if n != want:
                raise CheckpointError(
                    f"compress_ratios has {n} entries; expected one per main layer (num_hidden_layers = {self.num_hidden_layers}) and one per DSpark stage ({self.dspark_stages}): {want}",
                    kind="malformed_config",
                    field="compress_ratios",
                )
        elif self.compress_ratios:
            # mapping/README.md#config-fields: one entry per main layer, then the MTP layer(s)
            n, low, high = (
                len(self.compress_ratios),
                self.num_hidden_layers + 1,
                self.num_hidden_layers + MAX_NEXTN_LAYERS,
            )
            if not low <= n <= high:
                raise CheckpointError(
                    f"compress_ratios has {n} entries; expected one per main layer (num_hidden_layers = {self.num_hidden_layers}) and one per draft layer: {low}..{high}",
                    kind="malformed_config",
                    field="compress_ratios",
                )

    def _check_supported(self) -> None:
        if self.num_nextn_predict_layers == 0:
            raise CheckpointError(
                "num_nextn_predict_layers is 0: the checkpoint has no MTP draft layer to convert",
                kind="unsupported_layout",
                field="num_nextn_predict_layers",
            )
        if self.expert_dtype not in EXPERT_DTYPES:
            raise CheckpointError(
                f"unknown expert_dtype {self.expert_dtype!r} (expected fp4 or fp8)",
                kind="unsupported_layout",
                field="expert_dtype",
            )
        # vLLM creates ffn.gate.e_score_correction_bias only for noaux_tc routing (NOTES.md),
        # and the draft's router is sqrtsoftplus (model/README.md#moe-routing)
        for field, want in (("topk_method", "noaux_tc"), ("scoring_func", "sqrtsoftplus")):
            if getattr(self, field) != want:
                raise CheckpointError(
                    f"topk_method {self.topk_method!r}, scoring_func {self.scoring_func!r}; the XPU MTP layout is defined for noaux_tc routing with sqrtsoftplus scores only",
                    kind="unsupported_layout",
                    field=field,
                )
        if self.n_shared_experts != 1:
            raise CheckpointError(
                f"n_shared_experts is {self.n_shared_experts}; the layouts of this tool have exactly one shared expert of width moe_intermediate_size (mapping/README.md#names-of-an-mtp-block)",
                kind="unsupported_layout",
                field="n_shared_experts",
            )
        drafts = self.compress_ratios[self.num_hidden_layers :]
        if any(drafts):
            raise CheckpointError(
                f"compress_ratios gives the draft layer(s) the ratio(s) {list(drafts)}; the MTP layer has no compressor (mapping/README.md#config-fields: its entry is 0)",
                kind="unsupported_layout",
                field="compress_ratios",
            )

    @classmethod
    def from_dict(cls, raw: Any) -> ModelConfig:
        """Validate a parsed config.json; malformed_config (naming the field) if it is not usable."""
        _require_object(raw)
        names = {f.name for f in fields(cls)} - {"weight_block_size"}
        values = {k: v for k, v in raw.items() if k in names}
        for field in ("compress_ratios", "dspark_target_layer_ids"):
            if type(values.get(field)) is list:
                values[field] = tuple(values[field])
        for field in (*DSPARK_FIELDS, "n_mtp_layers"):
            if field in values and values[field] is None:  # None means absent in the dataclass
                raise CheckpointError(
                    f"{field} is null; expected an integer{' list' if field == 'dspark_target_layer_ids' else ''}",
                    kind="malformed_config",
                    field=field,
                )
        quant = raw.get("quantization_config")
        if quant is not None and not isinstance(quant, dict):
            raise CheckpointError(
                f"quantization_config is {_describe(quant)}; expected an object",
                kind="malformed_config",
                field="quantization_config",
            )
        if quant and "weight_block_size" in quant:
            block = quant["weight_block_size"]
            values["weight_block_size"] = tuple(block) if type(block) is list else block
        if values.get("expert_dtype", "") is None:
            del values["expert_dtype"]
        _check_model_type(values.get("model_type", SUPPORTED_MODEL_TYPE))
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in values]
        if missing:
            raise CheckpointError(
                f"lacks required field(s): {', '.join(missing)}", kind="malformed_config", field=missing[0]
            )
        return cls(**values)

    @classmethod
    def from_json(cls, raw: bytes | str) -> ModelConfig:
        return cls.from_dict(parse_config(raw))

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read and validate `path`; OSError if it cannot be read, malformed_config if unusable."""
        return cls.from_json(Path(path).read_bytes())

    @property
    def is_dspark(self) -> bool:
        """A DSpark drafter (DeepSeek-V4-Flash-0731, mapping/README.md#dspark-v4-flash-0731): its dspark_* fields are set."""
        return self.dspark_target_layer_ids is not None

    @property
    def dspark_stages(self) -> int:
        """S, the drafter's stages `mtp.0..S-1`: one per target feature layer (mapping/README.md#dspark-source-checkpoint)."""
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

    def require_draft_blocks(self, blocks: list[str]) -> None:
        """Refuse, naming the field, a config that promises more draft blocks than a
        checkpoint holds (`blocks`: the prefixes present, e.g. ["mtp.0"])."""
        if len(blocks) < self.num_nextn_predict_layers:
            raise CheckpointError(
                f"num_nextn_predict_layers = {self.num_nextn_predict_layers} but the shards hold {len(blocks)} draft block(s) ({', '.join(blocks) or 'none'}) (keys and config disagree)",
                kind="unsupported_layout",
                field="num_nextn_predict_layers",
            )

    def mtp_layer_index(self, i: int) -> int:
        """vLLM numbers MTP block i as decoder layer L = num_hidden_layers + i."""
        return self.num_hidden_layers + i


def parse_config(raw: bytes | str) -> dict[str, Any]:
    """config.json as strict JSON whose top level is an object (its fields unchecked: that is
    ModelConfig.from_dict's job, for the readers that need the model's fields)."""
    try:
        value = loads(raw)
    except StrictJSONError as exc:
        raise CheckpointError(str(exc), kind="malformed_config") from None
    _require_object(value)
    return value


@contextmanager
def config_errors(where: str) -> Iterator[None]:
    """The config verdicts as every command reports them (plan, convert, check, the loader):
    unsupported -> unsupported_layout, anything else -> malformed_config; `where`
    (the config.json's path) heads the one-line message."""
    try:
        yield
    except CheckpointError as exc:
        if exc.kind not in ("malformed_config", "unsupported_layout"):
            raise
        raise CheckpointError(f"{where}: {exc}", kind=exc.kind, path=where, field=exc.field) from None
