"""The Hugging Face Hub as a hub backend (convert/sources/hub_protocol.py), through huggingface_hub.

Every request goes through huggingface_hub's HTTP session, so HF_ENDPOINT, HF_TOKEN (or
`--token`), proxies and HF_HUB_OFFLINE mean what they mean there; no token ever appears in
a message. Every request has a connect and a read timeout (HF_HUB_DOWNLOAD_TIMEOUT, default
10 s, as in huggingface_hub). Transient here: HTTP 408, 429, 500, 502, 503, 504, a timeout,
a dropped or reset connection. huggingface_hub's own log lines (full URLs) are silenced:
the retries' warnings (convert/sources/hub.py) replace them. Files already in huggingface_hub's
cache at the pinned commit (an earlier `hf download`) are read from there, and nothing
fetched is written to it.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx2
from huggingface_hub import constants
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status, validate_repo_id

from dsv4.convert.errors import HubError
from dsv4.convert.sources.hub_protocol import Answer, FileMissing, Published, Refusal, RemoteFile, RepoInfo, Transient
from dsv4.convert.sources.source import HubSpec
from dsv4.model.checkpoint import CONFIG

logging.getLogger("huggingface_hub").setLevel(logging.CRITICAL)
# huggingface_hub's cache and URL helpers: a module of its own, whose import (tqdm, filelock,
# yaml; 0.08-0.09 s of CPU at load 10) runs beside model info's round trip (repo_info), not before it
FILE_DOWNLOAD = "huggingface_hub.file_download"


def _import_beside(module: str) -> None:
    """Import `module` in this thread, quietly: where it is used it is imported again, and a
    failure is raised there, in the command's own thread."""
    try:
        importlib.import_module(module)
    except Exception:
        pass


TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def _published(sibling: dict[str, Any]) -> Published | None:
    if sibling.get("lfs") is not None:
        return Published("sha256", sibling["lfs"]["sha256"])
    return Published("git blob id", sibling["blobId"]) if sibling.get("blobId") else None


def _retry_after(response: httpx2.Response) -> int | None:
    value = response.headers.get("Retry-After", "").strip()
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class _Session:
    """GETs of one repository's files with one token's headers (built once: they read the
    stored login from disk)."""

    repo: str
    headers: dict[str, str]
    timeout_s: float

    def get(self, file: str, commit: str, byte_range: tuple[int, int] | None, into: memoryview | None = None) -> Answer:
        from huggingface_hub.file_download import hf_hub_url  # FILE_DOWNLOAD

        headers = (
            self.headers
            if byte_range is None
            else {**self.headers, "Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"}
        )
        url = hf_hub_url(self.repo, file, revision=commit)
        try:
            if into is None:
                response = get_session().get(url, headers=headers, timeout=self.timeout_s)
                hf_raise_for_status(response)
                return Answer(response.status_code, response.headers.get("Content-Range"), response.content)
            with get_session().stream("GET", url, headers=headers, timeout=self.timeout_s) as response:
                hf_raise_for_status(response)
                streamed = _stream_into(response, into) if response.status_code == 206 else 0
                return Answer(response.status_code, response.headers.get("Content-Range"), b"", streamed)
        except HfHubHTTPError as exc:
            # a whole file is missing only when the hub says so; a ranged read of a file model info listed, at any 404
            status = exc.response.status_code if exc.response is not None else None
            if isinstance(exc, EntryNotFoundError) or (byte_range is not None and status == 404):
                raise FileMissing(file) from None
            raise


def _stream_into(response: httpx2.Response, into: memoryview) -> int:
    """The body's bytes written into `into` as they come, until more than fits has come; how
    many came. A body held whole (response.content) costs an 8 MiB allocation per read, whose
    pages the kernel zero-fills, a join of its pieces and a copy into the buffer: about
    twice the CPU per byte (1.8 against 0.9 s per GB here, load 8)."""
    got, room = 0, len(into)
    for piece in response.iter_bytes():
        n = len(piece)
        if got + n > room:
            into[got:] = piece[: room - got]
            return got + n
        into[got : got + n] = piece
        got += n
    return got


class HfHub:
    """huggingface_hub's view of the Hugging Face Hub (or the mirror HF_ENDPOINT names)."""

    timeout_s = float(constants.HF_HUB_DOWNLOAD_TIMEOUT)

    def offline(self) -> str | None:
        return "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else None

    def valid_repo_id(self, repo: str) -> bool:
        # the protocol's org/name: huggingface_hub's own rule also takes a bare name (a user's
        # namespace implied), which this tool never means
        try:
            validate_repo_id(repo)
        except HFValidationError:
            return False
        return repo.count("/") == 1

    def repo_info(self, hub: HubSpec, *, files_metadata: bool) -> RepoInfo:
        """Model info, asked for as HfApi.model_info asks (its URL, parameters, session and
        error mapping), read for the commit and the files only. Not HfApi itself: importing
        huggingface_hub.hf_api costs about 0.2 s of CPU at load 10, a tenth of a whole `plan`
        of Flash from local disk at that load (BENCHMARKS.md, hub plan); a push imports it."""
        threading.Thread(target=_import_beside, args=(FILE_DOWNLOAD,), daemon=True).start()
        path = f"{constants.ENDPOINT}/api/models/{hub.repo}"
        if hub.revision is not None:
            path += f"/revision/{quote(hub.revision, safe='')}"
        response = get_session().get(
            path,
            headers=build_hf_headers(token=hub.token),
            params={"blobs": True} if files_metadata else {},
            timeout=self.timeout_s,
        )
        hf_raise_for_status(response)
        data = response.json()
        files = tuple(
            RemoteFile(s["rfilename"], s.get("size"), _published(s) if files_metadata else None)
            for s in data.get("siblings") or []
        )
        return RepoInfo(data.get("sha"), files)

    def session(self, hub: HubSpec) -> _Session:
        return _Session(hub.repo, build_hf_headers(token=hub.token), self.timeout_s)

    def cached_file(self, hub: HubSpec, file: str, commit: str) -> Path | None:
        from huggingface_hub.file_download import try_to_load_from_cache  # FILE_DOWNLOAD

        cached = try_to_load_from_cache(hub.repo, file, revision=commit)
        return Path(cached) if isinstance(cached, str) else None

    def cached_snapshot(self, hub: HubSpec) -> tuple[Path, str]:
        from huggingface_hub.file_download import try_to_load_from_cache  # FILE_DOWNLOAD

        config = try_to_load_from_cache(hub.repo, CONFIG, revision=hub.revision)
        if not isinstance(config, str):
            what = f"{hub.location}@{hub.revision or 'default branch'}"
            raise HubError(
                f"{what}: HF_HUB_OFFLINE is set and huggingface_hub's cache has no config.json of it; download the "
                f"repository first (`hf download {hub.repo}`) or unset HF_HUB_OFFLINE",
                kind="hub_request_failed",
                path=what,
            )
        snapshot = Path(config).parent  # .../snapshots/<commit>/, its files linked to the cache's blobs
        return snapshot, snapshot.name

    def create_repo(self, repo: str, private: bool | None) -> None:
        from huggingface_hub import HfApi  # start-up time (repo_info): only a push needs it

        HfApi().create_repo(repo, private=private, exist_ok=True)

    def upload_folder(
        self, repo: str, folder: Path, message: str, description: str, delete: Sequence[str], parent: str
    ) -> str:
        """huggingface_hub 2.x's resumable uploader (it replaced upload_large_folder): Xet
        uploads streamed while the folder is scanned, adaptive multi-commit batches, and a
        re-run after an interruption skips what already landed. Unlike upload_large_folder it
        takes a commit message. A folder below one batch (~250 files) lands as one commit.
        huggingface_hub retries a commit whose answer was lost; `parent_commit` makes the hub
        refuse a second copy of it."""
        from huggingface_hub import HfApi  # start-up time (repo_info): only a push needs it

        commit = HfApi().upload_folder(
            repo_id=repo,
            folder_path=folder,
            commit_message=message,
            commit_description=description,
            delete_patterns=list(delete),
            parent_commit=parent,
        )
        return commit.oid

    def model_card(self, metadata: dict[str, object], body: str) -> str:
        from huggingface_hub import ModelCard, ModelCardData  # start-up time: only a push needs them

        data = ModelCardData(**metadata)
        return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))

    def transient(self, exc: BaseException) -> Transient | None:
        if isinstance(exc, httpx2.TimeoutException):
            return Transient(f"no answer within {self.timeout_s:g} s ({type(exc).__name__})")
        if isinstance(exc, (httpx2.NetworkError, httpx2.RemoteProtocolError)):
            return Transient(f"connection failed ({type(exc).__name__})")
        response = getattr(exc, "response", None)
        if isinstance(exc, HfHubHTTPError) and response is not None and response.status_code in TRANSIENT_STATUS:
            limited = " (rate limited)" if response.status_code == 429 else ""
            return Transient(f"HTTP {response.status_code}{limited}", _retry_after(response))
        return None

    def refusal(self, exc: BaseException) -> Refusal:
        if isinstance(exc, GatedRepoError):
            return Refusal(
                "gated repository; accept its terms on the hub, then set HF_TOKEN or run `hf auth login`",
                "repo_not_found",
            )
        if isinstance(exc, RepositoryNotFoundError):
            return Refusal(
                "repository not found (if it is private or gated, set HF_TOKEN or run `hf auth login`)",
                "repo_not_found",
            )
        if isinstance(exc, RevisionNotFoundError):
            return Refusal("revision not found in the repository", "revision_not_found")
        if isinstance(exc, OfflineModeIsEnabled):
            return Refusal(
                "HF_HUB_OFFLINE is set and the cache does not hold this repository's files; download them first "
                "(`hf download`) or unset HF_HUB_OFFLINE",
                "hub_request_failed",
            )
        status = getattr(getattr(exc, "response", None), "status_code", None)
        detail = f"HTTP {status}" if status else (str(exc).strip().splitlines() or [""])[0]  # theirs: lines, URLs
        return Refusal(f"hub request failed ({type(exc).__name__}: {detail})")


HF_HUB = HfHub()
