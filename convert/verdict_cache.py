"""The library's readings of serve plans, kept in the user's cache (convert/verdict.py asks them).

What compressed-tensors' `serve_plan` answers is a function of its request (the target's config,
the draft's layers and native layout, the route, --allow-lossy), of the library's release and of
this tool's code. Asking it costs a process that imports the library, torch and transformers:
3-6 s here, 25 s on a fresh machine that compiles their bytecode and registers their custom ops,
against an overlay draft's 5 s copy. So a reply, once the library gave it, is kept in
$XDG_CACHE_HOME/dsv4-convert (model/layout.py's cache directory) under the digest of everything it
is a function of, and a later conversion against the same target reads it instead of asking
again: the library stays the authority (each entry is its answer, never a reading of ours), and a
new release of it, another target or a changed line of this tool's code is another key.

An entry is trusted as the layout cache's are (model/layout.py): a regular file of bounded size
that carries the sha256 of its key and reply; anything else is ignored and asked again. A cache
that cannot be written costs only the asking.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from dsv4 import __version__
from dsv4.model.layout import PACKAGE, cache_dir
from dsv4.model.strictjson import StrictJSONError, json_bytes, loads, read_record_bytes, write_record

LIBRARY = "compressed-tensors"  # the distribution whose reading the entries are
CODE = ("convert", "model")  # this tool's code a reading runs through (the tables reach it as the request)
FORMAT = 1


@cache
def _code_sha256() -> str:
    """One digest over CODE's Python files (paths and bytes), read once per process."""
    digest = hashlib.sha256()
    for part in CODE:
        for f in sorted((PACKAGE / part).rglob("*.py")):
            digest.update(f"{f.relative_to(PACKAGE)}\0".encode() + f.read_bytes())
    return digest.hexdigest()


def _key(request: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a reply is a function of, as JSON reads it back (tuples as lists); None where the
    library is not installed (nothing to key by: the asking refuses as it does without a cache)."""
    try:
        library = metadata.version(LIBRARY)
    except metadata.PackageNotFoundError:
        return None
    asked = {k: v for k, v in request.items() if k != "path"}  # where the child imports from: not the question
    key = {"format": FORMAT, "tool": __version__, "code": _code_sha256(), "library": library, "request": asked}
    return json.loads(json.dumps(key, sort_keys=True))


def _entry(key: dict[str, Any]) -> Path:
    return cache_dir() / f"verdict-{hashlib.sha256(json_bytes(key)).hexdigest()[:32]}.json"


def _digest(key: dict[str, Any], reply: Any) -> str:
    return hashlib.sha256(json_bytes({"key": key, "reply": reply})).hexdigest()


def cached_reply(request: Mapping[str, Any]) -> dict[str, Any] | None:
    """The library's reply to `request` as an earlier run kept it, or None."""
    key = _key(request)
    if key is None:
        return None
    try:
        entry = loads(read_record_bytes(_entry(key)))  # a regular file of bounded size, or OSError
        if entry["key"] == key and entry["sha256"] == _digest(key, entry["reply"]) and isinstance(entry["reply"], dict):
            return entry["reply"]
    except (OSError, UnicodeDecodeError, StrictJSONError, KeyError, TypeError, ValueError):
        pass  # absent, not a regular file, corrupt or edited: asked again
    return None


def keep_reply(request: Mapping[str, Any], reply: dict[str, Any]) -> None:
    """Keep the library's `reply` to `request` for later runs (a cache that cannot be written: not kept)."""
    key = _key(request)
    if key is None:
        return
    try:
        path = _entry(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_record(path, {"key": key, "reply": reply, "sha256": _digest(key, reply)})
    except OSError:
        pass
