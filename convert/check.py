"""`convert-dsv4 check DIR`: verify a converted checkpoint (`--target xpu`) or a draft
directory (`--target draft`), one named check at a time.

Each check passes, fails with its own exit code (convert/exit_codes.py, 71..86) and a
one-line reason naming the file and tensor, or is skipped with the reason why (not
requested, or a check it builds on failed). `run_checks` returns the whole report
(convert/report.py: text, JSON, JUnit) for the command (convert/cli.py) and for library
callers (the batch job).

Why one module of ~650 lines: the ten checks share one context (what the earlier checks
found: the inventory, the config, the hashes) and run in a fixed order from one table
(CHECKS); split into files, each file would need that context and the order from another.

The checks, in order (a later one may need an earlier one's result):
  index      index and shard headers agree: names, shards present, no stray shard, every
             tensor's bytes inside its file, no gaps or overlaps (safetensors' own rule)
  readable   every tensor reads through safetensors, in bounded row blocks
  sizes      the index's total_size and conversion.json's files and sizes match the shards
  checksums  every tensor's sha256 matches conversion.json (skipped with --fast)
  config     the records name the conversion (config.json's layout record for xpu,
             conversion.json for a draft directory) and config.json agrees with the
             tensors: MTP blocks or stages present, expert_dtype, FP8 block size vs scale
             shapes; for a draft directory also architectures/model_type present, the
             experts, and every runtime-read field as the conversion wrote it
  layout     names, shapes and dtypes equal layout_of(target, config): the model's own
             layout (xpu), or the native draft directory's (draft)
  quant      every linear has a quantisation layer name and resolves to one scheme
  smoke      strict load into the bundled model and a few-token forward (--smoke); for a
             DSpark checkpoint one draft block from a few random target features; a draft
             directory is mapped in memory by the xpu table first (convert/inmemory.py)
  native     numerical parity with the reference on the native checkpoint (--native);
             for DSpark also the draft tokens
  serve      a draft directory against the target it is to be served beside
             (--serve-with): vLLM builds the draft's layers from the target's config and
             quantisation, so those fields must be the draft's own, and each draft module
             must hold what the scheme the target gives it takes (convert/schemes/)
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dsv4.convert import interrupts, progress
from dsv4.convert.errors import CheckError
from dsv4.convert.exit_codes import exit_code
from dsv4.convert.quant_config import check_draft_quantization
from dsv4.convert.report import CheckReport, CheckResult
from dsv4.mapping.errors import TableError
from dsv4.mapping.table import installed_tables, load_table
from dsv4.model import strictjson
from dsv4.model.checkpoint import INDEX_NAME, Checkpoint, ShardHeaders
from dsv4.model.config import ModelConfig, parse_config
from dsv4.model.dtypes import tensor_bytes
from dsv4.model.errors import DSV4Error
from dsv4.model.layout import DRAFT_TARGET, build_draft_model, layout_of
from dsv4.model.parity import MAX_REL_DIFF, MIN_TOP1, SMOKE_TOKENS, parity_verdict
from dsv4.model.record import (
    CONVERSION_RECORD,
    LAYOUT_RECORD,
    RUNTIME_CONFIG_FIELDS,
    ConversionRecord,
    LayoutRecord,
    RecordError,
)
from dsv4.model.safetensors_header import TensorBytes
from dsv4.model.storage import holding_layout_tensor, holding_native_weight, scale_params

READ_BLOCK = 64 << 20  # bytes per read of one tensor: bounded memory at any tensor size
LIST_AT_MOST = 3  # names quoted in a one-line reason; the JSON details list all of them


class _Skipped(Exception):
    """A check that did not run, and why."""


@dataclass
class _Context:
    """What the checks share: options, and what earlier checks found."""

    root: Path
    fast: bool
    smoke: bool
    native: Path | None
    device: str
    tokens: int
    min_top1: float
    max_rel_diff: float
    config: dict[str, Any] | None = None
    config_error: str | None = None
    headers: ShardHeaders | None = None  # the index and shard headers (the index check's finding)
    hashes: dict[str, str] = field(default_factory=dict)
    unreadable: set[str] = field(default_factory=set)
    cfg: ModelConfig | None = None
    record: ConversionRecord | None = None  # conversion.json
    target: str | None = None  # the layout the checkpoint is in (the config check's finding)
    checksum_error: str | None = None  # a malformed sha256 in conversion.json (the checksums check's finding)
    smoke_report: dict[str, Any] | None = None
    passed: set[str] = field(default_factory=set)
    serve_with: Path | None = None  # the target model's directory or config.json (--serve-with)
    checkpoint: Checkpoint = field(init=False)  # the one reader of config.json, the index and the headers

    def where(self, file: str) -> str:
        return str(self.root / file)

    def __post_init__(self) -> None:
        self.checkpoint = Checkpoint(self.root)

    def need_headers(self) -> ShardHeaders:
        if self.headers is None:
            raise _Skipped("needs the index and shard headers (index check failed)")
        return self.headers

    def need_config(self) -> ModelConfig:
        if self.cfg is None:
            raise _Skipped(f"needs a model config: {self.config_error}")
        return self.cfg


def _short(names: list[str]) -> str:
    head = ", ".join(names[:LIST_AT_MOST])
    return head + (f" and {len(names) - LIST_AT_MOST} more" if len(names) > LIST_AT_MOST else "")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# --- index -------------------------------------------------------------------------------
def check_index(ctx: _Context, details: dict[str, Any]) -> str:
    index_path = ctx.root / INDEX_NAME
    if not index_path.is_file():
        raise CheckError(
            f"{index_path}: missing (the converter always writes one)", kind="index_check", path=str(index_path)
        )
    try:
        headers = ctx.checkpoint.headers  # each header tiles its file (the inventory's reader)
    except DSV4Error as exc:  # the reader's typed errors: the message names file and tensor
        raise CheckError(str(exc), kind="index_check") from None
    stray = sorted(p.name for p in ctx.root.glob("*.safetensors") if p.name not in headers.file_sizes)
    if stray:
        raise CheckError(
            f"{ctx.where(stray[0])}: shard not named in {INDEX_NAME} (a loader that globs *.safetensors would read "
            f"it; {len(stray)} such file(s))",
            kind="index_check",
            path=str(ctx.where(stray[0])),
        )
    ctx.headers = headers
    files, tensors = sorted(headers.file_sizes), headers.tensors
    details.update(shards=files, tensors=len(tensors))
    return f"{len(files)} shard(s), {len(tensors)} tensors: index and headers agree, data sections tile their files"


# --- readable + checksums: one pass over the data ----------------------------------------
def _next_data(fd: int, offset: int) -> int:
    """Where data (not a file hole) next starts at or after `offset`, the file's size when
    only a hole follows. Without hole support a file system reports data everywhere."""
    if not hasattr(os, "SEEK_DATA"):
        return offset
    try:
        return os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return os.fstat(fd).st_size
        raise


@cache
def _zeros(n: int) -> bytes:
    return bytes(n)


def _read_tensor(shard: Path, fd: int, src: TensorBytes, digest: Any | None) -> None:
    """Read every byte of `src` through safetensors in row blocks of at most READ_BLOCK
    bytes, feeding them (row-major, as on disk) to `digest`. A block lying in a file hole
    (sparse test replicas) reads as zeros by definition, so it is hashed as zeros unread."""
    rows = src.shape[0] if src.shape else 1
    row_bytes = src.nbytes // rows if rows else 0
    step = max(1, READ_BLOCK // max(1, row_bytes))
    for r in range(0, rows, step):
        lo, hi = src.start + r * row_bytes, src.start + min(rows, r + step) * row_bytes
        if _next_data(fd, lo) >= hi:
            if digest is not None:
                digest.update(_zeros(hi - lo))
            continue
        # A map per block (an open costs ~0.2 ms): pages read through a map count in this
        # process's RSS until it is unmapped, and one map over a 4.5 GB shard would end up
        # holding 4.5 GB of it; this one goes with the block.
        with safe_open(shard, framework="pt", device="cpu") as f:
            block = (
                f.get_slice(src.name)[r : r + step] if src.shape else f.get_tensor(src.name)
            )  # a 0-d tensor is one block
        data = block.contiguous().view(-1).view(torch.uint8)
        if digest is not None:
            digest.update(tensor_bytes(data))
        else:
            data.max()  # safetensors maps the file: only touching every byte reads it


def check_readable(ctx: _Context, details: dict[str, Any]) -> str:
    headers = ctx.need_headers()
    by_file: dict[str, list[TensorBytes]] = {}
    for src in headers.tensors.values():
        by_file.setdefault(src.file, []).append(src)
    failed: dict[str, str] = {}
    for file, tensors in sorted(by_file.items()):
        fd = os.open(ctx.root / file, os.O_RDONLY)
        try:
            with safe_open(
                ctx.root / file, framework="pt", device="cpu"
            ):  # refuses a malformed file once, for all its tensors
                for src in sorted(tensors, key=lambda s: s.start):  # front to back through the file
                    digest = None if ctx.fast else hashlib.sha256()
                    try:
                        _read_tensor(ctx.root / file, fd, src, digest)
                    except Exception as exc:  # any failure to read is this check's finding, unless a
                        # signal caused it: a cancelled run never blames the checkpoint
                        interrupts.raise_if_interrupted()
                        failed[src.name] = f"{file}: tensor {src.name}: {_first_line(exc)}"
                        continue
                    if digest is not None:
                        ctx.hashes[src.name] = digest.hexdigest()
        except Exception as exc:  # safetensors refusing the whole file
            interrupts.raise_if_interrupted()
            for src in tensors:
                failed.setdefault(src.name, f"{file}: {_first_line(exc)}")
        finally:
            os.close(fd)
    ctx.unreadable = set(failed)
    if failed:
        details["unreadable"] = failed
        names = sorted(failed)
        raise CheckError(
            f"{len(failed)} tensor(s) unreadable: {failed[names[0]]}"
            + (f" (and {_short(names[1:])})" if len(names) > 1 else ""),
            kind="unreadable_tensor",
        )
    total = sum(src.nbytes for src in headers.tensors.values())
    details["bytes"] = total
    return f"{len(headers.tensors)} tensors, {total:,} bytes read through safetensors"


# --- sizes and checksums -----------------------------------------------------------------
def _conversion_record(ctx: _Context) -> ConversionRecord:
    """conversion.json through the one strict reader (model/record.py): a malformed tensor
    checksum is the checksums check's finding (74), anything else the sizes check's (73)."""
    path = ctx.root / CONVERSION_RECORD
    try:
        record = ConversionRecord.read(ctx.root, sha256=False)
    except FileNotFoundError:
        raise CheckError(
            f"{path}: missing (the converter writes every tensor's file, size and sha256 there)",
            kind="size_check",
            path=str(path),
        ) from None
    except OSError as exc:
        raise CheckError(f"{path}: unreadable ({_first_line(exc)})", kind="size_check", path=str(path)) from None
    except RecordError as exc:
        raise CheckError(str(exc), kind="size_check", path=str(path)) from None
    ctx.checksum_error = None
    try:  # the checksums check reports a malformed sha256 (and --fast skips it)
        ConversionRecord.read(ctx.root)
    except (OSError, RecordError) as exc:
        ctx.checksum_error = str(exc)
    return record


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _brief(value: Any) -> str:
    """A value quoted in a one-line reason, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _declared_total_size(ctx: _Context) -> Any:
    """The index's metadata.total_size (None when absent). The index check has read its
    weight_map through the inventory's reader; here only the metadata is looked at."""
    path = ctx.root / INDEX_NAME
    try:
        index = strictjson.loads(strictjson.read_record_bytes(path))
    except (OSError, strictjson.StrictJSONError) as exc:
        raise CheckError(f"{path}: unreadable ({_first_line(exc)})", kind="size_check", path=str(path)) from None
    metadata = index.get("metadata", {}) if isinstance(index, dict) else None
    if not isinstance(metadata, dict):
        raise CheckError(f"{path}: metadata is {_brief(metadata)}, not an object", kind="size_check", path=str(path))
    return metadata.get("total_size")


def check_sizes(ctx: _Context, details: dict[str, Any]) -> str:
    headers = ctx.need_headers()
    total = sum(src.nbytes for src in headers.tensors.values())
    declared = _declared_total_size(ctx)
    if not _is_int(declared) or declared != total:
        raise CheckError(
            f"{ctx.where(INDEX_NAME)}: metadata.total_size is {_brief(declared)} but the {len(headers.tensors)} "
            f"tensors hold {total:,} bytes",
            kind="size_check",
            path=str(ctx.where(INDEX_NAME)),
        )
    record = _conversion_record(ctx)
    listed = record.tensors
    missing = sorted(set(headers.tensors) - set(listed))
    if missing:
        raise CheckError(
            f"{ctx.where(CONVERSION_RECORD)}: does not list {len(missing)} tensor(s) the shards hold: "
            f"{_short(missing)}",
            kind="size_check",
            path=str(ctx.where(CONVERSION_RECORD)),
        )
    extra = sorted(set(listed) - set(headers.tensors))
    if extra:
        raise CheckError(
            f"{ctx.where(CONVERSION_RECORD)}: lists {len(extra)} tensor(s) no shard holds: "
            f"{_short([repr(n) for n in extra])}",
            kind="size_check",
            path=str(ctx.where(CONVERSION_RECORD)),
        )
    for name, src in sorted(headers.tensors.items()):
        entry = listed[name]
        if entry.file != src.file or entry.nbytes != src.nbytes:
            raise CheckError(
                f"{ctx.where(CONVERSION_RECORD)}: tensor {name}: recorded as {entry.nbytes!r} bytes in "
                f"{entry.file!r}, but it is {src.nbytes:,} bytes in {src.file}",
                kind="size_check",
                path=str(ctx.where(CONVERSION_RECORD)),
                tensor=name,
            )
    ctx.record = record
    details["total_size"] = total
    return (
        f"total_size {total:,} bytes = the tensors' sum; {CONVERSION_RECORD} lists the same {len(listed)} tensors, "
        "files and sizes"
    )


def check_checksums(ctx: _Context, details: dict[str, Any]) -> str:
    headers = ctx.need_headers()
    if ctx.fast:
        raise _Skipped(f"--fast: {len(headers.tensors)} tensors not hashed (sizes, names and files still checked)")
    if ctx.record is None:
        raise _Skipped(f"needs {CONVERSION_RECORD} with every tensor (sizes check failed)")
    if ctx.checksum_error is not None:
        raise CheckError(ctx.checksum_error, kind="checksum_mismatch", path=str(ctx.where(CONVERSION_RECORD)))
    listed = ctx.record.tensors  # each sha256 well-formed: the record's reader checked it
    wrong = sorted(n for n, h in ctx.hashes.items() if listed[n].sha256 != h)
    details.update(hashed=len(ctx.hashes), differ=wrong, unreadable=sorted(ctx.unreadable))
    if wrong:
        first = headers.tensors[wrong[0]]
        raise CheckError(
            f"{ctx.where(first.file)}: tensor {first.name}: sha256 differs from {CONVERSION_RECORD}"
            + (f" ({len(wrong)} tensors differ: {_short(wrong)})" if len(wrong) > 1 else ""),
            kind="checksum_mismatch",
        )
    note = f"; {len(ctx.unreadable)} unreadable tensor(s) not hashed" if ctx.unreadable else ""
    return f"{len(ctx.hashes)} tensors match {CONVERSION_RECORD}'s sha256{note}"


# --- config ------------------------------------------------------------------------------
EXPERT = re.compile(rf"\.ffn\.experts\.routed_experts\.(w13|w2)_(weight|{'|'.join(scale_params())})\Z")
NATIVE_EXPERT = re.compile(r"mtp\.\d+\.ffn\.experts\.(\d+)\.w[123]\.(weight|scale)\Z")
LAYER = re.compile(r"model\.layers\.(\d+)\.")
NATIVE_BLOCK = re.compile(r"mtp\.(\d+)\.")
ABSENT = "(absent)"


def _expert_dtype_of(name: str, dtype: str) -> tuple[str, ...] | None:
    """The expert_dtypes a routed-expert tensor may hold (mapping/README.md#mtp-parameters, model/storage.py):
    a native weight by its dtype (FP4: I8 packed, FP8: F8_E4M3), a layout weight by its container dtype and a
    layout scale by its name (FP4 `_weight_scale`, FP8 `_weight_scale_inv`); () for none."""
    native = NATIVE_EXPERT.match(name)
    if native is not None:
        return holding_native_weight(dtype) if native.group(2) == "weight" else None
    m = EXPERT.search(name)
    return None if m is None else holding_layout_tensor(m.group(2), dtype)


def _weight_of_scale(name: str, target: str) -> str | None:
    """The weight an FP8 block scale belongs to, in the layout's names."""
    if target == DRAFT_TARGET:
        return name.removesuffix(".scale") + ".weight" if name.endswith(".scale") else None
    return name.removesuffix("_scale_inv") if name.endswith("_scale_inv") else None


def _recorded_layout(ctx: _Context, where: str) -> tuple[str, str, str, str]:
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


def check_config(ctx: _Context, details: dict[str, Any]) -> str:
    where = ctx.where("config.json")
    if ctx.config is None or ctx.cfg is None:
        raise CheckError(str(ctx.config_error), kind="config_check", path=str(where))
    headers = ctx.need_headers()
    config, cfg = ctx.config, ctx.cfg
    table_name, table_version, target, field = _recorded_layout(ctx, where)
    try:
        table = load_table(table_name)
    except TableError as exc:
        raise CheckError(
            f"{where}: {field} {table_name!r} is not a table this tool has ({_first_line(exc)})",
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
    draft = target == DRAFT_TARGET
    if draft:  # native names: MTP block or DSpark stage mtp.{n}
        present = {int(m.group(1)) for name in headers.tensors if (m := NATIVE_BLOCK.match(name))}
        expected_layers = set(range(cfg.dspark_stages if cfg.is_dspark else cfg.num_nextn_predict_layers))
        meaning = (
            f"dspark_target_layer_ids ({len(cfg.dspark_target_layer_ids or ())} entries) means DSpark stage(s) "
            f"mtp.{sorted(expected_layers)}"
            if cfg.is_dspark
            else (
                f"num_nextn_predict_layers = {cfg.num_nextn_predict_layers} means MTP block(s) "
                f"mtp.{sorted(expected_layers)}"
            )
        )
        held = f"mtp.{sorted(present)}"
    else:
        present = {int(m.group(1)) for name in headers.tensors if (m := LAYER.match(name))}
        if cfg.is_dspark:  # the stages are an nn.ModuleList: model.layers.{s}, s < S
            expected_layers = set(range(cfg.dspark_stages))
            meaning = (
                f"dspark_target_layer_ids ({len(cfg.dspark_target_layer_ids or ())} entries) means DSpark stage "
                f"layer(s) {sorted(expected_layers)}"
            )
        else:
            expected_layers = {cfg.mtp_layer_index(i) for i in range(cfg.num_nextn_predict_layers)}
            meaning = (
                f"num_nextn_predict_layers = {cfg.num_nextn_predict_layers} and num_hidden_layers = "
                f"{cfg.num_hidden_layers} mean MTP layer(s) {sorted(expected_layers)}"
            )
        held = f"layer(s) {sorted(present)}"
    if present != expected_layers:
        raise CheckError(f"{where}: {meaning}, but the tensors hold {held}", kind="config_check", path=str(where))

    for name, src in sorted(headers.tensors.items()):
        implied = _expert_dtype_of(name, src.dtype)
        if implied is not None and cfg.expert_dtype not in implied:
            raise CheckError(
                f"{where}: expert_dtype is {cfg.expert_dtype!r} but {src.file}: tensor {name} ({src.dtype}) holds "
                f"{' or '.join(implied) or f'unknown ({src.dtype})'} experts",
                kind="config_check",
                path=str(where),
                tensor=name,
            )
    experts = {int(m.group(1)) for name in headers.tensors if (m := NATIVE_EXPERT.match(name))}
    if draft and experts != set(range(cfg.n_routed_experts)):
        raise CheckError(
            f"{where}: n_routed_experts = {cfg.n_routed_experts}, but the tensors hold routed experts "
            f"{min(experts, default=None)}..{max(experts, default=None)} ({len(experts)})",
            kind="config_check",
            path=str(where),
        )

    # an object or absent, its weight_block_size two integers in range: the config loader
    # (ctx.cfg) has checked both; only an FP8 config that names no block size is left
    quant = config.get("quantization_config")
    block = None
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        if "weight_block_size" not in quant:
            raise CheckError(
                f"{where}: quantization_config.weight_block_size is None, not two positive integers",
                kind="config_check",
                path=str(where),
            )
        block = list(cfg.weight_block_size)
        layout = layout_of(target, cfg)
        for name, src in sorted(headers.tensors.items()):
            weight = headers.tensors.get(_weight_of_scale(name, target) or "")
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
    if draft:  # vLLM reads architectures[0] and model_type before anything else (shared/spec/05 §5.2)
        for key in ("architectures", "model_type"):
            if key not in config:
                raise CheckError(
                    f"{where}: no {key}: vLLM 0.33.0 and SGLang 0.5.23 pick the draft model class from it",
                    kind="config_check",
                    path=str(where),
                )
        if not (
            isinstance(config["architectures"], list)
            and config["architectures"]
            and isinstance(config["architectures"][0], str)
        ):
            raise CheckError(
                f"{where}: architectures is {_brief(config['architectures'])}, not a list of class names",
                kind="config_check",
                path=str(where),
            )
    # a draft directory's config.json is the runtimes' (the source's, unchanged): the fields
    # they read must be those the conversion wrote (an xpu output's config is the bundled
    # model's, checked against the tensors above and by quant)
    if draft and ctx.record is not None and ctx.record.config_fields:
        for key in RUNTIME_CONFIG_FIELDS:
            was, now = ctx.record.config_fields.get(key, ABSENT), config.get(key, ABSENT)
            if was != now:
                raise CheckError(
                    f"{where}: {key} is {_brief(now)}, but the conversion wrote {_brief(was)} ({CONVERSION_RECORD} "
                    "config_fields; the runtimes read it)",
                    kind="config_check",
                    path=str(where),
                )
    what = (
        f"FP8 blocks {block}"
        if block
        else f"{quant.get('quant_method')} quantisation (names: see quant)"
        if isinstance(quant, dict)
        else "no quantization_config"
    )
    details.update(
        layout=target, table=table_name, table_version=table_version, drafter=drafter, mtp_layers=sorted(present)
    )
    ctx.target = target
    layers = (
        (f"DSpark stage(s) mtp.{sorted(present)}" if cfg.is_dspark else f"MTP block(s) mtp.{sorted(present)}")
        if draft
        else f"DSpark stage layer(s) {sorted(present)}"
        if cfg.is_dspark
        else f"MTP layer(s) {sorted(present)}"
    )
    return (
        f"converted to {target!r} with table {table_name} v{table_version}; {layers}; expert_dtype "
        f"{cfg.expert_dtype}; {what} agree with the tensors"
    )


# --- layout ------------------------------------------------------------------------------
def _layout_target(ctx: _Context) -> str:
    """The layout to hold the tensors against: the config check's finding, else what the
    records say (config.json's layout record, else conversion.json), else xpu."""
    if ctx.target is not None:
        return ctx.target
    try:
        return _recorded_layout(ctx, ctx.where("config.json"))[2]
    except CheckError as exc:
        if exc.kind != "config_check":
            raise
        return ctx.record.target if ctx.record is not None else "xpu"


def check_layout(ctx: _Context, details: dict[str, Any]) -> str:
    headers, cfg = ctx.need_headers(), ctx.need_config()
    target = _layout_target(ctx)
    want = layout_of(target, cfg)
    missing = sorted(set(want) - set(headers.tensors))
    unexpected = sorted(set(headers.tensors) - set(want))
    both = sorted(set(want) & set(headers.tensors))
    shape = [
        f"{n} is {list(headers.tensors[n].shape)} in {headers.tensors[n].file}, expected {list(want[n][1])}"
        for n in both
        if headers.tensors[n].shape != want[n][1]
    ]
    dtype = [
        f"{n} is {headers.tensors[n].dtype} in {headers.tensors[n].file}, expected {want[n][0]}"
        for n in both
        if headers.tensors[n].dtype != want[n][0]
    ]
    details.update(missing=missing, unexpected=unexpected, shape=shape, dtype=dtype)
    findings: list[tuple[Callable[..., CheckError], str]] = []
    if missing:
        findings.append((partial(CheckError, kind="missing_tensors"), f"{len(missing)} missing: {_short(missing)}"))
    if unexpected:
        findings.append(
            (
                partial(CheckError, kind="unexpected_tensors"),
                f"{len(unexpected)} unexpected: {_short([f'{n} in {headers.tensors[n].file}' for n in unexpected])}",
            )
        )
    if shape:
        findings.append((partial(CheckError, kind="tensor_shape"), f"{len(shape)} mis-shaped: {_short(shape)}"))
    if dtype:
        findings.append((partial(CheckError, kind="tensor_dtype"), f"{len(dtype)} of the wrong dtype: {_short(dtype)}"))
    if findings:
        raise findings[0][0](
            f"{ctx.where(INDEX_NAME)}: not the {cfg.expert_dtype} {target} layout: "
            + "; ".join(text for _, text in findings)
        )
    return f"all {len(want)} tensors of the {target} layout present with their shapes and dtypes, nothing else"


# --- quantisation ------------------------------------------------------------------------
def check_quant(ctx: _Context, details: dict[str, Any]) -> str:
    cfg = ctx.need_config()
    assert ctx.config is not None  # a parsed cfg implies a parsed config.json
    config = ctx.config
    if _layout_target(ctx) == DRAFT_TARGET:
        # native module names: the quantisation layer names are those of the xpu conversion
        # of this directory, whose config.json the converter rewrites (convert/quant_config.py)
        from dsv4.convert.inmemory import xpu_plan
        from dsv4.convert.pipeline import output_config

        try:
            config = output_config(xpu_plan(ctx.root))
        except DSV4Error as exc:
            if exc.kind == "quant_carry":  # the xpu conversion would refuse this quantization_config
                raise CheckError(str(exc), kind="quant_scheme") from None
            raise _Skipped(f"needs the xpu plan of this draft directory: {_first_line(exc)}") from None
    summary = check_draft_quantization(build_draft_model(cfg), config, ctx.where("config.json"))
    if summary.library_missing:
        raise _Skipped(summary.reason)
    details.update(layers=summary.layers, schemes_checked=summary.schemes_checked)
    return summary.reason


# --- smoke and native parity -------------------------------------------------------------
def check_smoke(ctx: _Context, details: dict[str, Any]) -> str:
    if not (ctx.smoke or ctx.native):
        raise _Skipped("not requested (--smoke or --native)")
    if "layout" not in ctx.passed:
        raise _Skipped("needs the target layout (layout check failed): a strict load would fail")
    from dsv4.convert.inmemory import model_loader
    from dsv4.model.smoke import run_dspark_smoke, run_smoke  # imports the reference and kernels: only here

    dspark = ctx.need_config().is_dspark
    try:
        load = model_loader(ctx.root)  # a draft directory (native names): the xpu plan, in memory
        # DSpark: one draft block from a context of `tokens` random target features
        report = (
            run_dspark_smoke(ctx.root, ctx.device, ctx.tokens, reference_dir=ctx.native, load=load)
            if dspark
            else run_smoke(ctx.root, ctx.device, ctx.tokens, ctx.native, load=load)
        )
    except Exception as exc:  # a failed load or forward, whatever raised it, is this check's finding
        interrupts.raise_if_interrupted()
        said = _first_line(exc)
        raise CheckError(said if str(ctx.root) in said else f"{ctx.root}: {said}", kind="smoke_failed") from None
    ctx.smoke_report = report
    if dspark:
        details.update(
            {
                k: report[k]
                for k in (
                    "device",
                    "kernels",
                    "hidden_shape",
                    "logits_shape",
                    "draft_tokens",
                    "load_ms",
                    "hidden_warm_ms",
                    "logits_warm_ms",
                )
            }
        )
        return (
            f"strict load and one DSpark block ({ctx.tokens}-token context) on {report['device']}: hidden "
            f"{report['hidden_shape']}, logits {report['logits_shape']}, draft tokens {report['draft_tokens']}, "
            f"finite; fused norms: {report['kernels']}"
        )
    details.update(
        {k: report[k] for k in ("device", "kernels", "hidden_shape", "logits_shape", "load_ms", "forward_warm_ms")}
    )
    return (
        f"strict load and {ctx.tokens}-token forward on {report['device']}: hidden {report['hidden_shape']}, logits "
        f"{report['logits_shape']}, finite; fused norms: {report['kernels']}"
    )


def check_native(ctx: _Context, details: dict[str, Any]) -> str:
    if ctx.native is None:
        raise _Skipped("not requested (--native SRC)")
    if ctx.smoke_report is None:
        raise _Skipped("needs the smoke run (smoke check failed or was skipped)")
    passed, said = parity_verdict(ctx.smoke_report, ctx.min_top1, ctx.max_rel_diff)  # the rule of `smoke --native`
    details.update({k: v for k, v in ctx.smoke_report.items() if k in PARITY_DETAILS})
    if not passed:
        raise CheckError(
            f"{ctx.root}: differs from the reference on {ctx.native}: {said}", kind="native_parity", path=str(ctx.root)
        )
    return f"agrees with the reference on {ctx.native}: {said}"


PARITY_DETAILS = (
    "hidden_max_abs_diff",
    "hidden_max_abs",
    "logits_max_abs_diff",
    "logits_max_abs",
    "top1_agreement",
    "top1_agreement_up_to_ties",
    "routing_disagreements",
    "draft_tokens",
    "reference_draft_tokens",
    "draft_token_agreement",
)


# --- serve --------------------------------------------------------------------------------
# vLLM 0.33.0 builds a draft's layers from the TARGET's config and quantisation config
# (model_loader/utils.py:93-101 with the target's vllm_config; xpu/mtp.py:76, 89, 97, 176-178;
# speculative.py:1564-1566 gives a V4 DSpark draft the target's quantisation method): every
# field the layers are built from must be the draft's own. NOTES.md, "Serving a draft".
def _serve_fields() -> tuple[str, ...]:
    model_fields = sorted({f.name for f in fields(ModelConfig)} - set(RUNTIME_CONFIG_FIELDS))
    return (*RUNTIME_CONFIG_FIELDS, *model_fields)


def check_serve(ctx: _Context, details: dict[str, Any]) -> str:
    if ctx.serve_with is None:
        raise _Skipped("not requested (--serve-with TARGET)")
    if ctx.config is None:
        raise _Skipped(f"needs the draft's config.json: {ctx.config_error}")
    if _layout_target(ctx) != DRAFT_TARGET:
        raise _Skipped(
            f"only a --target {DRAFT_TARGET} output is served beside a target model (this one is "
            f"{_layout_target(ctx)!r})"
        )
    where = ctx.serve_with / "config.json" if ctx.serve_with.is_dir() else ctx.serve_with
    try:
        target = parse_config(where.read_bytes(), str(where))
    except (OSError, DSV4Error) as exc:  # a config error names `where` already: said once
        raise CheckError(
            f"{where}: cannot read the target's config: {_first_line(exc).removeprefix(f'{where}: ')}",
            kind="serve_mismatch",
            path=str(where),
        ) from None
    for key in _serve_fields():
        mine, theirs = ctx.config.get(key, ABSENT), target.get(key, ABSENT)
        if isinstance(mine, dict) and isinstance(theirs, dict):  # name the first sub-field that differs
            sub = next(
                (k for k in sorted(mine.keys() | theirs.keys()) if mine.get(k, ABSENT) != theirs.get(k, ABSENT)), None
            )
            key, mine, theirs = (
                (f"{key}.{sub}", mine.get(sub, ABSENT), theirs.get(sub, ABSENT)) if sub else (key, mine, theirs)
            )
        if mine != theirs:
            details.update(field=key)
            raise CheckError(
                f"{where}: {key} is {_brief(theirs)}, the draft's is {_brief(mine)}: vLLM 0.33.0 builds the draft's "
                "layers from the "
                "target's config and quantisation, so this draft would not load beside it (serve it beside the "
                "checkpoint it was converted from)",
                kind="serve_mismatch",
                path=str(where),
                field=key,
            )
    # and each draft module holds what the scheme the target gives it takes (convert/schemes/)
    from dsv4.convert.inmemory import xpu_plan
    from dsv4.convert.schemes.registry import check_draft_served

    try:
        plan = xpu_plan(ctx.root)
    except DSV4Error as exc:
        raise _Skipped(f"needs the xpu plan of this draft directory: {_first_line(exc)}") from None
    have = {name: (t.dtype, tuple(t.shape)) for name, t in ctx.need_headers().tensors.items()}
    served = check_draft_served(target, plan, have, str(where), partial(CheckError, kind="serve_mismatch"))
    return (
        f"{where}: the {len(_serve_fields())} config fields vLLM builds the draft's layers from (quantization_config "
        f"included) are the draft's own; {served}"
    )


# each check returns its one-line reason and may fill `details` (kept on failure too)
CHECKS: tuple[tuple[str, Callable[[_Context, dict[str, Any]], str]], ...] = (
    ("index", check_index),
    ("readable", check_readable),
    ("sizes", check_sizes),
    ("checksums", check_checksums),
    ("config", check_config),
    ("layout", check_layout),
    ("quant", check_quant),
    ("smoke", check_smoke),
    ("native", check_native),
    ("serve", check_serve),
)


def _load_config(ctx: _Context) -> None:
    """config.json through the model's validating loader, as plan, convert and smoke read it;
    a refusal is the config check's finding (75) and the checks needing a config skip."""
    try:
        ctx.config = ctx.checkpoint.config
        ctx.cfg = ctx.checkpoint.model_config
    except DSV4Error as exc:  # missing_config, malformed_config, unsupported_layout
        ctx.config_error = str(exc)


def run_checks(
    path: str | Path,
    *,
    native: str | Path | None = None,
    smoke: bool = False,
    fast: bool = False,
    device: str = "cpu",
    tokens: int = SMOKE_TOKENS,
    min_top1: float = MIN_TOP1,
    max_rel_diff: float = MAX_REL_DIFF,
    serve_with: str | Path | None = None,
    quiet: bool = True,
) -> CheckReport:
    """Run every check on the converted checkpoint at `path` and return the report (never
    raises for a failed check; `report.raise_for_failure()` does). `native` (the checkpoint
    it was converted from) implies the smoke run, which then also runs the reference.
    `serve_with` (the target model's directory or config.json) checks that a draft
    directory would load beside it in vLLM. Unless `quiet`, a bar over the checks
    (convert/progress.py's rule)."""
    ctx = _Context(
        Path(path),
        fast,
        smoke,
        Path(native) if native is not None else None,
        device,
        tokens,
        min_top1,
        max_rel_diff,
        serve_with=Path(serve_with) if serve_with is not None else None,
    )
    _load_config(ctx)
    results = []
    bar = progress.bar(len(CHECKS), "check", "check", quiet)
    for name, check in CHECKS:
        bar.set_postfix_str(name)
        start = time.monotonic()
        details: dict[str, Any] = {}
        try:
            result = CheckResult(name, "pass", check(ctx, details))
            ctx.passed.add(name)
        except _Skipped as skip:
            result = CheckResult(name, "skip", str(skip))
        except CheckError as exc:
            result = CheckResult(name, "fail", str(exc), exit_code(exc), exc)
        result.details = details
        result.seconds = time.monotonic() - start
        results.append(result)
        bar.update()
    bar.close()
    return CheckReport(str(ctx.root), results)
