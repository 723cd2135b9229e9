"""Hub sources: a model-hub repository `org/name[@revision]`, read in place, opened as a
Source (convert/source.py) as convert/local.py opens a directory.

The revision is resolved to its commit first (model info) and every later request is pinned
to that commit, so a branch that moves during a conversion cannot mix two versions of a
checkpoint. config.json and the index are read from huggingface_hub's cache when it holds
them at that commit (an earlier `hf download`), else fetched (and not written to the cache).
Of each shard one speculative ranged read of its first SPECULATIVE_HEADER_BYTES is made,
which holds the whole header of almost every shard (a second read fetches the rest of a
longer one); then only the byte ranges the plan names.

Every request goes through huggingface_hub's HTTP session, so HF_ENDPOINT, HF_TOKEN (or
`--token`), proxies and HF_HUB_OFFLINE mean what they mean there; no token ever appears in
a message. With HF_HUB_OFFLINE=1 a repository whose files are all in the cache at the
pinned revision is read from the cache, as `hf` does.

What a response must be: every request has a connect and a read timeout
(HF_HUB_DOWNLOAD_TIMEOUT, default 10 s, as in huggingface_hub). A transient failure (HTTP
408, 429, 500, 502, 503, 504, a timeout, a dropped or reset connection, a ranged answer
that is not the range asked for) is retried RETRIES times with backoff, each wait one
`warning:` line of ours; a 429's Retry-After is waited for when it is at most
RETRY_AFTER_CAP_S, and refused at once when longer. A ranged answer must be 206 with a
Content-Range naming exactly the bytes asked for and a body of that length. huggingface_hub's
own log lines (full URLs) are silenced.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import httpx2
from huggingface_hub import HfApi, ModelInfo, constants, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoSibling
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from dsv4.convert import progress
from dsv4.convert.errors import HubError
from dsv4.convert.inventory import Inventory
from dsv4.convert.local import LocalReader
from dsv4.convert.source import HubSpec, Source, ended_early
from dsv4.model.checkpoint import INDEX_NAME, SINGLE_FILE, load_index, merge_shards
from dsv4.model.config import parse_config
from dsv4.model.errors import CheckpointError, DSV4Error
from dsv4.model.safetensors_header import TensorBytes, read_header

T = TypeVar("T")
log = logging.getLogger("dsv4.hub")
# huggingface_hub logs each of its own retries with the full URL; our warnings replace them
logging.getLogger("huggingface_hub").setLevel(logging.CRITICAL)

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
RETRIES = 5  # after the first attempt
BACKOFF_S = 1.0  # the first wait; doubled after each retry, up to BACKOFF_MAX_S
BACKOFF_MAX_S = 8.0
RETRY_AFTER_CAP_S = 300  # the longest Retry-After waited for; a longer one fails at once
TIMEOUT_S = float(constants.HF_HUB_DOWNLOAD_TIMEOUT)  # connect and read, each request
# First read of a shard, its header whole in one round trip: Flash's headers are 176 kB
# (69,187 tensors in 46 shards), a 256 KiB read costs the same round trip as 8 bytes.
SPECULATIVE_HEADER_BYTES = 256 * 1024
VERIFY_CHUNK_BYTES = 16 * 2**20  # --verify-source: one ranged read of a whole-file download
CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)$")


class _Transient(Exception):
    """A failure worth another attempt; `reason` says what happened, in a few words."""

    def __init__(self, reason: str, retry_after: int | None = None):
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after


def _retry_after(response: httpx2.Response) -> int | None:
    value = response.headers.get("Retry-After", "").strip()
    return int(value) if value.isdigit() else None


def _transient(exc: BaseException) -> _Transient | None:
    """What makes `exc` worth retrying, or None when it is final."""
    if isinstance(exc, _Transient):
        return exc
    if isinstance(exc, httpx2.TimeoutException):
        return _Transient(f"no answer within {TIMEOUT_S:g} s ({type(exc).__name__})")
    if isinstance(exc, (httpx2.NetworkError, httpx2.RemoteProtocolError)):
        return _Transient(f"connection failed ({type(exc).__name__})")
    response = getattr(exc, "response", None)
    if isinstance(exc, HfHubHTTPError) and response is not None and response.status_code in TRANSIENT_STATUS:
        limited = " (rate limited)" if response.status_code == 429 else ""
        return _Transient(f"HTTP {response.status_code}{limited}", _retry_after(response))
    return None


REQUEST_FAILED = partial(HubError, kind="hub_request_failed")  # a failed request, unless the caller says


def _hub_error(exc: BaseException, what: str, fallback: Callable[..., HubError]) -> DSV4Error:
    """huggingface_hub's exception `exc` as this tool's one-line error about `what`."""
    if isinstance(exc, GatedRepoError):
        return HubError(
            f"{what}: gated repository; accept its terms on the hub, then set HF_TOKEN or run `hf auth login`",
            kind="repo_not_found",
            path=str(what),
        )
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(
            f"{what}: repository not found (if it is private or gated, set HF_TOKEN or run `hf auth login`)",
            kind="repo_not_found",
            path=str(what),
        )
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{what}: revision not found in the repository", kind="revision_not_found", path=str(what))
    if isinstance(exc, OfflineModeIsEnabled):
        return HubError(
            f"{what}: HF_HUB_OFFLINE is set and the cache does not hold this repository's files; download them first "
            "(`hf download`) or unset HF_HUB_OFFLINE",
            kind="hub_request_failed",
            path=str(what),
        )
    status = getattr(getattr(exc, "response", None), "status_code", None)
    detail = (
        f"HTTP {status}" if status else (str(exc).strip().splitlines() or [""])[0]
    )  # their text is multi-line, with URLs
    return fallback(f"{what}: hub request failed ({type(exc).__name__}: {detail})", path=str(what))


@contextmanager
def hub_errors(what: str, fallback: Callable[..., HubError] = REQUEST_FAILED) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into this tool's one-line errors about `what`."""
    try:
        yield
    except DSV4Error:
        raise
    except Exception as exc:
        raise _hub_error(exc, what, fallback) from None


def with_retries(what: str, attempt: Callable[[], T], fallback: Callable[..., HubError] = REQUEST_FAILED) -> T:
    """`attempt()`, retried on transient failures (module docstring), as one-line errors about `what`."""
    backoff, retry = BACKOFF_S, 0
    while True:
        try:
            return attempt()
        except DSV4Error:
            raise
        except Exception as exc:
            problem = _transient(exc)
            if problem is None:
                raise _hub_error(exc, what, fallback) from None
        if retry == RETRIES:
            raise fallback(f"{what}: {problem.reason} on each of {RETRIES + 1} attempts", path=str(what))
        wait = backoff
        if problem.retry_after is not None:
            if problem.retry_after > RETRY_AFTER_CAP_S:
                raise fallback(
                    f"{what}: {problem.reason}: the hub asks to wait {problem.retry_after} s, longer than the "
                    f"{RETRY_AFTER_CAP_S} s this tool waits; try again later",
                    path=str(what),
                )
            wait = float(problem.retry_after)
        retry += 1
        log.warning(f"{what}: {problem.reason}; retry {retry} of {RETRIES} in {wait:g} s")
        time.sleep(wait)
        backoff = min(BACKOFF_MAX_S, backoff * 2)


def _get(url: str, headers: dict[str, str]) -> httpx2.Response:
    response = get_session().get(url, headers=headers, timeout=TIMEOUT_S)
    hf_raise_for_status(response)
    return response


@dataclass(frozen=True)
class Published:
    """The digest model info gives for a file: an LFS file's sha256, else its git blob id
    (sha1 of "blob SIZE\\0" and the content)."""

    kind: str  # "sha256" or "git blob id"
    digest: str

    def hasher(self, size: int) -> hashlib._Hash:
        if self.kind == "sha256":
            return hashlib.sha256()
        h = hashlib.sha1()
        h.update(b"blob %d\0" % size)
        return h

    @classmethod
    def of(cls, sibling: RepoSibling) -> Published | None:
        if sibling.lfs is not None:
            return cls("sha256", sibling.lfs.sha256)
        return cls("git blob id", sibling.blob_id) if sibling.blob_id else None


class HubReader:
    """ByteReader over one hub commit: each read is one ranged GET, checked (module docstring).

    Requests are latency-bound (Flash's draft is ~1,600 ranges), so the executor keeps
    `parallel_reads` of them in flight; shard headers are read `header_reads` at a time (a
    header is small, where each tensor read in flight holds a buffer of its own). `sizes`:
    the file sizes model info gave; a mirror's info may leave them out, and then the first
    ranged answer's Content-Range gives each file's size.
    """

    parallel_reads = 8
    header_reads = 16

    def __init__(self, hub: HubSpec, commit: str, sizes: dict[str, int], published: dict[str, Published] | None = None):
        """`published`: with --verify-source, each file's digest as model info gives it."""
        self.location = hub.location
        self.repo = hub.repo
        self.commit = commit
        self.sizes = sizes
        self.bytes_read = 0
        self.header_sha256: dict[str, str] = {}  # of each shard's header bytes as the inventory parsed them
        self.published = published
        self._headers = build_hf_headers(token=hub.token)
        self._lock = threading.Lock()
        self._verify_lock = threading.Lock()
        self._verified: dict[str, int] = {}  # file -> descriptor of its verified local copy
        self._spill: tempfile.TemporaryDirectory[str] | None = None

    def _where(self, file: str) -> str:
        return f"{self.location}/{file}@{self.commit[:12]}"

    def _ranged(self, file: str, offset: int, n: int) -> bytes:
        """One attempt at bytes [offset, offset + n) (fewer only where the file ends first)."""
        headers = {**self._headers, "Range": f"bytes={offset}-{offset + n - 1}"}
        try:
            response = _get(hf_hub_url(self.repo, file, revision=self.commit), headers)
        except HfHubHTTPError as exc:
            if exc.response is not None and exc.response.status_code == 404:
                raise CheckpointError(
                    f"{self._where(file)}: not in the repository at this commit",
                    kind="missing_shard",
                    path=self._where(file),
                ) from None
            raise
        if response.status_code != 206:  # the Range was ignored: retrying would pull whole shards again
            raise HubError(
                f"{self._where(file)}: bytes {offset}..{offset + n}: the hub answered HTTP {response.status_code}, "
                "not 206 Partial Content",
                kind="download_failed",
                path=self._where(file),
            )
        m = CONTENT_RANGE.match(response.headers.get("Content-Range", "").strip())
        if m is None:
            raise _Transient(f"no Content-Range in the answer (got {response.headers.get('Content-Range')!r})")
        start, end, total = int(m.group(1)), int(m.group(2)) + 1, m.group(3)
        body = response.content
        if total != "*":
            with self._lock:
                self.sizes.setdefault(file, int(total))
        size = self.sizes.get(file)
        if start != offset or len(body) != end - start:
            raise _Transient(
                f"the hub sent bytes {start}..{end} ({len(body)} bytes) for the range {offset}..{offset + n}"
            )
        if len(body) < n and (size is None or end < size):
            raise _Transient(f"got {len(body)} of {n} bytes")
        if len(body) > n:
            raise _Transient(f"the hub sent {len(body)} bytes for a {n}-byte range")
        return body

    def fetch(self, file: str, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of `file`, checked (fewer only where the file ends
        first). Not counted in bytes_read (inventory reads headers with it; read_into
        counts tensor data)."""
        size = self.sizes.get(file)
        if size is not None and offset + n > size:
            raise ended_early(self._where(file), size, offset, n)
        return with_retries(
            f"{self._where(file)}: bytes {offset}..{offset + n}",
            partial(self._ranged, file, offset, n),
            partial(HubError, kind="download_failed"),
        )

    def read_into(self, file: str, offset: int, buf: memoryview) -> None:
        if self.published is not None:
            fd = self._verified_copy(file)
            data = os.pread(fd, len(buf), offset)
        else:
            data = self.fetch(file, offset, len(buf))
        if len(data) != len(buf):
            raise ended_early(self._where(file), offset + len(data), offset, len(buf))
        buf[:] = data
        with self._lock:  # called from several reader threads
            self.bytes_read += len(buf)

    def _verified_copy(self, file: str) -> int:
        """--verify-source: `file` downloaded whole, once, in checked ranged reads of
        VERIFY_CHUNK_BYTES hashed as they arrive into a temporary copy, and checked against
        the digest the hub publishes and against the header the plan was made from; the
        planned ranges are then read from that copy. One file at a time: one chunk in memory."""
        with self._verify_lock:
            fd = self._verified.get(file)
            if fd is not None:
                return fd
            published = (self.published or {}).get(file)
            if published is None:
                raise HubError(
                    f"{self._where(file)}: the hub publishes no sha256 or git id for this file, so --verify-source "
                    "cannot check it",
                    kind="download_failed",
                    path=self._where(file),
                )
            if self._spill is None:
                self._spill = tempfile.TemporaryDirectory(prefix="dsv4-verify-")
            copy, size = Path(self._spill.name) / file, self.sizes[file]
            digest = published.hasher(size)
            with open(copy, "wb") as out:
                for offset in range(0, size, VERIFY_CHUNK_BYTES):
                    chunk = self.fetch(file, offset, min(VERIFY_CHUNK_BYTES, size - offset))
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != published.digest:
                raise HubError(
                    f"{self._where(file)}: the {size:,} bytes downloaded do not match the {published.kind} the hub "
                    f"publishes ({published.digest[:16]}...): refused, nothing written from it",
                    kind="download_failed",
                    path=self._where(file),
                )
            fd = os.open(copy, os.O_RDONLY)
            if (header := self.header_sha256.get(file)) is not None:
                n = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
                if hashlib.sha256(os.pread(fd, 8 + n, 0)).hexdigest() != header:
                    os.close(fd)
                    raise HubError(
                        f"{self._where(file)}: the header the plan was made from differs from the verified file's: "
                        "refused",
                        kind="download_failed",
                        path=self._where(file),
                    )
            self._verified[file] = fd
            return fd

    def fingerprint(self, files: list[str]) -> dict[str, object]:
        return {"location": self.location, "revision": self.commit, "files": {f: self.sizes[f] for f in files}}

    def verify_unchanged(self, files: list[str]) -> None:
        """Nothing to do: every request is pinned to one commit, which cannot change."""

    def close(self) -> None:
        """The verified copies are deleted; the HTTP session is huggingface_hub's, shared
        and closed at exit."""
        with self._verify_lock:
            for fd in self._verified.values():
                os.close(fd)
            self._verified.clear()
            if self._spill is not None:
                self._spill.cleanup()
                self._spill = None


class CachedHubReader(LocalReader):
    """A hub commit read from huggingface_hub's cache (HF_HUB_OFFLINE): a snapshot folder
    whose files are the cache's links to its blobs. Local reads, and the fingerprint of the
    same commit read from the hub, so either way the output is the same and a later online
    run finds it up to date."""

    header_reads = 4  # local files: a few threads overlap the parsing with the reads

    def __init__(self, snapshot: Path, hub: HubSpec, commit: str):
        super().__init__(snapshot)
        self.location, self.commit = hub.location, commit
        self.sizes = {p.name: p.stat().st_size for p in snapshot.iterdir() if p.is_file()}

    def fetch(self, file: str, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of `file` (fewer where it ends first), as HubReader.fetch."""
        with open(self.root / file, "rb") as f:
            f.seek(offset)
            return f.read(n)

    def fingerprint(self, files: list[str]) -> dict[str, object]:
        return {"location": self.location, "revision": self.commit, "files": {f: self.sizes[f] for f in files}}


def _model_info(hub: HubSpec, *, files_metadata: bool = False) -> tuple[str, ModelInfo]:
    """(commit, info) of the revision `hub` names."""
    what = f"{hub.location}@{hub.revision or 'default branch'}"
    info = with_retries(
        what,
        lambda: HfApi(token=hub.token).model_info(
            hub.repo, revision=hub.revision, files_metadata=files_metadata, timeout=TIMEOUT_S
        ),
    )
    if not info.sha:
        raise HubError(
            f"{hub.location}: the hub did not say which commit {hub.revision or 'the default branch'} is",
            kind="hub_request_failed",
            path=str(hub.location),
        )
    return info.sha, info


def resolve_commit(hub: HubSpec) -> str:
    """The commit `hub.revision` names now: one metadata request, no file bytes."""
    return _model_info(hub)[0]


def download(
    hub: HubSpec,
    commit: str,
    file: str,
    fallback: Callable[..., HubError] = REQUEST_FAILED,
    *,
    missing_ok: bool = False,
) -> bytes | None:
    """A small file at `commit`: from huggingface_hub's cache when it is there, else fetched.
    None for a file the commit does not have, when `missing_ok`."""
    cached = try_to_load_from_cache(hub.repo, file, revision=commit)
    if isinstance(cached, str):
        return Path(cached).read_bytes()
    url, headers = hf_hub_url(hub.repo, file, revision=commit), build_hf_headers(token=hub.token)

    def attempt() -> bytes | None:
        try:
            return _get(url, headers).content
        except EntryNotFoundError:
            if missing_ok:
                return None
            raise

    return with_retries(f"{hub.location}/{file}@{commit[:12]}", attempt, fallback)


def _small_file(reader: HubReader | CachedHubReader, hub: HubSpec, file: str) -> bytes:
    """A file model info listed (so it is there), checked with --verify-source."""
    data = download(hub, reader.commit, file)
    assert data is not None  # missing_ok is off: a missing file raised
    published = reader.published if isinstance(reader, HubReader) else None
    if published is not None:
        where = f"{hub.location}/{file}@{reader.commit[:12]}"
        if file not in published:
            raise HubError(
                f"{where}: the hub publishes no sha256 or git id for this file, so --verify-source cannot check it",
                kind="download_failed",
                path=where,
            )
        digest = published[file].hasher(len(data))
        digest.update(data)
        if digest.hexdigest() != published[file].digest:
            raise HubError(
                f"{where}: the {len(data):,} bytes downloaded do not match the {published[file].kind} the hub "
                "publishes: refused",
                kind="download_failed",
                path=where,
            )
    return data


def _read_shard_header(reader: HubReader, file: str) -> tuple[dict[str, TensorBytes], int]:
    """The tensors of one hub shard and its header's size: one speculative ranged read of
    the first SPECULATIVE_HEADER_BYTES (a second for the rest of a longer header), checked
    as the local reader checks them."""
    first = reader.fetch(file, 0, min(SPECULATIVE_HEADER_BYTES, reader.sizes.get(file, SPECULATIVE_HEADER_BYTES)))
    size = reader.sizes.get(file)  # known now from model info or this answer's Content-Range, unless neither said
    if size is None:
        raise HubError(
            f"{reader.location}/{file}@{reader.commit[:12]}: the hub gives no size for this file (neither model info "
            "nor Content-Range)",
            kind="download_failed",
            path=file,
        )

    raw: list[bytes] = []

    def rest(n: int) -> bytes:
        have = first[8 : 8 + n]
        raw.append(have if len(have) == n else have + reader.fetch(file, len(first), 8 + n - len(first)))
        return raw[0]

    tensors, data_start = read_header(first[:8], rest, file, size)
    if isinstance(reader, HubReader):  # what --verify-source compares the verified file with
        reader.header_sha256[file] = hashlib.sha256(first[:8] + raw[0]).hexdigest()
    return tensors, data_start


def _cached(hub: HubSpec) -> CachedHubReader:
    """HF_HUB_OFFLINE: a reader of the snapshot of the commit the cache pins `hub.revision` to."""
    config = try_to_load_from_cache(hub.repo, "config.json", revision=hub.revision)
    if not isinstance(config, str):
        what = f"{hub.location}@{hub.revision or 'default branch'}"
        raise HubError(
            f"{what}: HF_HUB_OFFLINE is set and huggingface_hub's cache has no config.json of it; download the "
            f"repository first (`hf download {hub.repo}`) or unset HF_HUB_OFFLINE",
            kind="hub_request_failed",
            path=what,
        )
    snapshot = Path(config).parent  # .../snapshots/<commit>/, its files linked to the cache's blobs
    return CachedHubReader(snapshot, hub, snapshot.name)


def open_hub(hub: HubSpec, *, quiet: bool = True) -> Source:
    """Hub repository `hub` as a Source: a reader pinned to the commit its revision names now
    (from huggingface_hub's cache with HF_HUB_OFFLINE), and its inventory from config.json, the
    index and each shard's header, with the same checks as a local directory's. Unless `quiet`,
    a bar counts the shard headers read (progress.py's rule: a terminal only)."""
    reader, names = _connect(hub)
    return Source(hub, reader, partial(_read_inventory, reader, hub, names, quiet))


def _connect(hub: HubSpec) -> tuple[HubReader | CachedHubReader, set[str]]:
    """A reader of the commit `hub.revision` names, and the names of the files it has."""
    if constants.HF_HUB_OFFLINE:
        if hub.verify_files:
            raise HubError(
                f"{hub.location}: --verify-source checks files against the digests the hub publishes, and "
                "HF_HUB_OFFLINE is set",
                kind="hub_request_failed",
                path=hub.location,
            )
        cached = _cached(hub)
        return cached, set(cached.sizes)
    try:
        commit, info = _model_info(hub, files_metadata=True)
    except HubError as exc:
        if hub.explicit or exc.kind != "repo_not_found":  # a timeout or a refusal says nothing of a mistyped path
            raise
        # a bare org/name the hub does not have may also have been meant as a local path: say both readings
        raise type(exc)(f"{hub.repo}: no such local directory, and as a hub repository: {exc}", kind=exc.kind) from None
    sizes = {s.rfilename: s.size for s in info.siblings or [] if s.size is not None}  # a mirror may leave sizes out
    published = (
        {s.rfilename: p for s in info.siblings or [] if (p := Published.of(s)) is not None}
        if hub.verify_files
        else None
    )
    return HubReader(hub, commit, sizes, published), {s.rfilename for s in info.siblings or []}


def _read_inventory(reader: HubReader | CachedHubReader, hub: HubSpec, names: set[str], quiet: bool) -> Inventory:
    """The inventory of the commit `reader` reads, whose files are `names`."""
    commit = reader.commit
    config_where = f"{hub.location}/config.json@{commit[:12]}"
    if "config.json" not in names:
        raise CheckpointError(
            f"{config_where}: no config.json in the repository", kind="missing_config", path=str(config_where)
        )
    raw_config = _small_file(reader, hub, "config.json")
    config = parse_config(raw_config, config_where)
    weight_map: dict[str, str] | None
    if INDEX_NAME in names:
        weight_map = load_index(_small_file(reader, hub, INDEX_NAME), INDEX_NAME)
        files = sorted(set(weight_map.values()))
    elif SINGLE_FILE in names:
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise CheckpointError(
            f"{hub.location}@{commit[:12]}: neither {INDEX_NAME} nor {SINGLE_FILE} found", kind="missing_shard"
        )
    for file in files:
        if file not in names:
            raise CheckpointError(
                f"{hub.location}/{file}@{commit[:12]}: shard named in {INDEX_NAME} is not in the repository",
                kind="missing_shard",
            )

    # Latency-bound (Flash: 46 shards), so several shards at a time. map yields in shard
    # order: the first shard in that order that fails is the error reported, as when
    # they were read one by one, and the shards not yet started are cancelled.
    with (
        ThreadPoolExecutor(max_workers=reader.header_reads, thread_name_prefix="hub-header") as pool,
        progress.bar(len(files), "shard headers", "shard", quiet) as shown,
    ):
        headers = []
        for header in pool.map(partial(_read_shard_header, reader), files):
            headers.append(header)
            shown.update(1)
    header_bytes = sum(data_start for _, data_start in headers)
    tensors = merge_shards(
        hub.location, weight_map, [(file, found) for file, (found, _) in zip(files, headers, strict=True)]
    )
    return Inventory(
        hub.location,
        config,
        tensors,
        {f: reader.sizes[f] for f in files},
        header_bytes,
        revision=commit,
        config_bytes=raw_config,
    )
