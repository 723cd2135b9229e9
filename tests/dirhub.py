"""A second hub backend (convert/sources/hub_protocol.py), in one module: repositories served from a
local directory. ROOT/org/name/ is repository org/name; its one commit is named by the sha1
of its files' names, sizes and modification times, so rewriting a file makes another
commit and a reader pinned to the old one is refused. What it proves: the hub mechanics
(convert/sources/hub.py, convert/sources/hub_source.py) and the commands above them ask nothing of
huggingface_hub; a hub is this much code.

`requests` counts the calls per kind ("info", "get"), as a test reads a server's log.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import yaml

from dsv4.convert.errors import HubError
from dsv4.convert.sources.hub_protocol import Answer, FileMissing, Published, Refusal, RemoteFile, RepoInfo, Transient
from dsv4.convert.sources.source import HubSpec

REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


class DirHubError(Exception):
    """A request a directory hub refuses: why, in a few words, and the exit-code kind."""

    def __init__(self, detail: str, kind: str):
        super().__init__(detail)
        self.detail, self.kind = detail, kind


@dataclass
class _Session:
    hub: DirHub
    repo: str

    def get(self, file: str, commit: str, byte_range: tuple[int, int] | None, into: memoryview | None = None) -> Answer:
        self.hub.requests["get"] += 1
        folder = self.hub.folder(self.repo)
        if self.hub.commit_of(folder) != commit:
            raise DirHubError("revision not found", "revision_not_found")
        path = folder / file
        if not path.is_file():
            raise FileMissing(file)
        size = path.stat().st_size
        with open(path, "rb") as f:
            if byte_range is None:
                return Answer(200, None, f.read())
            start, end = byte_range
            f.seek(start)
            body = f.read(end - start)
        content_range = f"bytes {start}-{start + len(body) - 1}/{size}"
        if into is None:
            return Answer(206, content_range, body)
        into[: len(body)] = body
        return Answer(206, content_range, b"", len(body))


class DirHub:
    """The hub protocol over a directory of repositories (module docstring)."""

    timeout_s = 1.0

    def __init__(self, root: Path):
        self.root = root
        self.requests: Counter[str] = Counter()

    def folder(self, repo: str) -> Path:
        folder = self.root / repo
        if not folder.is_dir():
            raise DirHubError("repository not found", "repo_not_found")
        return folder

    def commit_of(self, folder: Path) -> str:
        listing = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
        return hashlib.sha1(repr(listing).encode()).hexdigest()

    def offline(self) -> str | None:
        return None

    def valid_repo_id(self, repo: str) -> bool:
        return REPO_ID.fullmatch(repo) is not None

    def repo_info(self, hub: HubSpec, *, files_metadata: bool) -> RepoInfo:
        self.requests["info"] += 1
        folder = self.folder(hub.repo)
        commit = self.commit_of(folder)
        if hub.revision not in (None, "main", commit):
            raise DirHubError("revision not found", "revision_not_found")
        files = tuple(
            RemoteFile(
                p.name,
                p.stat().st_size,
                Published("sha256", hashlib.sha256(p.read_bytes()).hexdigest()) if files_metadata else None,
            )
            for p in sorted(folder.iterdir())
            if p.is_file()
        )
        return RepoInfo(commit, files)

    def session(self, hub: HubSpec) -> _Session:
        return _Session(self, hub.repo)

    def cached_file(self, hub: HubSpec, file: str, commit: str) -> Path | None:
        return None  # no download cache: every read is a request

    def cached_snapshot(self, hub: HubSpec) -> tuple[Path, str]:
        raise HubError(f"{hub.location}: a directory hub is never offline", kind="hub_request_failed")

    def create_repo(self, repo: str, private: bool | None) -> None:
        (self.root / repo).mkdir(parents=True, exist_ok=True)

    def upload_folder(
        self, repo: str, folder: Path, message: str, description: str, delete: Sequence[str], parent: str
    ) -> str:
        target = self.folder(repo)
        if self.commit_of(target) != parent:
            raise DirHubError("the repository moved past the parent commit", "push_failed")
        uploaded = {p.name for p in folder.iterdir()}
        for old in target.iterdir():
            if old.name not in uploaded and any(fnmatch(old.name, pattern) for pattern in delete):
                old.unlink()
        for new in folder.iterdir():
            shutil.copyfile(new.resolve(), target / new.name)
        return self.commit_of(target)

    def model_card(self, metadata: dict[str, object], body: str) -> str:
        front = {k: v for k, v in metadata.items() if v is not None}
        return f"---\n{yaml.safe_dump(front, sort_keys=False)}---\n\n{body}"

    def transient(self, exc: BaseException) -> Transient | None:
        return None  # a local directory has no passing failures

    def refusal(self, exc: BaseException) -> Refusal:
        if isinstance(exc, DirHubError):
            return Refusal(exc.detail, exc.kind)
        return Refusal(f"request failed ({type(exc).__name__}: {exc})")
