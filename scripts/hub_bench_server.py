"""A benchmark hub: a `synth --sparse` checkpoint served as a hub repository, as far away as a CDN.

    .venv/bin/python scripts/hub_bench_server.py DIR [--repo org/flash] [--latency-s 0.05]
        [--stream-mb-s 100] [--max-seconds 3600] [--max-requests 100000]

Serves the files of DIR (read once: each .safetensors file's header, the rest whole; a
shard's tensor data are served as the zeros its holes read as) in the URL layout
huggingface_hub speaks (model info, `resolve` with HEAD, Range, ETag and X-Repo-Commit), so
`convert-dsv4 org/flash` and `hf_hub_download` run unchanged with HF_ENDPOINT pointed at it.
What makes it a distant hub: every request waits `latency_s` before its answer, and every
answer's body is paced to `stream_mb_s` (10^6 bytes per second, each response on its own, as
a CDN caps each stream). It listens on 127.0.0.1 only, and stops by itself after
`max_seconds` or `max_requests`, whichever comes first.

Not the test suite's hub (tests/hubserver.py; a benchmark must not import tests/): that one
holds repositories in memory with commits, pushes and fault injection; this one serves one
directory read-only, sends zeros from one shared buffer (no copy per request) and paces.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

RANGE = re.compile(r"bytes=(\d+)-(\d*)$")
SLICE = 256 * 1024  # bytes sent between two pacing checks: 2.6 ms at 100 MB/s
ZEROS = memoryview(bytes(SLICE))
MAX_CONNECTIONS = 64  # handler threads alive at once; more wait in the listen queue
SOCKET_TIMEOUT = 30.0  # seconds a silent client may hold a handler thread


@dataclass(frozen=True)
class File:
    """A served file: its first bytes (a shard's header; a small file whole), then zeros up to `size`."""

    head: bytes
    size: int
    sha256: str  # what model info publishes: of the real file for a small one, of head and size for a shard


def read_dir(directory: Path) -> dict[str, File]:
    """The files of a `synth --sparse` checkpoint, each shard held as its header."""
    files = {}
    for p in sorted(directory.iterdir()):
        if not p.is_file():
            continue
        size = p.stat().st_size
        with open(p, "rb") as f:
            if p.suffix == ".safetensors":
                (n,) = struct.unpack("<Q", f.read(8))
                head = struct.pack("<Q", n) + f.read(n)
                digest = hashlib.sha256(b"zero-tailed %d\0" % size + head).hexdigest()
            else:
                head = f.read()
                digest = hashlib.sha256(head).hexdigest()
        files[p.name] = File(head, size, digest)
    return files


@dataclass
class Counters:
    requests: int = 0
    ranged: int = 0
    body_bytes: int = 0
    in_flight: int = 0  # answers being waited for or sent
    max_in_flight: int = 0
    ranges: list[tuple[float, float, int, int]] = field(default_factory=list)  # taken, sent (monotonic), start, n


class BenchHub(ThreadingHTTPServer):
    """The server; `url` is its endpoint, `counters` what it has answered."""

    daemon_threads = True

    def __init__(
        self,
        directory: Path,
        repo: str = "org/flash",
        *,
        latency_s: float = 0.05,
        stream_mb_s: float = 100.0,
        max_seconds: float = 3600.0,
        max_requests: int = 100_000,
    ):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repo, self.files = repo, read_dir(directory)
        self.commit = hashlib.sha1(
            json.dumps(sorted((n, f.sha256) for n, f in self.files.items())).encode()
        ).hexdigest()
        self.latency_s, self.rate = latency_s, stream_mb_s * 1e6
        self.max_requests = max_requests
        self.counters = Counters()
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self._deadline = threading.Timer(max_seconds, self.stop)
        self._deadline.daemon = True
        self._thread = threading.Thread(target=self.serve_forever, name="bench-hub", daemon=True)

    def start(self) -> BenchHub:
        self._deadline.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (from any thread but the serving one); again is a no-op."""
        self._deadline.cancel()
        if self._thread.is_alive():
            self.shutdown()
        self.server_close()

    def reset_counters(self) -> Counters:
        """The counters so far, and zero from now on."""
        with self.lock:
            old, self.counters = self.counters, Counters()
        return old

    def admit(self) -> bool:
        """Count one request; False once `max_requests` were answered (the server then stops)."""
        with self.lock:
            self.counters.requests += 1
            total = self.counters.requests
        return total <= self.max_requests

    def process_request(self, request: Any, client_address: Any) -> None:
        self.slots.acquire()  # bounded: at most MAX_CONNECTIONS handler threads
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def __enter__(self) -> BenchHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's HTTP client expects
    timeout = SOCKET_TIMEOUT
    disable_nagle_algorithm = True  # headers and body go out in separate writes
    server: BenchHub

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route()

    def _route(self) -> None:
        hub = self.server
        if not hub.admit():
            self.close_connection = True
            self._send(503, b"request limit reached", {})
            threading.Thread(target=hub.stop, daemon=True).start()
            return
        with hub.lock:
            hub.counters.in_flight += 1
            hub.counters.max_in_flight = max(hub.counters.max_in_flight, hub.counters.in_flight)
        try:
            self.taken = time.monotonic()
            time.sleep(hub.latency_s)
            self._answer()
        finally:
            with hub.lock:
                hub.counters.in_flight -= 1

    def _answer(self) -> None:
        hub, parts = self.server, [unquote(p) for p in urlsplit(self.path).path.split("/")[1:]]
        repo = "/".join(parts[2:4])
        info = parts[:2] == ["api", "models"] and (len(parts) == 4 or (len(parts) == 6 and parts[4] == "revision"))
        if info and repo == hub.repo and self.command == "GET":
            return self._info()
        if len(parts) >= 5 and parts[2] == "resolve" and "/".join(parts[:2]) == hub.repo:
            file = hub.files.get("/".join(parts[4:]))
            if file is not None and parts[3] in ("main", hub.commit):
                return self._resolve(file)
        body = json.dumps({"error": f"no such repository, revision or file: {self.path}"}).encode()
        self._send(404, body, {"X-Error-Code": "EntryNotFound", "Content-Type": "application/json"})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _info(self) -> None:
        hub = self.server
        siblings = [
            {
                "rfilename": name,
                "size": f.size,
                **(
                    {"lfs": {"sha256": f.sha256, "size": f.size, "pointerSize": 134}}
                    if name.endswith(".safetensors")
                    else {}
                ),
            }
            for name, f in hub.files.items()
        ]
        body = json.dumps(
            {"id": hub.repo, "modelId": hub.repo, "sha": hub.commit, "private": False, "siblings": siblings}
        )
        self._send(200, body.encode(), {"Content-Type": "application/json"})

    def _resolve(self, file: File) -> None:
        hub = self.server
        start, end, status = 0, file.size, 200
        headers = {
            "X-Repo-Commit": hub.commit,
            "ETag": f'"{file.sha256}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if (spec := self.headers.get("Range")) is not None:
            m = RANGE.match(spec.strip())
            start = int(m.group(1)) if m else file.size
            end = min(int(m.group(2)) + 1 if m and m.group(2) else file.size, file.size)
            if start >= end:
                return self._send(416, b"", {"Content-Range": f"bytes */{file.size}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{file.size}"
            with hub.lock:
                hub.counters.ranged += 1
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if self.command == "GET":
            self._paced_body(file, start, end, self.taken)

    def _paced_body(self, file: File, start: int, end: int, taken: float) -> None:
        """Bytes [start, end) of `file`, never ahead of `rate` bytes per second since the first."""
        hub, t0, sent = self.server, time.monotonic(), 0
        self.wfile.flush()
        sock = self.connection
        while start + sent < end:
            at = start + sent
            n = min(SLICE, end - at)
            if at < len(file.head):
                chunk = memoryview(file.head)[at : at + n]
            else:
                chunk = ZEROS[:n]
            sock.sendall(chunk)
            sent += len(chunk)
            ahead = sent / hub.rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
        with hub.lock:
            hub.counters.body_bytes += sent
            if self.headers.get("Range") is not None:
                hub.counters.ranges.append((taken, time.monotonic(), start, sent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", type=Path)
    ap.add_argument("--repo", default="org/flash")
    ap.add_argument("--latency-s", type=float, default=0.05)
    ap.add_argument("--stream-mb-s", type=float, default=100.0)
    ap.add_argument("--max-seconds", type=float, default=3600.0)
    ap.add_argument("--max-requests", type=int, default=100_000)
    args = ap.parse_args()
    hub = BenchHub(
        args.directory,
        args.repo,
        latency_s=args.latency_s,
        stream_mb_s=args.stream_mb_s,
        max_seconds=args.max_seconds,
        max_requests=args.max_requests,
    ).start()
    print(
        f"HF_ENDPOINT={hub.url}  (repo {hub.repo}, stops after {args.max_seconds:g} s or {args.max_requests} requests)"
    )
    hub._thread.join()


if __name__ == "__main__":
    main()
