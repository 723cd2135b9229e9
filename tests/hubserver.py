"""A local stand-in for the Hugging Face Hub, for tests that must never reach the internet.

`FakeHub` serves in-memory repositories over HTTP on 127.0.0.1 in the URL layout that
huggingface_hub 2.x speaks, so the product code runs unchanged with HF_ENDPOINT pointed at
it: repo info (`/api/models/{repo}[/revision/{rev}]`), tree listings, paths-info, file
resolution with HEAD, Range, ETag and X-Repo-Commit (`/{repo}/resolve/{rev}/{path}`), and
the write side of `HfApi.create_repo` / `upload_folder` (`/api/repos/create`, `preupload`,
`commit`, and `/api/validate-yaml`, which huggingface_hub calls before it uploads a
README.md: the card's front matter must be a YAML mapping whose `tags` are strings). Every
repository keeps all its commits, so a test can move `main` and still read an older commit
by hash.

What tests observe: `bytes_served[repo]` (file-content bytes sent from `resolve`, the only
route that carries checkpoint data), `requests` (one `Request` per call, with its status and
when it was answered), `pushed` (the commits created through the commit endpoint) and
`faults` (scripted failures, each consumed when it fires). `latency_s` makes every request
wait, as a distant hub does, and `max_ranges_in_flight` says how many ranged reads a client
kept waiting at once.

Faults (`Fault`), on any route: an HTTP error status with headers of choice (503, 429 with
Retry-After), a connection reset without an answer, a stall (the request is accepted and
never answered), a ranged answer from another offset with a truthful Content-Range, a
flipped byte, a body cut short; `after=True` does the work first (a commit lands) and then
fails the answer. `sizes_in_info=False` serves model info as a mirror that leaves file sizes
out. Safetensors files carry LFS metadata (sha256 and size) in model info, as on the hub.

A full-size replica written by `synth --sparse` (160 GB logical, all but its headers file
holes) is served by `commit_sparse_dir`, which keeps only each shard's header in memory.

Why not pytest-httpserver: its handlers answer with a werkzeug Response, so a connection reset
without an answer, a body cut short, an answer after the commit landed and the count of ranged
reads kept waiting at once would need the raw socket anyway, which this module has in its
http.server handler; the hub's routes and commits would stay here either way.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

MAX_BODY = 512 * 1024 * 1024  # largest request body accepted (an inline-base64 commit)
MAX_CONNECTIONS = 32  # handler threads alive at once; more wait in the listen queue
SOCKET_TIMEOUT = 30.0  # seconds a silent client may hold a handler thread
RANGE = re.compile(r"bytes=(\d+)-(\d*)$")
# variables of the caller's environment that must not reach a CLI run under test: a real
# token or endpoint, or a scheduler's array index that would shard the run
FOREIGN_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE", "SLURM_", "JOB_COMPLETION_INDEX", "DSV4_NUM_SHARDS")


@dataclass(frozen=True)
class ZeroTailed:
    """File content that is `head` followed by zeros up to `size` bytes: what a shard of a
    `synth --sparse` checkpoint reads as (its header, then holes), held without the zeros."""

    head: bytes
    size: int

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(self.size)
        stop = max(start, stop)
        from_head = self.head[start:stop]
        return from_head + bytes(stop - start - len(from_head))


Content = bytes | ZeroTailed


def git_blob_oid(data: Content) -> str:
    """git's object id of a file, which `preupload` reports and upload_folder compares. For a
    ZeroTailed file, an id of its head and size instead: git's would hash every zero, and
    this fake only needs ids that differ when contents do."""
    if isinstance(data, ZeroTailed):
        return hashlib.sha1(b"zero-tailed %d\0" % data.size + data.head).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_sha256(data: Content) -> str:
    """The sha256 model info publishes for an LFS file. For a ZeroTailed file, a digest of
    its head and size instead (hashing every zero of a 160 GB replica would take minutes)."""
    if isinstance(data, ZeroTailed):
        return hashlib.sha256(b"zero-tailed %d\0" % data.size + data.head).hexdigest()
    return hashlib.sha256(data).hexdigest()


def _blob_info(path: str, data: Content) -> dict[str, Any]:
    """A sibling's metadata in model info (`?blobs=true`): size and git id, and for an LFS
    file (.safetensors here, as .gitattributes says) its sha256 and size."""
    info: dict[str, Any] = {"size": len(data), "blobId": git_blob_oid(data)}
    if path.endswith(".safetensors"):
        info["lfs"] = {"sha256": lfs_sha256(data), "size": len(data), "pointerSize": 134}
    return info


@dataclass
class Commit:
    oid: str
    files: dict[str, Content]
    message: str
    parent: str | None


@dataclass
class Repo:
    commits: dict[str, Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    private: bool = False


@dataclass(frozen=True)
class Request:
    method: str
    repo: str | None
    route: str  # "info", "tree", "paths-info", "resolve", "create", "preupload", "commit", "validate-yaml", "unknown"
    revision: str | None  # as the client named it: a branch or a commit
    path: str | None  # file path inside the repo, for resolve
    range: tuple[int, int] | None  # [start, end) asked for
    status: int
    nbytes: int  # file-content bytes sent
    authorized: bool  # an Authorization header came with it (its value is never kept)
    answered_at: float  # time.monotonic() when the answer was ready (after the latency)
    arrived_at: float  # time.monotonic() when a handler took the request (before the latency)


@dataclass
class Fault:
    """How to answer requests that `match(method, repo, route, path, range)`, `times` times;
    each such answer comes `delay_s` late. With `status`, an error answer with `headers`
    (e.g. Retry-After); else, on a file read, the body as asked, changed by: `truncate_to`
    (only its first bytes, Content-Range saying so), `shift` (the range `shift` bytes
    further on, Content-Range saying so), `flip` (that byte of the body inverted; nothing
    says so). `reset`: the connection is closed without an answer; `stall`: the request is
    held unanswered until the hub closes. `after`: the request's work is done first (a
    commit lands), then the answer is replaced by the fault."""

    match: Callable[[str, str | None, str, str | None, tuple[int, int] | None], bool]
    status: int | None = 503
    truncate_to: int | None = None
    times: int = 1
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    reset: bool = False
    stall: bool = False
    shift: int = 0
    flip: int | None = None
    after: bool = False

    @property
    def drops_answer(self) -> bool:
        """The fault answers with an error status or with no answer at all."""
        return self.reset or self.stall or self.status is not None


def on(
    route: str, path: str | None = None, *, ranged: bool | None = None, method: str | None = None
) -> Callable[[str, str | None, str, str | None, tuple[int, int] | None], bool]:
    """A Fault's `match`: requests of `route` (and of file `path`, ranged or not, by `method`)."""

    def match(m: str, repo: str | None, r: str, p: str | None, rng: tuple[int, int] | None) -> bool:
        return (
            r == route
            and (path is None or p == path)
            and (ranged is None or (rng is not None) == ranged)
            and (method is None or m == method)
        )

    return match


class FakeHub:
    def __init__(self, token: str | None = None, latency_s: float = 0.0, *, sizes_in_info: bool = True):
        """`token`: when set, write routes answer 401 unless it comes as a Bearer token.
        `latency_s`: each request waits this long before it is answered, as on a distant
        hub, so a test can see how many ranged reads a client keeps in flight
        (`max_ranges_in_flight`) and what the round trips cost it. `sizes_in_info=False`:
        model info lists file names only, as some mirrors do."""
        self.sizes_in_info = sizes_in_info
        self.closing = threading.Event()  # ends stalled requests
        self.repos: dict[str, Repo] = {}
        self.bytes_served: dict[str, int] = defaultdict(int)
        self.requests: list[Request] = []
        self.pushed: list[dict[str, Any]] = []
        self.faults: list[Fault] = []
        self._token = token
        self.latency_s = latency_s
        self.ranges_in_flight = 0
        self.max_ranges_in_flight = 0
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> FakeHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- content -----------------------------------------------------------------------
    def commit(
        self,
        repo: str,
        files: Mapping[str, Content],
        message: str = "update",
        *,
        branch: str = "main",
        replace: bool = True,
        deleted: tuple[str, ...] = (),
    ) -> str:
        """A new commit on `branch`; `replace` drops every file of the parent first."""
        with self._lock:
            r = self.repos.setdefault(repo, Repo())
            parent = r.refs.get(branch)
            tree = {} if replace or parent is None else dict(r.commits[parent].files)
            for path in deleted:
                tree.pop(path, None)
            tree.update(files)
            digest = hashlib.sha1(
                json.dumps([repo, parent, message, sorted((p, git_blob_oid(d)) for p, d in tree.items())]).encode()
            )
            oid = digest.hexdigest()
            r.commits[oid] = Commit(oid, tree, message, parent)
            r.refs[branch] = oid
            return oid

    def commit_dir(self, repo: str, directory: str | Path, message: str = "upload") -> str:
        """A commit holding exactly the files of `directory` (recursively)."""
        root = Path(directory)
        files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        return self.commit(repo, files, message)

    def commit_sparse_dir(self, repo: str, directory: str | Path, message: str = "upload") -> str:
        """A commit of a checkpoint written by `synth --sparse`: each .safetensors file is
        kept as its header and served with the zeros its holes read as (a full-size replica
        costs its headers, not 160 GB); every other file of `directory` as it is."""
        root = Path(directory)
        files: dict[str, Content] = {}
        for p in sorted(root.iterdir()):
            if p.suffix == ".safetensors":
                with open(p, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    files[p.name] = ZeroTailed(struct.pack("<Q", n) + f.read(n), p.stat().st_size)
            elif p.is_file():
                files[p.name] = p.read_bytes()
        return self.commit(repo, files, message)

    def files(self, repo: str, revision: str = "main") -> dict[str, Content]:
        with self._lock:
            r = self.repos[repo]
            return dict(r.commits[r.refs.get(revision, revision)].files)

    def reset_counters(self) -> None:
        with self._lock:
            self.bytes_served.clear()
            self.requests.clear()

    # --- used by the handler -----------------------------------------------------------
    def _resolve(self, repo: str, revision: str) -> tuple[Repo | None, Commit | None]:
        r = self.repos.get(repo)
        if r is None:
            return None, None
        oid = r.refs.get(revision, revision)
        return r, r.commits.get(oid)

    def _fault(
        self, method: str, repo: str | None, route: str, path: str | None, rng: tuple[int, int] | None
    ) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.times > 0 and f.match(method, repo, route, path, rng):
                    f.times -= 1
                    return f
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # connections waiting to be accepted: socketserver's 5 drops the SYNs of a client that
    # opens 16 at once (the hub reader's tensor reads) while the accept loop waits for a core,
    # and each dropped one costs a 1 s retransmit, a ConnectTimeout at HF_HUB_DOWNLOAD_TIMEOUT=1
    request_queue_size = 64
    hub: FakeHub

    def process_request(self, request: Any, client_address: Any) -> None:
        self.hub._slots.acquire()  # bounded: at most MAX_CONNECTIONS handler threads
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.hub._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.hub._slots.release()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's HTTP client expects
    timeout = SOCKET_TIMEOUT
    disable_nagle_algorithm = (
        True  # headers and body go out in separate writes: without this each request stalls ~40 ms
    )
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # tests read `FakeHub.requests` instead of stderr noise

    # --- plumbing ----------------------------------------------------------------------
    @property
    def hub(self) -> FakeHub:
        return self.server.hub

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError(f"request body of {n} bytes is over the {MAX_BODY}-byte limit")
        return self.rfile.read(n)

    def _send(
        self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, *, send_body: bool = True
    ) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body and body and self.command != "HEAD":  # a HEAD answer has a length but no body
            self.wfile.write(body)

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str | None, message: str, extra: dict[str, str] | None = None) -> None:
        headers = {"X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._json(status, {"error": message}, headers)

    def _log(
        self,
        repo: str | None,
        route: str,
        status: int,
        path: str | None = None,
        rng: tuple[int, int] | None = None,
        nbytes: int = 0,
    ) -> None:
        with self.hub._lock:
            self.hub.requests.append(
                Request(
                    self.command,
                    repo,
                    route,
                    self._rev,
                    path,
                    rng,
                    status,
                    nbytes,
                    "Authorization" in self.headers,
                    time.monotonic(),
                    self._arrived_at,
                )
            )
            if nbytes:
                self.hub.bytes_served[repo or ""] += nbytes

    def _authorized_to_write(self) -> bool:
        token = self.hub._token
        return token is None or self.headers.get("Authorization") == f"Bearer {token}"

    # --- routing -----------------------------------------------------------------------
    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    def _wait_latency(self) -> None:
        """Hold every request `latency_s` (a round trip to a distant hub), counting the
        ranged reads held at once."""
        hub = self.hub
        if not hub.latency_s:
            return
        ranged = self.command == "GET" and self.headers.get("Range") is not None
        if ranged:
            with hub._lock:
                hub.ranges_in_flight += 1
                hub.max_ranges_in_flight = max(hub.max_ranges_in_flight, hub.ranges_in_flight)
        time.sleep(hub.latency_s)
        if ranged:
            with hub._lock:
                hub.ranges_in_flight -= 1

    def _route(self) -> None:
        self._arrived_at = time.monotonic()
        self._wait_latency()
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        query = parse_qs(url.query)
        self._rev: str | None = None  # what _log records as the revision asked for
        try:
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo, rest = "/".join(parts[2:4]), parts[4:]
                if rest[1:2]:
                    self._rev = rest[1]
                if not rest and self.command == "GET":
                    return self._info(repo, "main", query)
                if rest[:1] == ["revision"] and len(rest) == 2 and self.command == "GET":
                    return self._info(repo, rest[1], query)
                if rest[:1] == ["tree"] and len(rest) >= 2 and self.command == "GET":
                    return self._tree(repo, rest[1], "/".join(rest[2:]), query)
                if rest[:1] == ["paths-info"] and len(rest) == 2 and self.command == "POST":
                    return self._paths_info(repo, rest[1])
                if rest[:1] == ["preupload"] and len(rest) == 2 and self.command == "POST":
                    return self._preupload(repo, rest[1])
                if rest[:1] == ["commit"] and len(rest) == 2 and self.command == "POST":
                    return self._commit(repo, rest[1])
            if parts == ["api", "repos", "create"] and self.command == "POST":
                return self._create()
            if parts == ["api", "validate-yaml"] and self.command == "POST":
                return self._validate_yaml()
            if len(parts) >= 5 and parts[2] == "resolve" and self.command in ("GET", "HEAD"):
                self._rev = parts[3]
                return self._resolve_file("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        except ValueError as exc:
            self._log(None, "unknown", 400)
            return self._error(400, None, str(exc))
        self._log(None, "unknown", 404, url.path)
        self._error(404, None, f"no route for {self.command} {url.path}")

    def _lookup(self, repo: str, revision: str, route: str) -> Commit | None:
        r, c = self.hub._resolve(repo, revision)
        if r is None:
            self._log(repo, route, 404)
            self._error(404, "RepoNotFound", "Repository not found")
        elif c is None:
            self._log(repo, route, 404)
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return c

    def _failed(self, repo: str | None, route: str) -> bool:
        """Whether a scripted fault answered this (metadata) request instead of the route."""
        fault = self.hub._fault(self.command, repo, route, None, None)
        if fault is None:
            return False
        if fault.delay_s:
            time.sleep(fault.delay_s)
        self._answer_fault(fault, repo, route, None, None)
        return True

    def _answer_fault(
        self, fault: Fault, repo: str | None, route: str, path: str | None, rng: tuple[int, int] | None
    ) -> None:
        if fault.stall:  # accepted, never answered: held until the hub closes
            self._log(repo, route, 0, path, rng)
            self.hub.closing.wait()
            self.close_connection = True
            return
        if fault.reset:  # closed with a TCP reset, no answer
            self._log(repo, route, 0, path, rng)
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        status = fault.status or 503
        self._log(repo, route, status, path, rng)
        self._error(status, None, "injected fault", fault.headers)

    # --- read routes -------------------------------------------------------------------
    def _info(self, repo: str, revision: str, query: dict[str, list[str]]) -> None:
        if self._failed(repo, "info") or (c := self._lookup(repo, revision, "info")) is None:
            return
        blobs = query.get("blobs", ["false"])[0].lower() == "true" and self.hub.sizes_in_info
        siblings = [{"rfilename": p, **(_blob_info(p, d) if blobs else {})} for p, d in sorted(c.files.items())]
        self._log(repo, "info", 200)
        self._json(
            200,
            {"id": repo, "modelId": repo, "sha": c.oid, "private": self.hub.repos[repo].private, "siblings": siblings},
        )

    def _entries(self, c: Commit, prefix: str, recursive: bool) -> list[dict[str, Any]]:
        base = f"{prefix}/" if prefix else ""
        out: dict[str, dict[str, Any]] = {}
        for path, data in sorted(c.files.items()):
            if not path.startswith(base):
                continue
            rest = path[len(base) :]
            if "/" in rest and not recursive:
                folder = base + rest.split("/", 1)[0]
                out[folder] = {"type": "directory", "path": folder, "oid": hashlib.sha1(folder.encode()).hexdigest()}
                continue
            if recursive:
                parts = rest.split("/")[:-1]
                for k in range(1, len(parts) + 1):
                    folder = base + "/".join(parts[:k])
                    out[folder] = {
                        "type": "directory",
                        "path": folder,
                        "oid": hashlib.sha1(folder.encode()).hexdigest(),
                    }
            out[path] = {"type": "file", "path": path, "size": len(data), "oid": git_blob_oid(data)}
        return list(out.values())

    def _tree(self, repo: str, revision: str, prefix: str, query: dict[str, list[str]]) -> None:
        if self._failed(repo, "tree") or (c := self._lookup(repo, revision, "tree")) is None:
            return
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        entries = self._entries(c, prefix, recursive)
        if prefix and not entries:
            self._log(repo, "tree", 404)
            return self._error(404, "EntryNotFound", f"{prefix} does not exist")
        self._log(repo, "tree", 200)
        self._json(200, entries)

    def _paths_info(self, repo: str, revision: str) -> None:
        form = parse_qs(self._body().decode())
        if self._failed(repo, "paths-info") or (c := self._lookup(repo, revision, "paths-info")) is None:
            return
        wanted = set(form.get("paths", []))
        found = [e for e in self._entries(c, "", recursive=True) if e["path"] in wanted]
        self._log(repo, "paths-info", 200)
        self._json(200, found)

    def _resolve_file(self, repo: str, revision: str, path: str) -> None:
        if (c := self._lookup(repo, revision, "resolve")) is None:
            return
        data = c.files.get(path)
        if data is None:
            self._log(repo, "resolve", 404, path)
            return self._error(404, "EntryNotFound", f"{path} does not exist at {c.oid}")
        headers = {
            "X-Repo-Commit": c.oid,
            "ETag": f'"{git_blob_oid(data)}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        rng: tuple[int, int] | None = None
        status, body = 200, data
        if (spec := self.headers.get("Range")) is not None:
            m = RANGE.match(spec.strip())
            start = int(m.group(1)) if m else len(data)
            end = min(int(m.group(2)) + 1 if m and m.group(2) else len(data), len(data))
            if start >= len(data) or start >= end:
                self._log(repo, "resolve", 416, path)
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            rng, status, body = (start, end), 206, data[start:end]
        fault = self.hub._fault(self.command, repo, "resolve", path, rng)
        if fault is not None and fault.delay_s:
            time.sleep(fault.delay_s)
        if fault is not None and fault.drops_answer:
            return self._answer_fault(fault, repo, "resolve", path, rng)
        if fault is not None and rng is not None and fault.shift:
            rng = (min(rng[0] + fault.shift, len(data) - 1), min(rng[1] + fault.shift, len(data)))
            body = data[rng[0] : rng[1]]
        if fault is not None and fault.truncate_to is not None:
            body = body[: fault.truncate_to]
        if fault is not None and fault.flip is not None:
            flipped = bytearray(body[:])
            flipped[fault.flip] ^= 0xFF
            body = bytes(flipped)
        if rng is not None:
            headers["Content-Range"] = f"bytes {rng[0]}-{rng[0] + len(body) - 1}/{len(data)}"
        send = self.command == "GET"
        if isinstance(body, ZeroTailed) and send:
            body = body[:]  # a whole-file GET gets the zeros too, as from a real hub
        self._log(repo, "resolve", status, path, rng, len(body) if send else 0)
        self._send(status, body, headers, send_body=send)

    # --- write routes ------------------------------------------------------------------
    def _write_denied(self, repo: str | None, route: str) -> bool:
        if self._authorized_to_write():
            return False
        self._log(repo, route, 401)
        self._error(401, None, "Invalid credentials in Authorization header")
        return True

    def _create(self) -> None:
        payload = json.loads(self._body() or b"{}")
        repo = f"{payload.get('organization')}/{payload.get('name')}"
        if self._write_denied(repo, "create"):
            return
        if repo in self.hub.repos:
            self._log(repo, "create", 409)  # the hub's 409 still names the repo's url, which create_repo reads
            return self._json(
                409,
                {"error": "You already created this model repo", "url": f"{self.hub.url}/{repo}"},
                {"X-Error-Message": "You already created this model repo"},
            )
        self.hub.commit(
            repo, {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}, "initial commit"
        )
        self.hub.repos[repo].private = payload.get("visibility") == "private"
        self._log(repo, "create", 200)
        self._json(200, {"url": f"{self.hub.url}/{repo}", "name": repo})

    def _validate_yaml(self) -> None:
        """The hub's model-card metadata check, as far as these tests need it: the front
        matter between the leading `---` lines is a YAML mapping and its tags are strings."""
        content = json.loads(self._body())["content"]
        match = re.match(r"---\n(.*?)\n---\n", content, re.DOTALL)
        try:
            meta = yaml.safe_load(match.group(1)) if match else {}
        except yaml.YAMLError as exc:
            meta, problem = None, f"not YAML: {exc}"
        else:
            tags = meta.get("tags", []) if isinstance(meta, dict) else None
            problem = "the metadata is not a mapping" if not isinstance(meta, dict) else None
            if problem is None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
                problem = '"tags" must be an array of strings'
        if problem is not None:
            self._log(None, "validate-yaml", 400)
            return self._json(400, {"errors": [{"message": problem}]}, {"X-Error-Message": problem})
        self._log(None, "validate-yaml", 200)
        self._json(200, {"errors": [], "warnings": []})

    def _preupload(self, repo: str, revision: str) -> None:
        payload = json.loads(self._body())
        if self._write_denied(repo, "preupload") or (c := self._lookup(repo, revision, "preupload")) is None:
            return
        files = [
            {
                "path": f["path"],
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": git_blob_oid(c.files[f["path"]]) if f["path"] in c.files else None,
            }
            for f in payload["files"]
        ]
        self._log(repo, "preupload", 200)
        self._json(200, {"files": files, "commitOid": c.oid})

    def _commit(self, repo: str, revision: str) -> None:
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        fault = self.hub._fault(self.command, repo, "commit", None, None)
        if fault is not None and not fault.after:
            return self._answer_fault(fault, repo, "commit", None, None)
        if self._write_denied(repo, "commit") or (c := self._lookup(repo, revision, "commit")) is None:
            return
        header = next(x["value"] for x in lines if x["key"] == "header")
        if header.get("parentCommit") not in (None, c.oid):  # the hub refuses a commit on a moved branch
            self._log(repo, "commit", 412)
            return self._error(
                412,
                None,
                f"A commit has happened since. Parent commit {header['parentCommit']} is not the head {c.oid} of "
                f"{revision}",
            )
        added = {x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines if x["key"] == "file"}
        deleted = tuple(x["value"]["path"] for x in lines if x["key"] == "deletedFile")
        if any(x["key"] not in ("header", "file", "deletedFile") for x in lines):
            self._log(repo, "commit", 400)
            return self._error(400, None, "this fake hub accepts inline files and file deletions only")
        branch = revision if revision in self.hub.repos[repo].refs else "main"
        oid = self.hub.commit(repo, added, header["summary"], branch=branch, replace=False, deleted=deleted)
        record = {
            "repo": repo,
            "oid": oid,
            "parent": c.oid,
            "message": header["summary"],
            "description": header.get("description", ""),
        }
        with self.hub._lock:
            self.hub.pushed.append({**record, "files": {p: len(d) for p, d in added.items()}, "deleted": list(deleted)})
        if fault is not None:  # the commit landed; its answer is lost
            return self._answer_fault(fault, repo, "commit", None, None)
        self._log(repo, "commit", 200)
        self._json(200, {"commitUrl": f"{self.hub.url}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None})


def hub_env(hub: FakeHub, hf_home: Path, **extra: str) -> dict[str, str]:
    """Environment for a CLI run against `hub`, with its own HF_HOME (cache, token file)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN_ENV)}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


# Retry waits for tests that make a hub fail until the retries run out: the same retries,
# 50 ms apart instead of seconds (convert/sources/hub.py's BACKOFF_S).
QUICK_RETRIES = "import dsv4.convert.sources.hub as hub; hub.BACKOFF_S = hub.BACKOFF_MAX_S = 0.05\n"


def run_cli(
    *args: str, env: dict[str, str], prelude: str = "", timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`convert-dsv4 ARGS` in a fresh interpreter: huggingface_hub reads HF_ENDPOINT and
    the rest of its settings once, at import, so each run needs its own process. `prelude`:
    Python run first (QUICK_RETRIES)."""
    cmd = [sys.executable, "-c", f"{prelude}from dsv4.convert.cli.main import main; main()", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
