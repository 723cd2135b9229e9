"""The source inventory: every tensor of a checkpoint, from safetensors headers alone.

safetensors' Python API opens a file to read tensors but does not expose where each
tensor's bytes lie; the converter needs exactly that (to read only the byte ranges the
plan names), so the header is parsed here: an 8-byte little-endian length, then JSON.

Parsing it here must not make the tool laxer than safetensors: a header that library
refuses would otherwise convert into wrong tensors (a duplicate name, or two tensors
sharing bytes). So every rule of safetensors' reader (its Rust `read_metadata` and
`Metadata::validate`) is applied, before any tensor byte is read, and a few more:
  - the header is at most MAX_HEADER bytes, strict JSON (model/strictjson: no duplicate
    key, bounded nesting and integers), an object;
  - `__metadata__` maps strings to strings (null is refused too);
  - each tensor entry has exactly dtype, shape, data_offsets (no unknown field); shape
    and offsets are integers in 0..2**64-1 and their products do not overflow 64 bits;
  - sorted by offset, the tensors tile the data section exactly: the first starts at 0,
    each starts where the previous ends (no overlap, no gap), the last ends at the end of
    the file (bytes after it are refused, as safetensors refuses them).
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4.model import strictjson
from dsv4.model.checkpoint import INDEX_NAME, SINGLE_FILE, json_kind, load_index
from dsv4.model.config import config_errors, parse_config
from dsv4.model.dtypes import ITEMSIZE
from dsv4.model.errors import CheckpointError

MAX_HEADER = 100_000_000  # safetensors' MAX_HEADER_SIZE, in bytes (not MiB): it refuses a longer header
U64_MAX = 2**64 - 1  # safetensors reads shapes and offsets as 64-bit sizes
ENTRY_FIELDS = ("dtype", "shape", "data_offsets")
ENTRY_KEYS = frozenset(ENTRY_FIELDS)


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
    config_bytes: bytes = b""  # config.json as read (a draft directory keeps it byte for byte)
    extra: dict[str, Any] = field(default_factory=dict)


def parse_header(
    raw_len: bytes, read_header: Callable[[int], bytes], file: str, file_size: int
) -> tuple[dict[str, Any], int]:
    """Decode a safetensors header; returns (header dict, bytes before the data section).
    `read_header(n)` is called only once the length is known to be within the limit."""
    if len(raw_len) != 8:
        raise CheckpointError(
            f"{file}: shorter than a safetensors header ({file_size} bytes)", kind="truncated_shard", path=str(file)
        )
    (n,) = struct.unpack("<Q", raw_len)
    if n > MAX_HEADER:
        raise CheckpointError(
            f"{file}: header of {n:,} bytes exceeds the {MAX_HEADER:,}-byte limit on a safetensors header (safetensors refuses it too)",
            kind="malformed_header",
            path=str(file),
        )
    if 8 + n > file_size:
        raise CheckpointError(
            f"{file}: header claims {n} bytes but the file has {file_size}", kind="truncated_shard", path=str(file)
        )
    raw = read_header(n)
    if len(raw) != n:
        raise CheckpointError(
            f"{file}: header claims {n} bytes but only {len(raw)} could be read", kind="truncated_shard", path=str(file)
        )
    try:
        # tensors_from_header checks every entry's shape (depth 3 at most), so the generic
        # nesting walk, which costs more than the parse itself here, is left out
        header = strictjson.loads(raw, walk_depth=False)
    except strictjson.StrictJSONError as exc:
        raise CheckpointError(
            f"{file}: header is not valid JSON ({exc})", kind="malformed_header", path=str(file)
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{file}: header is {json_kind(header)}, not a JSON object", kind="malformed_header", path=str(file)
        )
    return header, 8 + n


def _utf8(text: str) -> bool:
    """Python's json decodes a lone surrogate escape ("\\ud800") into a str that is not
    Unicode; safetensors' JSON reader refuses it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_metadata(metadata: Any, file: str) -> None:
    if not isinstance(metadata, dict):
        raise CheckpointError(
            f"{file}: __metadata__ is {json_kind(metadata)}, not an object of strings",
            kind="malformed_header",
            path=str(file),
        )
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise CheckpointError(
                f"{file}: __metadata__[{key!r}] is {json_kind(value)}, not a string",
                kind="malformed_header",
                path=str(file),
            )
        if not (_utf8(key) and _utf8(value)):
            raise CheckpointError(
                f"{file}: __metadata__[{key!r}] is not valid Unicode", kind="malformed_header", path=str(file)
            )


def _tensor_entry(name: str, entry: Any, file: str, data_start: int) -> TensorSource:
    """One header entry, every field checked as safetensors checks it (or more strictly).
    Written as plain loops: a Flash checkpoint has 69,187 entries."""
    where = f"{file}: tensor {name}"
    if not (name.isascii() or _utf8(name)):
        raise CheckpointError(
            f"{file}: tensor {name!r}: the name is not valid Unicode", kind="malformed_header", path=str(file)
        )
    if not isinstance(entry, dict):
        raise CheckpointError(
            f"{where}: entry is {json_kind(entry)}, not an object", kind="malformed_header", path=str(where)
        )
    if entry.keys() != ENTRY_KEYS:
        missing = [f for f in ENTRY_FIELDS if f not in entry]
        if missing:
            raise CheckpointError(f"{where}: entry lacks {'/'.join(missing)}", kind="malformed_header", path=str(where))
        unknown = sorted(set(entry) - ENTRY_KEYS)
        raise CheckpointError(
            f"{where}: unknown field {unknown[0]!r} in its entry (a safetensors entry has {', '.join(ENTRY_FIELDS)})",
            kind="malformed_header",
            path=str(where),
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: dtype {dtype!r} is not a string", kind="malformed_header", path=str(where))
    if dtype not in ITEMSIZE:
        raise CheckpointError(f"{where}: unknown dtype {dtype}", kind="unknown_dtype", path=str(where))
    if type(shape) is not list:
        raise CheckpointError(
            f"{where}: shape {shape!r} is not a list of non-negative integers", kind="malformed_header", path=str(where)
        )
    elements = 1
    for d in shape:  # safetensors multiplies left to right and refuses any overflow on the way
        if type(d) is not int or not 0 <= d <= U64_MAX:  # bool is an int to Python, not to JSON
            raise CheckpointError(
                f"{where}: shape {shape!r} is not a list of non-negative integers",
                kind="malformed_header",
                path=str(where),
            )
        elements *= d
        if elements > U64_MAX:
            raise CheckpointError(f"{where}: shape {shape} overflows 64 bits", kind="malformed_header", path=str(where))
    size = elements * ITEMSIZE[dtype]
    if size * 8 > U64_MAX:  # safetensors counts bits
        raise CheckpointError(
            f"{where}: shape {shape} of {dtype} overflows 64 bits", kind="malformed_header", path=str(where)
        )
    if not (type(offsets) is list and len(offsets) == 2 and all(type(o) is int and 0 <= o <= U64_MAX for o in offsets)):
        raise CheckpointError(
            f"{where}: data_offsets {offsets!r} is not a pair of non-negative integers",
            kind="malformed_header",
            path=str(where),
        )
    lo, hi = offsets
    if hi - lo != size:
        raise CheckpointError(
            f"{where}: data_offsets [{lo}, {hi}] do not fit {dtype}{shape}", kind="malformed_header", path=str(where)
        )
    return TensorSource(name, file, dtype, tuple(shape), data_start + lo, data_start + hi)


def _check_tiling(tensors: Iterable[TensorSource], file: str, data_start: int, file_size: int) -> None:
    """safetensors' rule for the data section: sorted by offset, the tensors cover it
    exactly, from its start to the end of the file; no byte is shared or owned by none."""
    at, previous = data_start, None
    for src in sorted(tensors, key=lambda s: (s.start, s.end)):
        lo, hi = src.start - data_start, src.end - data_start
        if previous is not None and src.start < previous.end:
            raise CheckpointError(
                f"{file}: tensor {src.name}: data_offsets [{lo}, {hi}] overlap tensor {previous.name}'s [{previous.start - data_start}, {previous.end - data_start}]",
                kind="malformed_header",
                path=str(file),
                tensor=src.name,
            )
        if src.start > at:
            raise CheckpointError(
                f"{file}: data bytes {at - data_start}..{lo} before tensor {src.name} belong to no tensor",
                kind="malformed_header",
                path=str(file),
                tensor=src.name,
            )
        if src.end > file_size:
            raise CheckpointError(
                f"{file}: tensor {src.name}: bytes {src.start}..{src.end} lie past the end of the file ({file_size} bytes)",
                kind="truncated_shard",
                path=str(file),
                tensor=src.name,
            )
        at, previous = src.end, src
    if at != file_size:
        raise CheckpointError(
            f"{file}: data bytes {at - data_start}..{file_size - data_start} after the last tensor belong to no tensor (safetensors refuses such a file)",
            kind="malformed_header",
            path=str(file),
        )


def tensors_from_header(
    header: Mapping[str, Any], file: str, data_start: int, file_size: int
) -> dict[str, TensorSource]:
    """The tensors a parsed header describes, once the whole header has been validated."""
    out: dict[str, TensorSource] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            _check_metadata(entry, file)
        else:
            out[name] = _tensor_entry(name, entry, file, data_start)
    _check_tiling(out.values(), file, data_start, file_size)
    return out


def read_local_header(path: Path) -> tuple[dict[str, TensorSource], int]:
    """Tensors of one local shard and the header bytes read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header, data_start = parse_header(f.read(8), f.read, path.name, size)
    return tensors_from_header(header, path.name, data_start, size), data_start


def merge_shards(
    location: str, weight_map: Mapping[str, str] | None, shards: Iterable[tuple[str, dict[str, TensorSource]]]
) -> dict[str, TensorSource]:
    """Union of per-shard tensors, checked against the index's weight map."""
    tensors: dict[str, TensorSource] = {}
    for file, found in shards:
        for name, src in found.items():
            if name in tensors:
                raise CheckpointError(
                    f"{location}: tensor {name} is in both {tensors[name].file} and {file}",
                    kind="duplicate_tensor",
                    path=str(location),
                    tensor=name,
                )
            if weight_map is not None and name not in weight_map:
                raise CheckpointError(
                    f"{file}: tensor {name} is not listed in {INDEX_NAME}",
                    kind="index_mismatch",
                    path=str(file),
                    tensor=name,
                )
            if weight_map is not None and weight_map[name] != file:
                raise CheckpointError(
                    f"{file}: tensor {name} is listed in {INDEX_NAME} under {weight_map[name]}",
                    kind="index_mismatch",
                    path=str(file),
                    tensor=name,
                )
            tensors[name] = src
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors:
                raise CheckpointError(
                    f"{file}: tensor {name} is listed in {INDEX_NAME} but not in the shard's header",
                    kind="index_mismatch",
                    path=str(file),
                    tensor=name,
                )
    return tensors


@dataclass(frozen=True)
class LocalShard:
    file: str
    tensors: dict[str, TensorSource]
    data_start: int  # bytes before the data section: what reading the header cost
    size: int


def not_a_regular_file(path: Path) -> str | None:
    """The refusal for a `path` that exists but is no regular file (a directory, a FIFO...),
    so that it is not reported as missing; None for a regular file or nothing there."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a fifo"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    kind = next((name for test, name in kinds if test(mode)), "not a file")
    return f"{path}: is {kind}, not a regular file"


def read_local_shards(root: Path, weight_map: Mapping[str, str] | None, files: list[str]) -> list[LocalShard]:
    """The headers of `files` in checkpoint directory `root`: each must exist and resolve
    to a file inside `root` (a symlink may not lead elsewhere)."""
    real_root = root.resolve()
    out = []
    for file in files:
        shard = root / file
        if (odd := not_a_regular_file(shard)) is not None:
            raise CheckpointError(odd, kind="missing_shard")
        if not shard.is_file():
            named = sorted(n for n, f in (weight_map or {}).items() if f == file)
            what = (
                f" for {named[0]}" + (f" and {len(named) - 1} more tensors" if len(named) > 1 else "") if named else ""
            )
            raise CheckpointError(
                f"{shard}: named in {INDEX_NAME}{what} but does not exist", kind="missing_shard", path=str(shard)
            )
        if shard.resolve().parent != real_root:
            raise CheckpointError(
                f"{shard}: resolves to {shard.resolve()}, outside the checkpoint directory",
                kind="unsafe_shard_path",
                path=str(shard),
            )
        found, data_start = read_local_header(shard)
        out.append(LocalShard(file, found, data_start, shard.stat().st_size))
    return out


def read_inventory(path: str | Path) -> Inventory:
    """Open a local checkpoint directory (index + shards, or one model.safetensors),
    reading only config.json, the index and each shard's header."""
    root = Path(path)
    config_path = root / "config.json"
    if (odd := not_a_regular_file(config_path)) is not None:
        raise CheckpointError(odd, kind="missing_config")
    if not config_path.is_file():
        raise CheckpointError(
            f"{config_path}: no config.json in the checkpoint directory", kind="missing_config", path=str(config_path)
        )
    try:
        raw_config = strictjson.read_record_bytes(config_path)
    except OSError as exc:
        raise CheckpointError(
            f"{config_path}: cannot be read ({exc.strerror})", kind="missing_config", path=str(config_path)
        ) from None
    with config_errors(str(config_path)):
        config = parse_config(raw_config)

    index_path = root / INDEX_NAME
    if (odd := not_a_regular_file(index_path if os.path.lexists(index_path) else root / SINGLE_FILE)) is not None:
        raise CheckpointError(odd, kind="missing_shard")
    if index_path.is_file():
        weight_map: dict[str, str] | None = load_index(strictjson.read_record_bytes(index_path), INDEX_NAME)
        files = sorted(set(weight_map.values()))
    elif (root / SINGLE_FILE).is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise CheckpointError(
            f"{root}: neither {INDEX_NAME} nor {SINGLE_FILE} found", kind="missing_shard", path=str(root)
        )

    shards = read_local_shards(root, weight_map, files)
    file_sizes = {s.file: s.size for s in shards}
    header_bytes = sum(s.data_start for s in shards)
    tensors = merge_shards(str(root), weight_map, [(s.file, s.tensors) for s in shards])
    return Inventory(str(root), config, tensors, file_sizes, header_bytes, config_bytes=raw_config)
