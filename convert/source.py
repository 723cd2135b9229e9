"""A source: the checkpoint a command reads, opened. One object from open to close.

A Source holds where the checkpoint is (`location`: a local directory, or a hub repository
`HubSpec`), what its headers say (`inventory`: every tensor, no tensor byte read) and a reader
of its bytes (`reader`). Two rooms open one, the same type either way: convert/local.py a
directory, convert/hub_source.py a hub repository; convert/location.py's `open_source` opens either
from what the user typed. Every caller holds it with `with`, and the Source alone closes its
reader: once, whether the command succeeds, fails or is interrupted (also when reading the
inventory fails, before the caller holds it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Protocol

from dsv4.convert.inventory import Inventory
from dsv4.model.errors import CheckpointError

HUB_SCHEME = "hub:"  # how records and messages name a hub location: hub:org/name


@dataclass(frozen=True)
class HubSpec:
    """Where a hub source is: a repository and the revision asked for, with the hub options."""

    repo: str
    revision: str | None  # None: the repo's default branch
    explicit: bool = False  # written hf://...: not also a possible local path
    token: str | None = field(default=None, repr=False, compare=False)  # --token; None: HF_TOKEN or the stored login
    verify_files: bool = False  # --verify-source: check whole files against the hub's digests (convert/hub.py)

    @property
    def location(self) -> str:
        return f"{HUB_SCHEME}{self.repo}"


def local_root(location: Path | HubSpec) -> Path | None:
    """The directory a source is when it is a local one; None for a hub repository (read from
    huggingface_hub's cache or not: the cache is the hub's, not a directory the user named).
    The one rule: OUT's safety checks (convert/output.py), the record's source name and the
    Source all ask it."""
    return location if isinstance(location, Path) else None


class ByteReader(Protocol):
    """Positional reads of a source's files: convert/local.py's LocalReader, convert/hub.py's
    HubReader and CachedHubReader."""

    bytes_read: int

    def read_into(self, file: str, offset: int, buf: memoryview) -> None: ...

    def fingerprint(self, files: list[str]) -> dict[str, object]:
        """What identifies the source's content: its location and, per file read, its size
        plus what changes with its content (mtime locally, the commit on a hub)."""
        ...

    def verify_unchanged(self, files: list[str]) -> None:
        """Refuse (source_changed) when one of `files` changed since the reader was made."""
        ...

    def close(self) -> None: ...


def ended_early(where: str, at: int, offset: int, n: int) -> CheckpointError:
    """A ByteReader's refusal when the file `where` names ends at byte `at`, before the
    planned range offset..offset+n (the shard is shorter than its header said)."""
    return CheckpointError(
        f"{where}: ends at byte {at}, before the planned range {offset}..{offset + n}",
        kind="truncated_shard",
        path=where,
    )


class Source:
    """An opened checkpoint: `location`, `inventory` and `reader`, closed once (module docstring).

    Made by convert/local.py and convert/hub_source.py once their reader exists: `read_inventory`
    reads the headers through it, and a failure there closes the reader before it propagates."""

    def __init__(self, location: Path | HubSpec, reader: ByteReader, read_inventory: Callable[[], Inventory]):
        self.location = location
        self.reader = reader
        self._closed = False
        try:
            self.inventory = read_inventory()
        except BaseException:
            self.close()
            raise

    @property
    def local_root(self) -> Path | None:
        return local_root(self.location)

    def close(self) -> None:
        """Close the reader (its files; a hub reader's verified copies); again is a no-op."""
        if not self._closed:
            self._closed = True
            self.reader.close()

    def __enter__(self) -> Source:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
