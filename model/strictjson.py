"""Strict JSON: the parser every record of this tool goes through (safetensors headers,
indexes, config.json, conversion.json), and the one writer of its records.

Python's json module accepts what safetensors and most JSON readers refuse, and fails in
ways that are not ValueErrors: duplicate keys (the last one silently wins), NaN and
Infinity, integers of any length (or a ValueError past 4,300 digits), and nesting deep
enough to raise RecursionError. Each of those becomes a StrictJSONError here, with a
one-line reason, so a caller can turn it into its own error naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

MAX_DEPTH = 64  # no record of this tool nests deeper than 4; 64 leaves room for any config
MAX_INT_DIGITS = 20  # an unsigned 64-bit integer has 20 digits; sizes and offsets fit in it
MAX_RECORD_BYTES = 100_000_000  # a record file's size limit, as for a safetensors header; Flash's index is ~6 MB


class StrictJSONError(ValueError):
    """Not strict JSON; the message is one line, without the file's name."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # built in C; the loop below runs only when a key repeats
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise StrictJSONError(f"duplicate key {key!r}")
            seen.add(key)
    return out


def _int(text: str) -> int:
    if text == "-0":  # a float (-0.0) to serde_json (safetensors) and JavaScript, 0 to Python
        raise StrictJSONError("-0 is not an integer")
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise StrictJSONError(f"integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise StrictJSONError(f"number {text[:30]} overflows a double")
    return value


def _constant(name: str) -> Any:
    raise StrictJSONError(f"{name} is not JSON")


def _depth(value: Any) -> int:
    """Nesting depth, iteratively (the structure may be too deep for recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:
                    break
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def loads(raw: bytes | str, *, walk_depth: bool = True) -> Any:
    """Parse `raw` as strict JSON (UTF-8 if bytes).

    walk_depth=False skips the walk that bounds nesting at MAX_DEPTH, for a caller that
    checks the shape of every value itself (a safetensors header: depth 3 or refused); the
    walk costs more than the parse on a Flash checkpoint's 69,187 header entries. Nesting
    past Python's recursion limit is refused either way."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray, memoryview)) else raw
    except UnicodeDecodeError as exc:
        raise StrictJSONError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        value = json.loads(
            text, object_pairs_hook=_object, parse_int=_int, parse_float=_float, parse_constant=_constant
        )
    except StrictJSONError:
        raise
    except RecursionError:
        raise StrictJSONError(f"nested more than {MAX_DEPTH} levels deep") from None
    except json.JSONDecodeError as exc:
        raise StrictJSONError(f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except ValueError as exc:  # e.g. a float literal Python cannot represent
        raise StrictJSONError(f"not valid JSON ({exc})") from None
    if walk_depth and _depth(value) > MAX_DEPTH:
        raise StrictJSONError(f"nested more than {MAX_DEPTH} levels deep")
    return value


def read_record_bytes(path: str | Path) -> bytes:
    """The bytes of record file `path`, or OSError (path and reason) when it is no regular
    file (a FIFO would block the read forever, a device like /dev/zero fill memory) or is
    larger than MAX_RECORD_BYTES; read whole, before any parsing."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO does not wait for a writer
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if info.st_size > MAX_RECORD_BYTES:
            raise OSError(
                errno.EFBIG, f"{info.st_size:,} bytes, over the {MAX_RECORD_BYTES:,}-byte limit on a record", str(path)
            )
        return f.read(MAX_RECORD_BYTES + 1)


def json_bytes(obj: Any) -> bytes:
    """The one serialisation of every record this tool writes (stable, so comparable)."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """The temporary file write_bytes fills beside `path` before renaming it over `path`
    (random, so two writers never share one). Its name is the longest one the writer
    creates: a caller checking the file system's name limit checks this one."""
    return path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"


def write_record(path: str | Path, obj: Any) -> None:
    """Write record `path` durably (write_bytes) in the one serialisation (json_bytes)."""
    write_bytes(path, json_bytes(obj))


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write file `path` durably: a temporary file beside it, fsynced, renamed over it,
    and the directory fsynced. A reader sees the old file or the new one, never half of
    one, and once this returns a crash of the machine keeps the new one. The file gets the
    mode any new file gets (0666 less the umask, as `cp` and the shards do): a service
    account that may read the shards may read the records. OSError as raised."""
    path = Path(path)
    tmp = temp_path(path)
    # O_EXCL: a new file of our own (never another writer's, never a planted link)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
