"""Reading planned byte ranges from a checkpoint: a local directory or a model hub repo.

The executor reads exact byte ranges (never whole shards), so readers are positional:
`read_into(file, offset, buffer)` fills the buffer from that offset and counts the bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from dsv4.convert.errors import SourceChangedError
from dsv4.model.errors import MissingShardError, TruncatedShardError


class ByteReader(Protocol):
    bytes_read: int

    def read_into(self, file: str, offset: int, buf: memoryview) -> None: ...

    def fingerprint(self, files: list[str]) -> dict[str, object]:
        """What identifies the source's content: its location and, per file read, its size
        plus what changes with its content (mtime locally, the commit on a hub)."""
        ...

    def close(self) -> None: ...


def _identity(info: os.stat_result) -> tuple[int, int, int, int, int]:
    """What changes when a file is rewritten, in place or by a rename over it: device and
    inode, size, modification time, and the inode's change time (which no user can set
    back, unlike the modification time)."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


class LocalReader:
    """Reads a local checkpoint directory. It notes every file's identity when it is made,
    before the inventory reads a header, so `verify_unchanged` can tell, before an output
    is published, that a file it read was rewritten meanwhile."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.bytes_read = 0
        self._fds: dict[str, int] = {}
        self._identities: dict[str, tuple[int, int, int, int, int]] = {}
        try:
            with os.scandir(self.root) as entries:
                self._identities = {e.name: _identity(e.stat()) for e in entries if e.is_file()}
        except OSError:
            pass  # a directory we may not list (mode 0111): files are noted when fingerprinted

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
        for f, info in stats.items():
            self._identities.setdefault(f, _identity(info))
        return {"location": str(self.root.resolve()), "files": {f: s.st_size for f, s in stats.items()}, "mtime_ns": {f: s.st_mtime_ns for f, s in stats.items()}}

    def verify_unchanged(self, files: list[str]) -> None:
        """Raise SourceChangedError (one line naming the file) when one of `files` is not
        the file it was when this reader was made: another size, modification or change
        time, or another inode (replaced), whether read through its path or our open fd."""
        for file in files:
            noted = self._identities.get(file)
            if noted is None:
                continue  # not there when planned (a single-file checkpoint has no index)
            path = self.root / file
            try:
                now = [_identity(os.stat(path))]
            except FileNotFoundError:
                now = []
            if file in self._fds:
                now.append(_identity(os.fstat(self._fds[file])))
            changed = next((n for n in now if n != noted), None)
            if not now or changed is not None:
                what = "was removed" if not now else _what_changed(noted, changed)
                raise SourceChangedError(f"{path}: the source file {what} during the conversion; nothing was published: rerun once the source no longer changes", path=str(path))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _what_changed(then: tuple[int, int, int, int, int], now: tuple[int, int, int, int, int]) -> str:
    if then[:2] != now[:2]:
        return "was replaced by another file"
    if then[2] != now[2]:
        return f"changed size from {then[2]:,} to {now[2]:,} bytes"
    if then[3] != now[3]:
        return "was rewritten (its modification time changed)"
    return "changed status (its change time moved: rewritten with its old modification time, or its mode or owner changed)"
