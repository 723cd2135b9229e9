"""The source inventory: every tensor of a checkpoint, from safetensors headers alone.

safetensors' Python API opens a file to read tensors but does not expose where each
tensor's bytes lie; the converter needs exactly that (to read only the byte ranges the
plan names), so the header is parsed here: an 8-byte little-endian length, then JSON.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4.convert.dtypes import ITEMSIZE, nbytes
from dsv4.convert.errors import (
    DuplicateTensorError,
    IndexMismatchError,
    MalformedHeaderError,
    MissingConfigError,
    MissingShardError,
    TruncatedShardError,
    UnknownDtypeError,
    UnsafeShardPathError,
    config_errors,
)
from dsv4.model.config import parse_config

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on a header's size


@dataclass(frozen=True)
class TensorSource:
    """Where one tensor's bytes lie: [start, end) of `file`, absolute offsets."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Inventory:
    """A checkpoint as headers describe it. `location` is a directory or a hub repo."""

    location: str
    config: dict[str, Any]
    tensors: dict[str, TensorSource]
    file_sizes: dict[str, int]
    header_bytes: int = 0  # bytes read to build this inventory
    revision: str | None = None  # resolved commit, for hub sources
    extra: dict[str, Any] = field(default_factory=dict)


def parse_header(raw_len: bytes, read_header: Callable[[int], bytes], file: str, file_size: int) -> tuple[dict[str, Any], int]:
    """Decode a safetensors header; returns (header dict, bytes before the data section)."""
    if len(raw_len) != 8:
        raise TruncatedShardError(f"{file}: shorter than a safetensors header ({file_size} bytes)")
    (n,) = struct.unpack("<Q", raw_len)
    if n > MAX_HEADER or 8 + n > file_size:
        raise TruncatedShardError(f"{file}: header claims {n} bytes but the file has {file_size}")
    raw = read_header(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedHeaderError(f"{file}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise MalformedHeaderError(f"{file}: header is not a JSON object")
    return header, 8 + n


def tensors_from_header(header: Mapping[str, Any], file: str, data_start: int, file_size: int) -> dict[str, TensorSource]:
    out: dict[str, TensorSource] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise MalformedHeaderError(f"{file}: tensor {name}: entry lacks dtype/shape/data_offsets") from None
        if dtype not in ITEMSIZE:
            raise UnknownDtypeError(f"{file}: tensor {name}: unknown dtype {dtype}")
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi) or hi - lo != nbytes(dtype, shape):
            raise MalformedHeaderError(f"{file}: tensor {name}: data_offsets {lo}..{hi} do not fit {dtype}{list(shape)}")
        if data_start + hi > file_size:
            raise TruncatedShardError(f"{file}: tensor {name}: bytes {data_start + lo}..{data_start + hi} lie past the end of the file ({file_size} bytes)")
        out[name] = TensorSource(name, file, dtype, shape, data_start + lo, data_start + hi)
    return out


def read_local_header(path: Path) -> tuple[dict[str, TensorSource], int]:
    """Tensors of one local shard and the header bytes read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header, data_start = parse_header(f.read(8), f.read, path.name, size)
    return tensors_from_header(header, path.name, data_start, size), data_start


def check_shard_name(name: str, index_file: str) -> None:
    """Index entries name plain files inside the checkpoint, nothing else."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or os.path.isabs(name):
        raise UnsafeShardPathError(f"{index_file}: shard name {name!r} is not a plain file name inside the checkpoint")


def merge_shards(location: str, weight_map: Mapping[str, str] | None, shards: Iterable[tuple[str, dict[str, TensorSource]]]) -> dict[str, TensorSource]:
    """Union of per-shard tensors, checked against the index's weight map."""
    tensors: dict[str, TensorSource] = {}
    for file, found in shards:
        for name, src in found.items():
            if name in tensors:
                raise DuplicateTensorError(f"{location}: tensor {name} is in both {tensors[name].file} and {file}")
            if weight_map is not None and name not in weight_map:
                raise IndexMismatchError(f"{file}: tensor {name} is not listed in {INDEX_NAME}")
            if weight_map is not None and weight_map[name] != file:
                raise IndexMismatchError(f"{file}: tensor {name} is listed in {INDEX_NAME} under {weight_map[name]}")
            tensors[name] = src
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors:
                raise IndexMismatchError(f"{file}: tensor {name} is listed in {INDEX_NAME} but not in the shard's header")
    return tensors


def load_index(raw: bytes, index_file: str) -> dict[str, str]:
    try:
        index = json.loads(raw)
        weight_map = index["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise MalformedHeaderError(f"{index_file}: not a safetensors index (JSON with a weight_map)") from None
    if not isinstance(weight_map, dict):
        raise MalformedHeaderError(f"{index_file}: weight_map is not an object")
    for shard in set(weight_map.values()):
        check_shard_name(shard, index_file)
    return weight_map


@dataclass(frozen=True)
class LocalShard:
    file: str
    tensors: dict[str, TensorSource]
    data_start: int  # bytes before the data section: what reading the header cost
    size: int


def read_local_shards(root: Path, weight_map: Mapping[str, str] | None, files: list[str]) -> list[LocalShard]:
    """The headers of `files` in checkpoint directory `root`: each must exist and resolve
    to a file inside `root` (a symlink may not lead elsewhere)."""
    real_root = root.resolve()
    out = []
    for file in files:
        shard = root / file
        if not shard.is_file():
            named = sorted(n for n, f in (weight_map or {}).items() if f == file)
            what = f" for {named[0]}" + (f" and {len(named) - 1} more tensors" if len(named) > 1 else "") if named else ""
            raise MissingShardError(f"{shard}: named in {INDEX_NAME}{what} but does not exist")
        if shard.resolve().parent != real_root:
            raise UnsafeShardPathError(f"{shard}: resolves to {shard.resolve()}, outside the checkpoint directory")
        found, data_start = read_local_header(shard)
        out.append(LocalShard(file, found, data_start, shard.stat().st_size))
    return out


def read_inventory(path: str | Path) -> Inventory:
    """Open a local checkpoint directory (index + shards, or one model.safetensors),
    reading only config.json, the index and each shard's header."""
    root = Path(path)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise MissingConfigError(f"{config_path}: no config.json in the checkpoint directory")
    try:
        raw_config = config_path.read_bytes()
    except OSError as exc:
        raise MissingConfigError(f"{config_path}: cannot be read ({exc.strerror})") from None
    with config_errors(str(config_path)):
        config = parse_config(raw_config)

    index_path = root / INDEX_NAME
    if index_path.is_file():
        weight_map: dict[str, str] | None = load_index(index_path.read_bytes(), INDEX_NAME)
        files = sorted(set(weight_map.values()))
    elif (root / SINGLE_FILE).is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise MissingShardError(f"{root}: neither {INDEX_NAME} nor {SINGLE_FILE} found")

    shards = read_local_shards(root, weight_map, files)
    file_sizes = {s.file: s.size for s in shards}
    header_bytes = sum(s.data_start for s in shards)
    tensors = merge_shards(str(root), weight_map, [(s.file, s.tensors) for s in shards])
    return Inventory(str(root), config, tensors, file_sizes, header_bytes)
