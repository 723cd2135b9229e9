"""The checks of `convert-dsv4 check` on the files themselves (convert/check/run.py has the order):
index (the index and the shard headers agree and tile their files), readable (every tensor
reads through safetensors, in bounded row blocks), sizes (the index's total_size and
conversion.json's files and sizes match the shards) and checksums (every tensor's sha256
matches conversion.json; one pass over the data with readable)."""

from __future__ import annotations

import errno
import hashlib
import os
from functools import cache
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dsv4.convert import interrupts
from dsv4.convert.check.context import Context, Skipped, first_line, short
from dsv4.convert.errors import CheckError
from dsv4.model import strictjson
from dsv4.model.checkpoint import INDEX_NAME
from dsv4.model.dtypes import tensor_bytes
from dsv4.model.errors import DSV4Error
from dsv4.model.record import CONVERSION_RECORD, ConversionRecord, RecordError, brief, is_int
from dsv4.model.safetensors_header import TensorBytes

READ_BLOCK = 64 << 20  # bytes per read of one tensor: bounded memory at any tensor size


# --- index -------------------------------------------------------------------------------
def check_index(ctx: Context, details: dict[str, Any]) -> str:
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


def check_readable(ctx: Context, details: dict[str, Any]) -> str:
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
                        failed[src.name] = f"{file}: tensor {src.name}: {first_line(exc)}"
                        continue
                    if digest is not None:
                        ctx.hashes[src.name] = digest.hexdigest()
        except Exception as exc:  # safetensors refusing the whole file
            interrupts.raise_if_interrupted()
            for src in tensors:
                failed.setdefault(src.name, f"{file}: {first_line(exc)}")
        finally:
            os.close(fd)
    ctx.unreadable = set(failed)
    if failed:
        details["unreadable"] = failed
        names = sorted(failed)
        raise CheckError(
            f"{len(failed)} tensor(s) unreadable: {failed[names[0]]}"
            + (f" (and {short(names[1:])})" if len(names) > 1 else ""),
            kind="unreadable_tensor",
        )
    total = sum(src.nbytes for src in headers.tensors.values())
    details["bytes"] = total
    return f"{len(headers.tensors)} tensors, {total:,} bytes read through safetensors"


# --- sizes and checksums -----------------------------------------------------------------
def _conversion_record(ctx: Context) -> ConversionRecord:
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
        raise CheckError(f"{path}: unreadable ({first_line(exc)})", kind="size_check", path=str(path)) from None
    except RecordError as exc:
        raise CheckError(str(exc), kind="size_check", path=str(path)) from None
    ctx.checksum_error = None
    try:  # the checksums check reports a malformed sha256 (and --fast skips it)
        ConversionRecord.read(ctx.root)
    except (OSError, RecordError) as exc:
        ctx.checksum_error = str(exc)
    return record


def _declared_total_size(ctx: Context) -> Any:
    """The index's metadata.total_size (None when absent). The index check has read its
    weight_map through the inventory's reader; here only the metadata is looked at."""
    path = ctx.root / INDEX_NAME
    try:
        index = strictjson.loads(strictjson.read_record_bytes(path))
    except (OSError, strictjson.StrictJSONError) as exc:
        raise CheckError(f"{path}: unreadable ({first_line(exc)})", kind="size_check", path=str(path)) from None
    metadata = index.get("metadata", {}) if isinstance(index, dict) else None
    if not isinstance(metadata, dict):
        raise CheckError(f"{path}: metadata is {brief(metadata)}, not an object", kind="size_check", path=str(path))
    return metadata.get("total_size")


def check_sizes(ctx: Context, details: dict[str, Any]) -> str:
    headers = ctx.need_headers()
    total = sum(src.nbytes for src in headers.tensors.values())
    declared = _declared_total_size(ctx)
    if not is_int(declared) or declared != total:
        raise CheckError(
            f"{ctx.where(INDEX_NAME)}: metadata.total_size is {brief(declared)} but the {len(headers.tensors)} "
            f"tensors hold {total:,} bytes",
            kind="size_check",
            path=str(ctx.where(INDEX_NAME)),
        )
    record = _conversion_record(ctx)
    listed = record.tensors
    missing = sorted(set(headers.tensors) - set(listed))
    if missing:
        raise CheckError(
            f"{ctx.where(CONVERSION_RECORD)}: does not list {len(missing)} tensor(s) the shards hold: {short(missing)}",
            kind="size_check",
            path=str(ctx.where(CONVERSION_RECORD)),
        )
    extra = sorted(set(listed) - set(headers.tensors))
    if extra:
        raise CheckError(
            f"{ctx.where(CONVERSION_RECORD)}: lists {len(extra)} tensor(s) no shard holds: "
            f"{short([repr(n) for n in extra])}",
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


def check_checksums(ctx: Context, details: dict[str, Any]) -> str:
    headers = ctx.need_headers()
    if ctx.fast:
        raise Skipped(f"--fast: {len(headers.tensors)} tensors not hashed (sizes, names and files still checked)")
    if ctx.record is None:
        raise Skipped(f"needs {CONVERSION_RECORD} with every tensor (sizes check failed)")
    if ctx.checksum_error is not None:
        raise CheckError(ctx.checksum_error, kind="checksum_mismatch", path=str(ctx.where(CONVERSION_RECORD)))
    listed = ctx.record.tensors  # each sha256 well-formed: the record's reader checked it
    wrong = sorted(n for n, h in ctx.hashes.items() if listed[n].sha256 != h)
    details.update(hashed=len(ctx.hashes), differ=wrong, unreadable=sorted(ctx.unreadable))
    if wrong:
        first = headers.tensors[wrong[0]]
        raise CheckError(
            f"{ctx.where(first.file)}: tensor {first.name}: sha256 differs from {CONVERSION_RECORD}"
            + (f" ({len(wrong)} tensors differ: {short(wrong)})" if len(wrong) > 1 else ""),
            kind="checksum_mismatch",
        )
    note = f"; {len(ctx.unreadable)} unreadable tensor(s) not hashed" if ctx.unreadable else ""
    return f"{len(ctx.hashes)} tensors match {CONVERSION_RECORD}'s sha256{note}"
