"""Where OUT is, and the names a run writes beside and under it: OUT's hidden siblings,
the partial directory's records, and the checks made on OUT's path before anything is
touched (convert/output.py owns OUT with them).

OUT's hidden siblings are `.OUT.<suffix>` in OUT's parent (convert/output.py's docstring
says what each is for)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from dsv4.convert.errors import OutputError
from dsv4.model.checkpoint import CONFIG, INDEX_NAME
from dsv4.model.record import CONVERSION_RECORD
from dsv4.model.strictjson import temp_path

# the partial directory's bookkeeping, removed before it becomes OUT
JOURNAL = "journal.jsonl"  # one line per finished tensor
STATE = "state.json"  # the fingerprint of the conversion the partial directory holds
# OUT's hidden siblings are `.OUT.<suffix>` in OUT's parent; the previous output aside is
# `.OUT.old-<pid of the run replacing it>`
PARTIAL, LOCK, OWNER, OLD = "partial", "lock", "lock.owner", "old-"
NAME_MAX = 255  # bytes per file name, where the file system does not say (Linux's ext4, xfs, btrfs)
PATH_MAX = 4096  # bytes per path with its terminating NUL, where the file system does not say (Linux)
# the records a run writes into the partial directory, each through a temporary file with a
# longer name (strictjson.temp_path); the shards' names are shorter than the index's
PARTIAL_RECORDS = (STATE, CONFIG, INDEX_NAME, CONVERSION_RECORD)


def _is_within(inner: Path, outer: Path) -> bool:
    return outer in inner.parents


def resolve_output(out: Path, source: Path | None) -> Path:
    """Where OUT really is (symlinks followed), after refusing every OUT that could destroy
    the source or cannot hold a directory. `source` is a local source directory (a hub
    source has none). Reads the file system only."""
    real = Path(os.path.realpath(out))
    if real.parent == real:
        raise OutputError(f"{out}: OUT cannot be a file system root", kind="output_parent", path=str(out))
    if source is not None:
        src = Path(os.path.realpath(source))
        if real == src:
            raise OutputError(
                f"{out}: OUT is the source directory {source} itself; write the output to another directory",
                kind="output_is_source",
                path=str(out),
            )
        if _is_within(real, src):
            raise OutputError(
                f"{out}: OUT is inside the source directory {source}; write the output outside it",
                kind="output_in_source",
                path=str(out),
            )
        if _is_within(src, real):
            raise OutputError(
                f"{source}: the source is inside OUT {out}; "
                "write the output to a directory that does not contain the source",
                kind="source_in_output",
                path=str(source),
            )
        if _is_within(src, real.parent) and sibling_pattern(real).fullmatch(src.relative_to(real.parent).parts[0]):
            raise OutputError(
                f"{source}: the source is inside {real.parent / src.relative_to(real.parent).parts[0]}, "
                f"a working directory of OUT {out} that a run removes",
                kind="source_in_output",
                path=str(source),
            )
    ancestor = real.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(
            f"{ancestor}: is not a directory, so OUT {out} cannot be created under it",
            kind="output_parent",
            path=str(ancestor),
        )
    return real


def refuse_too_long(out: Path, real: Path) -> None:
    """Refuse, before anything is created, an OUT whose hidden siblings' names (longer than
    OUT's own) exceed the file system's limit on a name, or whose siblings and the files a
    run writes into the partial directory its limit on a path: one would fail midway."""
    ancestor = real.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    siblings = [
        real,
        *(sibling(real, s) for s in (PARTIAL, LOCK, f"{OLD}{os.getpid()}")),
        temp_path(sibling(real, OWNER)),
    ]
    longest = max((p.name for p in siblings), key=_length)
    limit = _limit(ancestor, "PC_NAME_MAX", NAME_MAX)
    if _length(longest) > limit:
        raise OutputError(
            f"{out}: the name is too long: this run writes {longest!r} beside it, "
            f"{_length(longest)} bytes, and {ancestor}'s file system allows {limit} bytes per name; "
            f"nothing was changed: choose a name {_length(longest) - limit} bytes shorter",
            kind="write_failed",
            path=str(out),
        )
    partial = sibling(real, PARTIAL)
    written = [*siblings, partial / JOURNAL, *(temp_path(partial / r) for r in PARTIAL_RECORDS)]
    deepest = max(map(str, written), key=_length)
    most = _limit(ancestor, "PC_PATH_MAX", PATH_MAX) - 1  # the limit counts the terminating NUL
    if _length(deepest) > most:
        raise OutputError(
            f"{out}: the path is too long: this run writes {deepest!r}, {_length(deepest)} bytes, and "
            f"{ancestor}'s file system allows {most} bytes per path; nothing was changed: choose a path "
            f"{_length(deepest) - most} bytes shorter",
            kind="write_failed",
            path=str(out),
        )


def _length(name: str) -> int:
    """A name's or path's length as the file system counts it: bytes."""
    return len(os.fsencode(name))


def _limit(directory: Path, name: str, default: int) -> int:
    """The file system's limit `name` (PC_NAME_MAX, PC_PATH_MAX) at `directory`, or `default`
    where it does not say."""
    try:
        return os.pathconf(directory, name)
    except (OSError, ValueError):
        return default


def sibling(real: Path, suffix: str) -> Path:
    return real.parent / f".{real.name}.{suffix}"


def sibling_pattern(real: Path, *, only_old: bool = False) -> re.Pattern[str]:
    """The names of OUT's hidden siblings (or of its previous outputs aside only)."""
    old = re.escape(OLD) + r"\d+"
    suffixes = old if only_old else "|".join([old, *map(re.escape, (PARTIAL, LOCK, OWNER))])
    return re.compile(rf"\.{re.escape(real.name)}\.({suffixes})")


def owner_temp_pattern(real: Path) -> re.Pattern[str]:
    """The temporary files of OUT's owner record (model/strictjson.py temp_path of
    .OUT.lock.owner): only the lock's holder writes one, so beside a held lock any such file
    is what a run killed mid-write left."""
    return re.compile(rf"\.{re.escape(sibling(real, OWNER).name)}\.[0-9a-f]{{8}}\.tmp")
