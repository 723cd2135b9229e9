"""The config check of `convert-dsv4 check` (convert/check/run.py has the order): the records name
the conversion (config.json's layout record for a renamed layout, conversion.json for a
draft directory, whose config.json is the source's) and config.json agrees with the tensors:
draft blocks or stages present, expert_dtype, FP8 block size against the scale shapes; for a
layout runtimes load from disk also architectures and model_type present, the experts, and
every runtime-read field as the conversion wrote it.

What differs between targets is the registry's (mapping/targets.py): how the layout names a
draft block and a scale's weight, and which runtimes read it."""

from __future__ import annotations

import re
from typing import Any

from dsv4.convert.check.context import Context, first_line
from dsv4.convert.errors import CheckError
from dsv4.convert.route_load import is_held_for_a_target
from dsv4.mapping.errors import TableError
from dsv4.mapping.table import Table, load_table
from dsv4.mapping.targets import (
    Target,
    bundled_target,
    installed_tables,
    installed_targets,
    require_target,
    serving_targets,
)
from dsv4.model.checkpoint import ShardHeaders
from dsv4.model.config import ModelConfig
from dsv4.model.record import (
    ABSENT,
    CONVERSION_RECORD,
    LAYOUT_RECORD,
    RUNTIME_CONFIG_FIELDS,
    LayoutRecord,
    RecordError,
    brief,
)
from dsv4.model.storage import holding_layout_tensor, holding_native_weight, scale_params

EXPERT = re.compile(rf"\.ffn\.experts\.routed_experts\.(w13|w2)_(weight|{'|'.join(scale_params())})\Z")
NATIVE_EXPERT = re.compile(r"mtp\.\d+\.ffn\.experts\.(\d+)\.w[123]\.(weight|scale)\Z")
# a native expert's tensor of any leaf: its native pair, or a serving target's form (route_load.py)
EXPERT_TENSOR = re.compile(r"mtp\.\d+\.ffn\.experts\.(\d+)\.w[123]\.\w+\Z")


def _expert_dtype_of(name: str, dtype: str) -> tuple[str, ...] | None:
    """The expert_dtypes a routed-expert tensor may hold (mapping/README.md#mtp-parameters, model/storage.py):
    a native weight by its dtype (FP4: I8 packed, FP8: F8_E4M3), a layout weight by its container dtype and a
    layout scale by its name (FP4 `_weight_scale`, FP8 `_weight_scale_inv`); () for none."""
    native = NATIVE_EXPERT.match(name)
    if native is not None:
        return holding_native_weight(dtype) if native.group(2) == "weight" else None
    m = EXPERT.search(name)
    return None if m is None else holding_layout_tensor(m.group(2), dtype)


def _recorded_layout(ctx: Context, where: str) -> tuple[str, str, str, str]:
    """(table, table version, layout, the field naming the table) the checkpoint was
    converted with: config.json's layout record for a renamed layout (xpu; conversion.json
    must agree, check_config says), conversion.json alone for a draft directory, whose config.json is the source's."""
    assert ctx.config is not None
    try:
        layout_record = LayoutRecord.of(ctx.config, where)
    except RecordError as exc:
        installed = f" (installed: {', '.join(installed_tables())})" if exc.field == f"{LAYOUT_RECORD}.table" else ""
        raise CheckError(f"{exc}{installed}", kind="config_check", path=str(where)) from None
    conv = ctx.record
    if layout_record is None:
        if conv is None or conv.has_layout_record:
            said = "" if conv is not None else f", and no readable {CONVERSION_RECORD} names the layout"
            raise CheckError(
                f"{where}: no {LAYOUT_RECORD} record with layout, table, table_version, tool_version{said}: not a "
                "checkpoint this converter wrote",
                kind="config_check",
                path=str(where),
            )
        return conv.table, conv.table_version, conv.target, f"{CONVERSION_RECORD} table"
    return layout_record.table, layout_record.table_version, layout_record.layout, f"{LAYOUT_RECORD}.table"


def layout_target(ctx: Context) -> tuple[str, Target]:
    """The layout to hold the tensors against, by name (the config check's finding, else what
    the records say: config.json's layout record, else conversion.json, else the bundled
    model's) and as the registry's target; a name the registry lacks (the config check's
    failure) is held against the bundled model's layout."""
    name = ctx.target
    if name is None:
        try:
            name = _recorded_layout(ctx, ctx.config_where)[2]
        except CheckError as exc:
            if exc.kind != "config_check":
                raise
            name = ctx.record.target if ctx.record is not None else _unrecorded_target(ctx).name
    return name, require_target(name) if name in installed_targets() else _unrecorded_target(ctx)


def _unrecorded_target(ctx: Context) -> Target:
    """The layout of a directory whose records name none: the bundled model's, or for a drafter the
    bundled target does not convert (DeepSeek V4.1: mapping/targets/draft.toml) the one serving
    target, which holds the native names."""
    if ctx.cfg is not None and ctx.cfg.is_v41:
        (serving,) = serving_targets()
        return require_target(serving)
    return bundled_target()


def _recorded_table(ctx: Context, cfg: ModelConfig, where: str) -> tuple[Table, str]:
    """The installed table the records name and the field naming it, refused unless the
    records agree with each other, with this tool's table and with the drafter config.json describes."""
    table_name, table_version, target, field = _recorded_layout(ctx, where)
    try:
        table = load_table(table_name)
    except TableError as exc:
        raise CheckError(
            f"{where}: {field} {table_name!r} is not a table this tool has ({first_line(exc)})",
            kind="config_check",
            path=str(where),
        ) from None
    if (target, table_version) != (table.target, table.version):
        raise CheckError(
            f"{where}: converted to layout {target!r} with table {table_name} v{table_version}, but this tool's "
            f"table {table.name} is v{table.version} for layout {table.target!r}: reconvert",
            kind="config_check",
            path=str(where),
        )
    if ctx.record is not None and (ctx.record.table, ctx.record.target) != (table_name, target):
        raise CheckError(
            f"{where}: {LAYOUT_RECORD} says table {table_name!r} / layout {target!r}, {CONVERSION_RECORD} says "
            f"{ctx.record.table!r} / {ctx.record.target!r}",
            kind="config_check",
            path=str(where),
        )
    drafter = "dspark" if cfg.is_dspark else "mtp"
    if table.drafter != drafter:
        raise CheckError(
            f"{where}: {field} {table_name!r} maps {table.drafter} drafters, but config.json describes "
            f"a{'' if cfg.is_dspark else 'n'} {drafter} "
            f"drafter{' (dspark_* fields)' if cfg.is_dspark else ' (no dspark_* fields)'}",
            kind="config_check",
            path=str(where),
        )
    return table, field


def _check_blocks(target: Target, cfg: ModelConfig, headers: ShardHeaders, where: str) -> tuple[list[int], str]:
    """The draft blocks the tensors hold, refused unless they are the ones config.json means,
    and how the summary names them."""
    present = sorted({int(m.group(1)) for name in headers.tensors if (m := target.kind.block.match(name))})
    stages = f"dspark_target_layer_ids ({len(cfg.dspark_target_layer_ids or ())} entries) means DSpark stage"
    if target.kind.native_names:  # MTP block or DSpark stage mtp.{n}
        expected = list(range(cfg.dspark_stages if cfg.is_dspark else cfg.num_nextn_predict_layers))
        meaning = (
            f"{stages}(s) mtp.{expected}"
            if cfg.is_dspark
            else f"num_nextn_predict_layers = {cfg.num_nextn_predict_layers} means MTP block(s) mtp.{expected}"
        )
        held, named = f"mtp.{present}", f"{'DSpark stage' if cfg.is_dspark else 'MTP block'}(s) mtp.{present}"
    elif cfg.is_dspark:  # the stages are an nn.ModuleList: model.layers.{s}, s < S
        expected = list(range(cfg.dspark_stages))
        meaning, held, named = (
            f"{stages} layer(s) {expected}",
            f"layer(s) {present}",
            f"DSpark stage layer(s) {present}",
        )
    else:
        expected = sorted({cfg.mtp_layer_index(i) for i in range(cfg.num_nextn_predict_layers)})
        meaning = (
            f"num_nextn_predict_layers = {cfg.num_nextn_predict_layers} and num_hidden_layers = "
            f"{cfg.num_hidden_layers} mean MTP layer(s) {expected}"
        )
        held, named = f"layer(s) {present}", f"MTP layer(s) {present}"
    if present != expected:
        raise CheckError(f"{where}: {meaning}, but the tensors hold {held}", kind="config_check", path=str(where))
    return present, named


def _check_experts(target: Target, cfg: ModelConfig, headers: ShardHeaders, where: str) -> None:
    """Every routed-expert tensor is of config.json's expert_dtype; in native names, experts 0..E-1 are all there.
    A draft written for a serving target holds its experts as the target's scheme takes them (bf16, MXFP4...):
    the layout check holds each to its form (convert/route_load.py)."""
    found = {name: (src.dtype, src.shape) for name, src in headers.tensors.items()}
    held = target.kind.native_names and is_held_for_a_target(cfg, found)
    for name, src in sorted(headers.tensors.items()) if not held else ():
        implied = _expert_dtype_of(name, src.dtype)
        if implied is not None and cfg.expert_dtype not in implied:
            raise CheckError(
                f"{where}: expert_dtype is {cfg.expert_dtype!r} but {src.file}: tensor {name} ({src.dtype}) holds "
                f"{' or '.join(implied) or f'unknown ({src.dtype})'} experts",
                kind="config_check",
                path=str(where),
                tensor=name,
            )
    experts = {int(m.group(1)) for name in headers.tensors if (m := EXPERT_TENSOR.match(name))}
    if target.kind.native_names and experts != set(range(cfg.draft_routed_experts)):
        raise CheckError(
            f"{where}: {cfg.draft_experts_field} = {cfg.draft_routed_experts}, but the tensors hold routed experts "
            f"{min(experts, default=None)}..{max(experts, default=None)} ({len(experts)})",
            kind="config_check",
            path=str(where),
        )


def _check_block_size(
    target: Target, config: dict[str, Any], cfg: ModelConfig, headers: ShardHeaders, where: str
) -> str:
    """An FP8 config's weight_block_size gives every scale the shape the shards hold; returns
    how the summary names the quantisation."""
    # an object or absent, its weight_block_size two integers in range: the config loader
    # (ctx.cfg) has checked both; only an FP8 config that names no block size is left
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return "no quantization_config"
    if quant.get("quant_method") != "fp8":
        return f"{quant.get('quant_method')} quantisation (names: see quant)"
    if "weight_block_size" not in quant:
        raise CheckError(
            f"{where}: quantization_config.weight_block_size is None, not two positive integers",
            kind="config_check",
            path=str(where),
        )
    block = list(cfg.weight_block_size)
    layout = target.layout(cfg)
    for name, src in sorted(headers.tensors.items()):
        weight = headers.tensors.get(target.weight_of_scale(name) or "")
        if weight is None or weight.dtype != "F8_E4M3" or name not in layout or weight.name not in layout:
            continue
        if weight.shape == layout[weight.name][1] and src.shape != layout[name][1]:
            raise CheckError(
                f"{where}: quantization_config.weight_block_size {block} gives {name} the shape "
                f"{list(layout[name][1])}, but {src.file} holds {list(src.shape)} for {weight.name} "
                f"{list(weight.shape)}",
                kind="config_check",
                path=str(where),
            )
    return f"FP8 blocks {block}" if block else f"{quant.get('quant_method')} quantisation (names: see quant)"


def _check_runtime_fields(ctx: Context, target: Target, config: dict[str, Any], where: str) -> None:
    """A layout runtimes load from disk: config.json is theirs (the source's, unchanged), so it
    names the model class, and the fields they read are those the conversion wrote (a
    renamed layout's config is checked against the tensors and by quant)."""
    for key in ("architectures", "model_type"):  # read before anything else to pick the draft model class
        if key not in config:
            raise CheckError(
                f"{where}: no {key}: {target.runtimes_said} pick the draft model class from it",
                kind="config_check",
                path=str(where),
            )
    if not (
        isinstance(config["architectures"], list)
        and config["architectures"]
        and isinstance(config["architectures"][0], str)
    ):
        raise CheckError(
            f"{where}: architectures is {brief(config['architectures'])}, not a list of class names",
            kind="config_check",
            path=str(where),
        )
    if ctx.record is None or not ctx.record.config_fields:
        return
    for key in RUNTIME_CONFIG_FIELDS:
        was, now = ctx.record.config_fields.get(key, ABSENT), config.get(key, ABSENT)
        if was != now:
            raise CheckError(
                f"{where}: {key} is {brief(now)}, but the conversion wrote {brief(was)} ({CONVERSION_RECORD} "
                "config_fields; the runtimes read it)",
                kind="config_check",
                path=str(where),
            )


def check_config(ctx: Context, details: dict[str, Any]) -> str:
    where = ctx.config_where
    if ctx.config is None or ctx.cfg is None:
        raise CheckError(str(ctx.config_error), kind="config_check", path=str(where))
    headers = ctx.need_headers()
    config, cfg = ctx.config, ctx.cfg
    table, _ = _recorded_table(ctx, cfg, where)
    target = require_target(table.target)  # the records name this table's target (_recorded_table)
    present, layers = _check_blocks(target, cfg, headers, where)
    _check_experts(target, cfg, headers, where)
    what = _check_block_size(target, config, cfg, headers, where)
    if target.kind.native_names:
        _check_runtime_fields(ctx, target, config, where)
    details.update(
        layout=target.name, table=table.name, table_version=table.version, drafter=table.drafter, mtp_layers=present
    )
    ctx.target = target.name
    return (
        f"converted to {target.name!r} with table {table.name} v{table.version}; {layers}; expert_dtype "
        f"{cfg.expert_dtype}; {what} agree with the tensors"
    )
