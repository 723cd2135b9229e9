"""The hub protocol: what this tool asks of a model hub, in types of its own.

A backend is one module that implements `HubBackend` for one kind of hub:
convert/sources/hf_backend.py for the Hugging Face Hub (huggingface_hub), tests/dirhub.py for a
local directory. Everything a hub source needs beyond that (retries with backoff, checked
ranged reads, speculative header reads, the inventory, --verify-source, the push's
idempotence) is the backend-neutral side: convert/sources/hub.py and convert/sources/hub_source.py. A
backend's calls raise its own exceptions; it says which of them are worth another attempt
(`transient`) and words the others (`refusal`), so the retries and the one-line errors are
written once, whatever the hub.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dsv4.convert.sources.source import HubSpec


@dataclass(frozen=True)
class Published:
    """The digest a hub gives for a file: an LFS file's sha256, else its git blob id
    (sha1 of "blob SIZE\\0" and the content)."""

    kind: str  # "sha256" or "git blob id"
    digest: str

    def hasher(self, size: int) -> hashlib._Hash:
        if self.kind == "sha256":
            return hashlib.sha256()
        h = hashlib.sha1()
        h.update(b"blob %d\0" % size)
        return h


@dataclass(frozen=True)
class RemoteFile:
    """One file of a commit, as the hub lists it."""

    name: str
    size: int | None  # a mirror may leave sizes out: the first ranged answer's Content-Range gives it
    published: Published | None = None  # asked for with files_metadata (--verify-source)


@dataclass(frozen=True)
class RepoInfo:
    """A revision resolved: its commit (None when the hub did not say) and its files."""

    commit: str | None
    files: tuple[RemoteFile, ...]


@dataclass(frozen=True)
class Answer:
    """One GET's answer: its status, its Content-Range header (None without one) and body.
    `streamed`: for a body written into the caller's buffer as it came (RangedSession.get's
    `into`), how many bytes came; `body` is then empty."""

    status: int
    content_range: str | None
    body: bytes
    streamed: int | None = None

    @property
    def length(self) -> int:
        """The body's length, held or streamed."""
        return len(self.body) if self.streamed is None else self.streamed


@dataclass(frozen=True)
class Transient:
    """What makes a failure worth another attempt, in a few words (`reason`), and the wait
    the hub asked for (Retry-After, seconds), if it did."""

    reason: str
    retry_after: int | None = None


@dataclass(frozen=True)
class Refusal:
    """A final failure in a few words (no URL, no token). `kind`: its exit-code kind
    (convert/exit_codes.py), or None for the kind the caller gives every failed request."""

    detail: str
    kind: str | None = None


class FileMissing(Exception):
    """The commit has no such file (a GET answered 404)."""


class RangedSession(Protocol):
    """GETs of one repository's files with its credentials, each pinned to a commit."""

    def get(self, file: str, commit: str, byte_range: tuple[int, int] | None, into: memoryview | None = None) -> Answer:
        """One attempt at `file` at `commit`: bytes [start, end) of it when `byte_range`
        is given, else all of it. Raises FileMissing, or the backend's own exceptions.
        `into` (with a range): a 206 answer's body is written into it as it comes, never
        held whole (no copy of it in memory), and reading stops once more than fits has come;
        an answer of any other status comes without its body."""
        ...


class HubBackend(Protocol):
    """One kind of hub: resolve a revision, read files (cache first), push a folder."""

    timeout_s: float  # connect and read, each request: named in the messages of a stall

    def offline(self) -> str | None:
        """Why no request may be made now ("HF_HUB_OFFLINE is set"), or None when they may."""
        ...

    def valid_repo_id(self, repo: str) -> bool:
        """Whether `repo` is a repository id of this hub (`org/name`)."""
        ...

    def repo_info(self, hub: HubSpec, *, files_metadata: bool) -> RepoInfo:
        """The commit `hub.revision` names now and its files; with `files_metadata`, each
        file's published digest."""
        ...

    def session(self, hub: HubSpec) -> RangedSession:
        """A session reading `hub.repo` with `hub.token`."""
        ...

    def cached_file(self, hub: HubSpec, file: str, commit: str) -> Path | None:
        """`file` at `commit` from the backend's download cache, when it holds it."""
        ...

    def cached_snapshot(self, hub: HubSpec) -> tuple[Path, str]:
        """Offline: (the cache's folder of the commit `hub.revision` pins, that commit).
        Refuses (HubError) when the cache has none."""
        ...

    def create_repo(self, repo: str, private: bool | None) -> None:
        """Create `repo` unless it exists; `private` None: the hub's default."""
        ...

    def upload_folder(
        self, repo: str, folder: Path, message: str, description: str, delete: Sequence[str], parent: str
    ) -> str:
        """Upload `folder` to `repo` as one commit on top of `parent`, deleting the files
        matching `delete` that it does not hold; returns the new commit."""
        ...

    def model_card(self, metadata: dict[str, object], body: str) -> str:
        """README.md in the hub's model-card format: `metadata` (base_model, library_name,
        tags) as its front matter, then `body`."""
        ...

    def transient(self, exc: BaseException) -> Transient | None:
        """What makes `exc`, raised by one of the calls above, worth retrying; None when it is final."""
        ...

    def refusal(self, exc: BaseException) -> Refusal:
        """Final failure `exc` in a few words."""
        ...
