"""The safetensors header format: an 8-byte little-endian length, then JSON listing each
tensor's dtype, shape and byte range. Bytes in, tensors out: the local checkpoint reader
(model/checkpoint.py) and the hub reader (convert/sources/hub.py, from bytes it fetched) both parse
headers here, so every reader of the tool refuses a malformed header the same way.

safetensors' Python API opens a file to read tensors but does not expose where each
tensor's bytes lie; the converter needs exactly that (to read only the byte ranges the
plan names), so the header is parsed here.

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

import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dsv4.model import strictjson
from dsv4.model.dtypes import ITEMSIZE
from dsv4.model.errors import CheckpointError

MAX_HEADER = 100_000_000  # safetensors' MAX_HEADER_SIZE, in bytes (not MiB): it refuses a longer header
U64_MAX = 2**64 - 1  # safetensors reads shapes and offsets as 64-bit sizes
ENTRY_FIELDS = ("dtype", "shape", "data_offsets")
ENTRY_KEYS = frozenset(ENTRY_FIELDS)


@dataclass(frozen=True)
class TensorBytes:
    """Bytes [start, end) of `file` (absolute offsets) holding `dtype`[`shape`] of the tensor
    named `name`: all of it, as its shard's header lists it, or the part of it one planned
    output takes (a fused tensor split back into its native parts)."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def json_kind(value: Any) -> str:
    """What a JSON value is, for a message: 'an object', 'a list', 'null', ..."""
    if value is None:
        return "null"
    kinds = (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (list, "a list"),
        (dict, "an object"),
    )
    return next(kind for t, kind in kinds if isinstance(value, t))


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
            f"{file}: header of {n:,} bytes exceeds the {MAX_HEADER:,}-byte limit on a safetensors header "
            "(safetensors refuses it too)",
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


def _tensor_entry(name: str, entry: Any, file: str, data_start: int) -> TensorBytes:
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
    return TensorBytes(name, file, dtype, tuple(shape), data_start + lo, data_start + hi)


def _check_tiling(tensors: Iterable[TensorBytes], file: str, data_start: int, file_size: int) -> None:
    """safetensors' rule for the data section: sorted by offset, the tensors cover it
    exactly, from its start to the end of the file; no byte is shared or owned by none."""
    at, previous = data_start, None
    for src in sorted(tensors, key=lambda s: (s.start, s.end)):
        lo, hi = src.start - data_start, src.end - data_start
        if previous is not None and src.start < previous.end:
            raise CheckpointError(
                f"{file}: tensor {src.name}: data_offsets [{lo}, {hi}] overlap tensor {previous.name}'s "
                f"[{previous.start - data_start}, {previous.end - data_start}]",
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
                f"{file}: tensor {src.name}: bytes {src.start}..{src.end} lie past the end of the file ({file_size} "
                "bytes)",
                kind="truncated_shard",
                path=str(file),
                tensor=src.name,
            )
        at, previous = src.end, src
    if at != file_size:
        raise CheckpointError(
            f"{file}: data bytes {at - data_start}..{file_size - data_start} after the last tensor belong to no "
            "tensor (safetensors refuses such a file)",
            kind="malformed_header",
            path=str(file),
        )


def tensors_from_header(
    header: Mapping[str, Any], file: str, data_start: int, file_size: int
) -> dict[str, TensorBytes]:
    """The tensors a parsed header describes, once the whole header has been validated."""
    out: dict[str, TensorBytes] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            _check_metadata(entry, file)
        else:
            out[name] = _tensor_entry(name, entry, file, data_start)
    _check_tiling(out.values(), file, data_start, file_size)
    return out


def read_header(
    raw_len: bytes, read_rest: Callable[[int], bytes], file: str, file_size: int
) -> tuple[dict[str, TensorBytes], int]:
    """The tensors of one shard of `file_size` bytes, from its first 8 bytes and
    `read_rest(n)` (the n header bytes after them), and the bytes before its data section.
    Every reader goes through here: a local file, or bytes fetched from the hub."""
    header, data_start = parse_header(raw_len, read_rest, file, file_size)
    return tensors_from_header(header, file, data_start, file_size), data_start
