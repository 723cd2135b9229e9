"""Hub sources: a model-hub repository `org/name[@revision]`, read in place.

The revision is resolved to its commit first and every later request is pinned to that
commit, so a branch that moves during a conversion cannot mix two versions of a checkpoint.
config.json and the index come through huggingface_hub's download cache; of each shard only
the header is read (two ranged requests; `HubReader.header_reads` shards at a time), and then
only the byte ranges the plan names.

Every hub call goes through huggingface_hub, so HF_ENDPOINT, HF_TOKEN, HF_HOME and
HF_HUB_OFFLINE mean what they mean there, and no token ever passes through this module.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial

from dsv4.convert.errors import DownloadError, HubError, RepoNotFound, RevisionNotFound
from dsv4.convert.inventory import Inventory, TensorSource, merge_shards, parse_header, tensors_from_header
from dsv4.convert.location import HubSpec, parse_hub_spec
from dsv4.model.checkpoint import INDEX_NAME, SINGLE_FILE, load_index
from dsv4.model.config import config_errors, parse_config
from dsv4.model.errors import DSV4Error, MissingConfigError, MissingShardError, TruncatedShardError
from fsspec.spec import AbstractBufferedFile
from huggingface_hub import HfApi, HfFileSystem, ModelInfo, hf_hub_download
from huggingface_hub.errors import (
    GatedRepoError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

# huggingface_hub already retries HTTP errors and dropped connections (http_backoff: 5 tries,
# 1 s doubling to 8 s). What it cannot see is a complete-looking response that is shorter
# than the range asked for (a proxy cutting a body short); those are retried here.
SHORT_READ_RETRIES = 3
SHORT_READ_BACKOFF_S = 0.5  # doubled after each short read


@contextmanager
def hub_errors(what: str, fallback: type[HubError] = HubError) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into this tool's one-line errors about `what`."""
    try:
        yield
    except DSV4Error:
        raise
    except GatedRepoError:
        raise RepoNotFound(f"{what}: gated repository; accept its terms on the hub, then set HF_TOKEN or run `hf auth login`", path=str(what)) from None
    except RepositoryNotFoundError:
        raise RepoNotFound(f"{what}: repository not found (if it is private or gated, set HF_TOKEN or run `hf auth login`)", path=str(what)) from None
    except RevisionNotFoundError:
        raise RevisionNotFound(f"{what}: revision not found in the repository", path=str(what)) from None
    except OfflineModeIsEnabled:
        raise HubError(f"{what}: HF_HUB_OFFLINE is set, so the hub cannot be read; convert a local directory instead", path=str(what)) from None
    except Exception as exc:  # network and HTTP failures of any kind; their text is multi-line
        status = getattr(getattr(exc, "response", None), "status_code", None)
        detail = f"HTTP {status}" if status else (str(exc).strip().splitlines() or [""])[0]
        raise fallback(f"{what}: hub request failed ({type(exc).__name__}: {detail})") from None


class HubReader:
    """ByteReader over one hub commit: each read is one ranged GET through HfFileSystem.

    Files are opened with fsspec's "none" cache, so a read fetches exactly the bytes asked
    for: the default read-ahead cache would fetch whole blocks past every tensor. Requests
    are latency-bound (Flash's draft is ~1,600 ranges), so the executor keeps
    `parallel_reads` of them in flight; each thread has its own file objects (an fsspec
    file's seek-then-read is not thread-safe). Shard headers are read `header_reads` at a
    time: a header is small, where each tensor read in flight holds a buffer of its own.
    """

    parallel_reads = 8
    header_reads = 16

    def __init__(self, hub: HubSpec, commit: str, sizes: dict[str, int]):
        self.location = hub.location
        self.repo = hub.repo
        self.commit = commit
        self.sizes = sizes
        self.bytes_read = 0
        self._fs = HfFileSystem()
        self._local = threading.local()
        self._lock = threading.Lock()
        # A file's first open asks the hub whether the repo and commit exist, and its URL
        # (asked for on every read) lists the repo's tree; HfFileSystem keeps both answers.
        # Opening under a lock, URL included, makes threads that start together ask once
        # instead of once each.
        self._open_lock = threading.Lock()
        self._opened: list[AbstractBufferedFile] = []

    def _where(self, file: str) -> str:
        return f"{self.location}/{file}@{self.commit[:12]}"

    def _open(self, file: str) -> AbstractBufferedFile:
        files: dict[str, AbstractBufferedFile] = self._local.__dict__.setdefault("files", {})
        f = files.get(file)
        if f is None:
            try:
                with self._open_lock:
                    f = self._fs.open(f"{self.repo}/{file}", "rb", revision=self.commit, cache_type="none", size=self.sizes[file])
                    f.url()
            except FileNotFoundError:
                raise MissingShardError(f"{self._where(file)}: not in the repository at this commit", path=str(self._where(file))) from None
            files[file] = f
            with self._lock:
                self._opened.append(f)
        return f

    def fetch(self, file: str, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of `file`, checked for length. Not counted in
        bytes_read (inventory reads headers with it; read_into counts tensor data)."""
        size = self.sizes[file]
        if offset + n > size:
            raise TruncatedShardError(f"{self._where(file)}: ends at byte {size}, before the planned range {offset}..{offset + n}", path=str(self._where(file)))
        got = 0
        for attempt in range(SHORT_READ_RETRIES + 1):
            if attempt:
                time.sleep(SHORT_READ_BACKOFF_S * 2 ** (attempt - 1))
            with hub_errors(f"{self._where(file)}: bytes {offset}..{offset + n}", DownloadError):
                f = self._open(file)
                f.seek(offset)
                data = f.read(n)
            got = len(data)
            if got == n:
                return data
            if got > n:  # the server ignored the Range header; retrying would pull whole shards again
                raise DownloadError(f"{self._where(file)}: bytes {offset}..{offset + n}: the hub sent {got} bytes for a {n}-byte range", path=str(self._where(file)))
        raise DownloadError(f"{self._where(file)}: bytes {offset}..{offset + n}: got {got} of {n} bytes on each of {SHORT_READ_RETRIES + 1} attempts", path=str(self._where(file)))

    def read_into(self, file: str, offset: int, buf: memoryview) -> None:
        buf[:] = self.fetch(file, offset, len(buf))
        with self._lock:  # called from several reader threads
            self.bytes_read += len(buf)

    def fingerprint(self, files: list[str]) -> dict[str, object]:
        return {"location": self.location, "revision": self.commit, "files": {f: self.sizes[f] for f in files}}

    def close(self) -> None:
        with self._lock:
            for f in self._opened:
                f.close()
            self._opened.clear()
        self._local = threading.local()


def _model_info(hub: HubSpec, *, files_metadata: bool = False) -> tuple[str, ModelInfo]:
    """(commit, info) of the revision `hub` names."""
    with hub_errors(f"{hub.location}@{hub.revision or 'default branch'}"):
        info = HfApi().model_info(hub.repo, revision=hub.revision, files_metadata=files_metadata)
    if not info.sha:
        raise HubError(f"{hub.location}: the hub did not say which commit {hub.revision or 'the default branch'} is", path=str(hub.location))
    return info.sha, info


def resolve_commit(hub: HubSpec) -> str:
    """The commit `hub.revision` names now: one metadata request, no file bytes."""
    return _model_info(hub)[0]


def _download(hub: HubSpec, commit: str, file: str) -> bytes:
    """A small file at `commit`, through huggingface_hub's cache (HF_HOME)."""
    with hub_errors(f"{hub.location}/{file}@{commit[:12]}"):
        path = hf_hub_download(hub.repo, file, revision=commit)
    with open(path, "rb") as f:
        return f.read()


def _read_shard_header(reader: HubReader, file: str) -> tuple[dict[str, TensorSource], int]:
    """The tensors of one hub shard and its header's size: two ranged requests (the 8-byte
    length, then the JSON), checked as the local reader checks them."""
    size = reader.sizes[file]
    header, data_start = parse_header(reader.fetch(file, 0, min(8, size)), partial(reader.fetch, file, 8), file, size)
    return tensors_from_header(header, file, data_start, size), data_start


def open_hub_source(spec: str | HubSpec) -> tuple[Inventory, HubReader]:
    """Inventory of hub repo `org/name[@revision]` from its headers, and a reader pinned to
    the resolved commit. Applies the same checks as the local reader."""
    hub = parse_hub_spec(spec) if isinstance(spec, str) else spec
    try:
        commit, info = _model_info(hub, files_metadata=True)
    except HubError as exc:
        if hub.explicit:
            raise
        # a bare org/name may also have been meant as a local path: say both readings
        raise type(exc)(f"{hub.repo}: no such local directory, and as a hub repository: {exc}") from None
    sizes = {s.rfilename: s.size for s in info.siblings or [] if s.size is not None}

    config_where = f"{hub.location}/config.json@{commit[:12]}"
    if "config.json" not in sizes:
        raise MissingConfigError(f"{config_where}: no config.json in the repository", path=str(config_where))
    raw_config = _download(hub, commit, "config.json")
    with config_errors(config_where):
        config = parse_config(raw_config)
    weight_map: dict[str, str] | None
    if INDEX_NAME in sizes:
        weight_map = load_index(_download(hub, commit, INDEX_NAME), INDEX_NAME)
        files = sorted(set(weight_map.values()))
    elif SINGLE_FILE in sizes:
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise MissingShardError(f"{hub.location}@{commit[:12]}: neither {INDEX_NAME} nor {SINGLE_FILE} found")
    for file in files:
        if file not in sizes:
            raise MissingShardError(f"{hub.location}/{file}@{commit[:12]}: shard named in {INDEX_NAME} is not in the repository")

    reader = HubReader(hub, commit, {f: sizes[f] for f in files})
    try:
        # Latency-bound (Flash: 46 shards, 92 requests), so several shards at a time. map
        # yields in shard order: the first shard in that order that fails is the error
        # reported, as when they were read one by one, and the shards not yet started are
        # cancelled.
        with ThreadPoolExecutor(max_workers=reader.header_reads, thread_name_prefix="hub-header") as pool:
            headers = list(pool.map(partial(_read_shard_header, reader), files))
        header_bytes = sum(data_start for _, data_start in headers)
        tensors = merge_shards(hub.location, weight_map, [(file, found) for file, (found, _) in zip(files, headers, strict=True)])
    except BaseException:
        reader.close()
        raise
    return Inventory(hub.location, config, tensors, dict(reader.sizes), header_bytes, revision=commit, config_bytes=raw_config), reader
