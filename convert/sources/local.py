"""Local sources: a checkpoint directory, opened as a Source (convert/sources/source.py).

The executor reads exact byte ranges (never whole shards), so the reader is positional:
`read_into(file, offset, buffer)` fills the buffer from that offset and counts the bytes.
It also has `read_view`, which reads with direct I/O (the disk writes into the buffer
itself: no copy through the page cache) and returns the view of the bytes asked for.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

from dsv4.convert.errors import PlanError
from dsv4.convert.sources.inventory import read_inventory
from dsv4.convert.sources.source import Source, ended_early
from dsv4.model.errors import CheckpointError


def open_local(root: Path) -> Source:
    """Checkpoint directory `root` (index + shards, or one model.safetensors) as a Source:
    its inventory from config.json, the index and each shard's header, and a LocalReader."""
    reader = LocalReader(root)  # first: it notes each file before a header is read
    return Source(root, reader, lambda: read_inventory(root))


def _identity(info: os.stat_result) -> tuple[int, int, int, int, int]:
    """What changes when a file is rewritten, in place or by a rename over it: device and
    inode, size, modification time, and the inode's change time (which no user can set
    back, unlike the modification time)."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


# Direct I/O wants the file offset, the length and the buffer's address aligned to the
# device's logical block: 4096 covers every block size Linux file systems use (512, 4096).
DIRECT_ALIGN = 4096


class LocalReader:
    """Positional reads from the files of a local checkpoint directory.

    Tensor data are read with O_DIRECT where the file system takes it (`read_view`): one
    copy fewer than a read through the page cache (where the CPU copies every byte once
    more), no page-cache churn, and the disk kept busy by several requests at once
    (`parallel_reads`) instead of the kernel's read-ahead behind one reader. A file system
    without direct I/O (EINVAL) is read through the page cache, as `read_into` does.

    It notes every file's identity when it is made, before the inventory reads a header, so
    `verify_unchanged` can tell, before an output is published, that a file it read was
    rewritten meanwhile."""

    parallel_reads = 4  # direct reads in flight: no kernel read-ahead queues more for us

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.bytes_read = 0
        self._fds: dict[str, int] = {}
        self._direct_fds: dict[str, int | None] = {}  # None: this file system refused O_DIRECT at open
        self._buffered: set[str] = set()  # files whose file system refused a direct read
        self._lock = threading.Lock()  # guards the fd tables and bytes_read (several reader threads)
        self._identities: dict[str, tuple[int, int, int, int, int]] = {}
        try:
            with os.scandir(self.root) as entries:
                self._identities = {e.name: _identity(e.stat()) for e in entries if e.is_file()}
        except OSError:
            pass  # a directory we may not list (mode 0111): files are noted when fingerprinted

    def _open(self, file: str, flags: int) -> int:
        try:
            return os.open(self.root / file, os.O_RDONLY | flags)
        except FileNotFoundError:
            raise CheckpointError(
                f"{self.root / file}: shard disappeared while converting",
                kind="missing_shard",
                path=str(self.root / file),
            ) from None

    def _fd(self, file: str) -> int:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                fd = self._fds[file] = self._open(file, 0)
                # planned ranges are read front to back: ask for aggressive read-ahead
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            return fd

    def _direct_fd(self, file: str) -> int | None:
        with self._lock:
            if file not in self._direct_fds:
                try:
                    self._direct_fds[file] = self._open(file, os.O_DIRECT) if hasattr(os, "O_DIRECT") else None
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    self._direct_fds[file] = None
            return None if file in self._buffered else self._direct_fds[file]

    def read_into(self, file: str, offset: int, buf: memoryview) -> None:
        fd, done = self._fd(file), 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n == 0:
                raise ended_early(str(self.root / file), offset + done, offset, len(buf))
            done += n
        with self._lock:
            self.bytes_read += done

    def read_view(self, file: str, offset: int, n: int, buf: memoryview) -> memoryview:
        """The n bytes of `file` at `offset`, read into `buf` (page-aligned, at least
        n + 2 * DIRECT_ALIGN bytes): the view of buf that holds them. Direct I/O reads the
        aligned blocks around the range; bytes_read counts the n bytes asked for."""
        fd = self._direct_fd(file)
        if fd is not None:
            lead = offset % DIRECT_ALIGN
            need = lead + n
            span = -(-need // DIRECT_ALIGN) * DIRECT_ALIGN
            done = 0
            try:
                while done < need:
                    got = os.preadv(fd, [buf[done:span]], offset - lead + done)
                    done += got
                    # a direct read stops short only at the end of the file
                    if done < need and (got == 0 or done % DIRECT_ALIGN):
                        raise ended_early(str(self.root / file), offset - lead + done, offset, n)
            except OSError as exc:
                if exc.errno != errno.EINVAL or done:
                    raise
                with self._lock:  # the file system takes O_DIRECT at open but not at read
                    self._buffered.add(file)
            else:
                with self._lock:
                    self.bytes_read += n
                return buf[lead:need]
        self.read_into(file, offset, buf[:n])
        return buf[:n]

    def fingerprint(self, files: list[str]) -> dict[str, object]:
        stats = {f: (self.root / f).stat() for f in files}
        for f, info in stats.items():
            self._identities.setdefault(f, _identity(info))
        return {
            "location": str(self.root.resolve()),
            "files": {f: s.st_size for f, s in stats.items()},
            "mtime_ns": {f: s.st_mtime_ns for f, s in stats.items()},
        }

    def verify_unchanged(self, files: list[str]) -> None:
        """Raise source_changed (one line naming the file) when one of `files` is not
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
            now += [
                _identity(os.fstat(fd)) for fd in (self._fds.get(file), self._direct_fds.get(file)) if fd is not None
            ]
            changed = next((n for n in now if n != noted), None)
            if not now or changed is not None:
                what = "was removed" if not now else _what_changed(noted, changed)
                raise PlanError(
                    f"{path}: the source file {what} during the conversion; nothing was published: rerun once the "
                    "source no longer changes",
                    kind="source_changed",
                    path=str(path),
                )

    def close(self) -> None:
        with self._lock:
            for fd in [*self._fds.values(), *self._direct_fds.values()]:
                if fd is not None:
                    os.close(fd)
            self._fds.clear()
            self._direct_fds.clear()
            self._buffered.clear()


def _what_changed(then: tuple[int, int, int, int, int], now: tuple[int, int, int, int, int]) -> str:
    if then[:2] != now[:2]:
        return "was replaced by another file"
    if then[2] != now[2]:
        return f"changed size from {then[2]:,} to {now[2]:,} bytes"
    if then[3] != now[3]:
        return "was rewritten (its modification time changed)"
    return (
        "changed status (its change time moved: rewritten with its old modification time, or its mode or owner changed)"
    )
