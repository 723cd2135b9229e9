"""Reading planned byte ranges from a checkpoint: a local directory or a model hub repo.

The executor reads exact byte ranges (never whole shards), so readers are positional:
`read_into(file, offset, buffer)` fills the buffer from that offset and counts the bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from dsv4.model.errors import MissingShardError, TruncatedShardError


class ByteReader(Protocol):
    bytes_read: int

    def read_into(self, file: str, offset: int, buf: memoryview) -> None: ...

    def fingerprint(self, files: list[str]) -> dict[str, object]:
        """What identifies the source's content: its location and, per file read, its size
        plus what changes with its content (mtime locally, the commit on a hub)."""
        ...

    def close(self) -> None: ...


class LocalReader:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.bytes_read = 0
        self._fds: dict[str, int] = {}

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            try:
                fd = self._fds[file] = os.open(self.root / file, os.O_RDONLY)
                # planned ranges are read front to back: ask for aggressive read-ahead
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except FileNotFoundError:
                raise MissingShardError(f"{self.root / file}: shard disappeared while converting", path=str(self.root / file)) from None
        return fd

    def read_into(self, file: str, offset: int, buf: memoryview) -> None:
        fd, done = self._fd(file), 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n == 0:
                raise TruncatedShardError(f"{self.root / file}: ends at byte {offset + done}, before the planned range {offset}..{offset + len(buf)}", path=str(self.root / file))
            done += n
        self.bytes_read += done

    def fingerprint(self, files: list[str]) -> dict[str, object]:
        stats = {f: (self.root / f).stat() for f in files}
        return {"location": str(self.root.resolve()), "files": {f: s.st_size for f, s in stats.items()}, "mtime_ns": {f: s.st_mtime_ns for f, s in stats.items()}}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
