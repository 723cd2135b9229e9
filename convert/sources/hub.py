"""Hub reads, whatever the hub: retries, checked ranged reads, small files, the commit.

The backend (convert/sources/hub_protocol.py; the Hugging Face Hub's is convert/sources/hf_backend.py)
makes one attempt at each request; this module decides what a response must be and how
often to ask again. convert/sources/hub_source.py opens a repository as a Source with them.

What a response must be: a transient failure (the backend says which: for the Hugging Face
Hub an HTTP 408, 429 or 5xx, a timeout, a dropped or reset connection; for every hub a
ranged answer that is not the range asked for) is retried RETRIES times with backoff, each
wait one `warning:` line of ours; a Retry-After is waited for when it is at most
RETRY_AFTER_CAP_S, and refused at once when longer. A ranged answer must be 206 with a
Content-Range naming exactly the bytes asked for and a body of that length. Every request
is pinned to the commit the revision was resolved to, so a branch that moves during a
conversion cannot mix two versions of a checkpoint.
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
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TypeVar

from dsv4.convert.errors import HubError
from dsv4.convert.sources.hub_protocol import (
    Answer,
    FileMissing,
    HubBackend,
    Published,
    RangedSession,
    RepoInfo,
    Transient,
)
from dsv4.convert.sources.local import LocalReader
from dsv4.convert.sources.source import HubSpec, ended_early
from dsv4.model.errors import CheckpointError, DSV4Error

T = TypeVar("T")
log = logging.getLogger("dsv4.hub")

RETRIES = 5  # after the first attempt
BACKOFF_S = 1.0  # the first wait; doubled after each retry, up to BACKOFF_MAX_S
BACKOFF_MAX_S = 8.0
RETRY_AFTER_CAP_S = 300  # the longest Retry-After waited for; a longer one fails at once
# First read of a shard, its header whole in one round trip: Flash's headers are 176 kB
# (69,187 tensors in 46 shards), a 256 KiB read costs the same round trip as 8 bytes.
SPECULATIVE_HEADER_BYTES = 256 * 1024
VERIFY_CHUNK_BYTES = 16 * 2**20  # --verify-source: one ranged read of a whole-file download
CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)$")
REQUEST_FAILED = partial(HubError, kind="hub_request_failed")  # a failed request, unless the caller says


def default_backend() -> HubBackend:
    """The Hugging Face Hub (convert/sources/hf_backend.py), imported on first use: its HTTP stack
    costs start-up time that a local source never pays."""
    from dsv4.convert.sources.hf_backend import HF_HUB

    return HF_HUB


class _Retry(Exception):
    """A response this module finds wanting (the wrong range): worth another attempt."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.problem = Transient(reason)


def _final(backend: HubBackend, exc: BaseException, what: str, fallback: Callable[..., HubError]) -> HubError:
    """The backend's exception `exc` as this tool's one-line error about `what`."""
    refusal = backend.refusal(exc)
    if refusal.kind is None:
        return fallback(f"{what}: {refusal.detail}", path=str(what))
    return HubError(f"{what}: {refusal.detail}", kind=refusal.kind, path=str(what))


@contextmanager
def hub_errors(
    what: str, fallback: Callable[..., HubError] = REQUEST_FAILED, backend: HubBackend | None = None
) -> Iterator[None]:
    """Turn the exceptions of `backend` (default: the Hugging Face Hub's) into this tool's
    one-line errors about `what`."""
    try:
        yield
    except DSV4Error:
        raise
    except Exception as exc:
        raise _final(backend or default_backend(), exc, what, fallback) from None


def with_retries(
    backend: HubBackend, what: str, attempt: Callable[[], T], fallback: Callable[..., HubError] = REQUEST_FAILED
) -> T:
    """`attempt()`, a call to `backend`, retried on transient failures (module docstring), as
    one-line errors about `what`."""
    backoff, retry = BACKOFF_S, 0
    while True:
        try:
            return attempt()
        except DSV4Error:
            raise
        except Exception as exc:
            problem = exc.problem if isinstance(exc, _Retry) else backend.transient(exc)
            if problem is None:
                raise _final(backend, exc, what, fallback) from None
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


def repo_info(backend: HubBackend, hub: HubSpec, *, files_metadata: bool = False) -> tuple[str, RepoInfo]:
    """(commit, info) of the revision `hub` names."""
    what = f"{hub.location}@{hub.revision or 'default branch'}"
    info = with_retries(backend, what, lambda: backend.repo_info(hub, files_metadata=files_metadata))
    if not info.commit:
        raise HubError(
            f"{hub.location}: the hub did not say which commit {hub.revision or 'the default branch'} is",
            kind="hub_request_failed",
            path=str(hub.location),
        )
    return info.commit, info


def resolve_commit(hub: HubSpec, backend: HubBackend | None = None) -> str:
    """The commit `hub.revision` names now on `backend` (default: the Hugging Face Hub):
    one metadata request, no file bytes."""
    return repo_info(backend or default_backend(), hub)[0]


def download(
    hub: HubSpec,
    commit: str,
    file: str,
    fallback: Callable[..., HubError] = REQUEST_FAILED,
    *,
    missing_ok: bool = False,
    backend: HubBackend | None = None,
    session: RangedSession | None = None,
) -> bytes | None:
    """A small file at `commit` on `backend` (default: the Hugging Face Hub): from its cache
    when it is there, else fetched (through `session` when given). None for a file the
    commit does not have, when `missing_ok`."""
    backend = backend or default_backend()
    cached = backend.cached_file(hub, file, commit)
    if cached is not None:
        return cached.read_bytes()
    getter = session or backend.session(hub)
    where = f"{hub.location}/{file}@{commit[:12]}"

    def attempt() -> bytes | None:
        try:
            return getter.get(file, commit, None).body
        except FileMissing:
            if missing_ok:
                return None
            raise CheckpointError(
                f"{where}: not in the repository at this commit", kind="missing_shard", path=where
            ) from None

    return with_retries(backend, where, attempt, fallback)


class HubReader:
    """ByteReader over one hub commit: each read is one ranged GET, checked (module docstring).

    Tensor reads are latency-bound: Flash's draft is ~1,900 ranged reads of 3 MB on average,
    30 ms at a CDN's 100 MB/s per stream against a 50 ms round trip, so 8 in flight reach
    about a third of 8 streams' bandwidth. The executor keeps `parallel_reads` in flight,
    each streamed into a buffer of its own (convert/execute.py's CHUNK). The inventory's
    reads (config.json, the index, the shard headers) are made `header_reads` at a time: all
    of Flash's 48 in one round trip (a header read holds at most SPECULATIVE_HEADER_BYTES).
    `sizes`: the file sizes the hub listed; a mirror may leave them out, and then the first
    ranged answer's Content-Range gives each file's size.
    """

    parallel_reads = 16  # 8 -> 16: Flash's draft in 16.8-16.9 s, was 23.1-26.3 s (docs/results/hub-convert.md)
    header_reads = 64

    def __init__(
        self,
        hub: HubSpec,
        backend: HubBackend,
        commit: str,
        sizes: dict[str, int],
        published: dict[str, Published] | None = None,
    ):
        """`published`: with --verify-source, each file's digest as the hub lists it."""
        self.location = hub.location
        self.backend = backend
        self.commit = commit
        self.sizes = sizes
        self.bytes_read = 0
        self.header_sha256: dict[str, str] = {}  # of each shard's header bytes as the inventory parsed them
        self.published = published
        self.session = backend.session(hub)
        self._lock = threading.Lock()
        self._verify_lock = threading.Lock()
        self._verified: dict[str, int] = {}  # file -> descriptor of its verified local copy
        self._spill: tempfile.TemporaryDirectory[str] | None = None

    def where(self, file: str) -> str:
        return f"{self.location}/{file}@{self.commit[:12]}"

    def _ranged(self, file: str, offset: int, n: int, into: memoryview | None) -> Answer:
        """One attempt at bytes [offset, offset + n) (fewer only where the file ends first);
        `into`: the buffer the body is streamed into."""
        try:
            answer = self.session.get(file, self.commit, (offset, offset + n), into)
        except FileMissing:
            raise CheckpointError(
                f"{self.where(file)}: not in the repository at this commit", kind="missing_shard", path=self.where(file)
            ) from None
        if answer.status != 206:  # the Range was ignored: retrying would pull whole shards again
            raise HubError(
                f"{self.where(file)}: bytes {offset}..{offset + n}: the hub answered HTTP {answer.status}, "
                "not 206 Partial Content",
                kind="download_failed",
                path=self.where(file),
            )
        m = CONTENT_RANGE.match((answer.content_range or "").strip())
        if m is None:
            raise _Retry(f"no Content-Range in the answer (got {answer.content_range!r})")
        start, end, total = int(m.group(1)), int(m.group(2)) + 1, m.group(3)
        got = answer.length
        if total != "*":
            with self._lock:
                self.sizes.setdefault(file, int(total))
        size = self.sizes.get(file)
        if start != offset or got != end - start:
            raise _Retry(f"the hub sent bytes {start}..{end} ({got} bytes) for the range {offset}..{offset + n}")
        if got < n and (size is None or end < size):
            raise _Retry(f"got {got} of {n} bytes")
        if got > n:
            raise _Retry(f"the hub sent {got} bytes for a {n}-byte range")
        return answer

    def _request(self, file: str, offset: int, n: int, into: memoryview | None = None) -> Answer:
        """Bytes [offset, offset + n) of `file`, checked and retried (fewer only where the
        file ends first); `into`: the buffer they are streamed into."""
        size = self.sizes.get(file)
        if size is not None and offset + n > size:
            raise ended_early(self.where(file), size, offset, n)
        return with_retries(
            self.backend,
            f"{self.where(file)}: bytes {offset}..{offset + n}",
            partial(self._ranged, file, offset, n, into),
            partial(HubError, kind="download_failed"),
        )

    def fetch(self, file: str, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of `file`, checked (fewer only where the file ends
        first). Not counted in bytes_read (inventory reads headers with it; read_into
        counts tensor data)."""
        return self._request(file, offset, n).body

    def read_into(self, file: str, offset: int, buf: memoryview) -> None:
        """The tensor bytes at `offset`, streamed into `buf` as they come (with
        --verify-source: read from the verified copy)."""
        if self.published is not None:
            data = os.pread(self._verified_copy(file), len(buf), offset)
            got = len(data)
            buf[:got] = data
        else:
            got = self._request(file, offset, len(buf), buf).length
        if got != len(buf):
            raise ended_early(self.where(file), offset + got, offset, len(buf))
        with self._lock:  # called from several reader threads
            self.bytes_read += len(buf)

    def _refused(self, file: str, why: str) -> HubError:
        return HubError(f"{self.where(file)}: {why}", kind="download_failed", path=self.where(file))

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
                raise self._refused(
                    file, "the hub publishes no sha256 or git id for this file, so --verify-source cannot check it"
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
                raise self._refused(
                    file,
                    f"the {size:,} bytes downloaded do not match the {published.kind} the hub publishes "
                    f"({published.digest[:16]}...): refused, nothing written from it",
                )
            fd = os.open(copy, os.O_RDONLY)
            if (header := self.header_sha256.get(file)) is not None:
                n = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
                if hashlib.sha256(os.pread(fd, 8 + n, 0)).hexdigest() != header:
                    os.close(fd)
                    raise self._refused(
                        file, "the header the plan was made from differs from the verified file's: refused"
                    )
            self._verified[file] = fd
            return fd

    def fingerprint(self, files: list[str]) -> dict[str, object]:
        return {"location": self.location, "revision": self.commit, "files": {f: self.sizes[f] for f in files}}

    def verify_unchanged(self, files: list[str]) -> None:
        """Nothing to do: every request is pinned to one commit, which cannot change."""

    def close(self) -> None:
        """The verified copies are deleted; the HTTP session is the backend's, shared and
        closed at exit."""
        with self._verify_lock:
            for fd in self._verified.values():
                os.close(fd)
            self._verified.clear()
            if self._spill is not None:
                self._spill.cleanup()
                self._spill = None


class CachedHubReader(LocalReader):
    """A hub commit read from the backend's download cache (offline): a snapshot folder
    whose files are the cache's links to its blobs. Local reads, and the fingerprint of the
    same commit read from the hub, so either way the output is the same and a later online
    run finds it up to date."""

    header_reads = 4  # local files: a few threads overlap the parsing with the reads
    published = None  # offline: no digests to check against (--verify-source is refused)

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
