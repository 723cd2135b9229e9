"""The output directory's life cycle: safety checks, one run per OUT, the partial
directory, publishing.

Outside OUT this module creates or deletes nothing but OUT's hidden siblings, named after
it in its parent directory:

    .OUT.lock          the lock held by the one run that owns OUT, from planning to publish
    .OUT.lock.owner    pid, host and start of that run, so a refused run can name it
    .OUT.partial/      the work in progress and its resume state; renamed to OUT when complete
    .OUT.old-PID/      a previous output while it is being replaced

A symlinked OUT is followed: the output lands in the directory the link points to, the
siblings live beside that directory, and the link itself is never replaced. Leftover
siblings of a killed run are removed by the next run that holds OUT's lock, and only by it.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from dsv4.convert.errors import OutputError
from dsv4.convert.outpath import (
    JOURNAL,
    LOCK,
    OLD,
    OWNER,
    PARTIAL,
    STATE,
    owner_temp_pattern,
    refuse_too_long,
    resolve_output,
    sibling,
    sibling_pattern,
)
from dsv4.model.checkpoint import CONFIG, INDEX_NAME
from dsv4.model.record import CONVERSION_RECORD, LAYOUT_RECORD, TOOL, ConversionRecord, LayoutRecord, RecordError
from dsv4.model.strictjson import (
    StrictJSONError,
    fsync_dir,
    json_bytes,
    loads,
    read_record_bytes,
    write_record,
)

# A run that just took the lock writes its owner record a moment later; a refused run
# looks this long for that record before it says the owner is unknown.
OWNER_GRACE_SECONDS = 2.0


def read_record(path: Path) -> dict[str, Any] | None:
    """A JSON object record (conversion.json, config.json, the resume state, the lock's
    owner), parsed strictly; None if absent, unreadable, not strict JSON or not an object:
    such a file records nothing."""
    try:
        record = loads(read_record_bytes(path))
    except (OSError, StrictJSONError):
        return None
    return record if isinstance(record, dict) else None


def _entries(root: Path, folders: set[str]) -> Iterator[tuple[str, Path]]:
    """`root`'s entries by name relative to it, the files of `folders` (real directories) in
    their place."""
    for entry in sorted(root.iterdir()):
        if entry.name in folders and entry.is_dir() and not entry.is_symlink():
            yield from ((f"{entry.name}/{f.name}", f) for f in sorted(entry.iterdir()))
        else:
            yield entry.name, entry


def _remove(path: Path) -> None:
    """Delete one of OUT's hidden siblings; a symlink is unlinked, never followed."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def _describe(owner: Any) -> str | None:
    """'pid N on host H, running since T' from an owner record, or None when the record is unusable
    or names a process of this host that no longer runs (a killed run's stale record)."""
    if not isinstance(owner, dict):
        return None
    pid, host, since = owner.get("pid"), owner.get("host"), owner.get("since")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(host, str) or not isinstance(since, str):
        return None
    if host == socket.gethostname():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # it runs, under another user
    return f"pid {pid} on host {host}, running since {since}"


@contextmanager
def hold_lock(
    what: Path,
    lock_path: Path,
    owner_path: Path,
    *,
    wait: bool = False,
    on_wait: Callable[[str], object] | None = None,
    instead: str = "pass --wait to wait for it",
) -> Iterator[tuple[int, int]]:
    """Own `what` for the block through the lock file `lock_path` (filelock: flock), with an
    owner record (pid, host, start) at `owner_path` so a refused run can name the owner.
    Held by another run: output_locked (47) naming it and saying what to do `instead`,
    or with `wait` wait for it. Yields the lock file's (device, inode), by which the holder
    can tell later that the file at `lock_path` is still the one it locked."""
    lock = FileLock(lock_path)
    deadline = time.monotonic() + OWNER_GRACE_SECONDS
    while True:
        try:
            lock.acquire(timeout=0)
            break
        except Timeout:
            holder = _describe(read_record(owner_path))
            if holder is None and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            holder = holder or f"whose owner record {owner_path.name} is missing"
            if not wait:
                raise OutputError(
                    f"{what}: locked by another run ({holder}); nothing was changed; {instead}",
                    kind="output_locked",
                    path=str(what),
                ) from None
            if on_wait is not None:
                on_wait(f"{what}: waiting for another run ({holder}) to release it")
            lock.acquire()
            break
    try:
        info = os.stat(lock_path)
        write_record(
            owner_path,
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": datetime.now(UTC).isoformat(timespec="seconds"),
            },
        )
        yield (info.st_dev, info.st_ino)
    finally:
        try:
            owner_path.unlink(missing_ok=True)  # before the release: the next holder's record is never removed
        finally:
            lock.release()


class OutputClaim:
    """OUT, owned by this run: its lock is held and leftovers of killed runs are gone.

    `out` is OUT as the user named it, `path` where it really is (a symlink followed)."""

    def __init__(self, out: Path, path: Path):
        self.out = out
        self.path = path
        self.partial = sibling(path, PARTIAL)
        self.lock_path = sibling(path, LOCK)
        self.owner_path = sibling(path, OWNER)
        self.journal = self.partial / JOURNAL
        self._aside: Path | None = None  # the previous output, while it is being replaced
        self.published = False
        self._lock_file: tuple[int, int] | None = None  # device and inode of the lock file we hold

    # --- taking and releasing OUT ---------------------------------------------------------
    @contextmanager
    def _locked(self, wait: bool, on_wait: Callable[[str], object] | None) -> Iterator[None]:
        with hold_lock(self.out, self.lock_path, self.owner_path, wait=wait, on_wait=on_wait) as self._lock_file:
            yield

    def ensure_owner(self) -> None:
        """Raise output_locked (47) unless the lock file at OUT's lock path is still the
        one this run locked. Removed by hand (or replaced), it no longer keeps another run
        out: that run may own OUT now, so this one must not write on or publish."""
        try:
            info = os.stat(self.lock_path)
            now: tuple[int, int] | None = (info.st_dev, info.st_ino)
        except FileNotFoundError:
            now = None
        if now != self._lock_file:
            raise OutputError(
                f"{self.out}: its lock file {self.lock_path} was {'removed' if now is None else 'replaced'} "
                "while this run held it, so another run may own OUT; this run stopped without publishing",
                kind="output_locked",
                path=str(self.out),
            )

    def discard_partial(self) -> None:
        """Remove the partial directory and its resume state: its work must not be resumed."""
        if os.path.lexists(self.partial):
            _remove(self.partial)

    def _clean_leftovers(self) -> None:
        """Remove what killed runs left beside OUT: previous outputs caught between the two
        renames of a publish, and a partial directory without resume state (one a publish
        already emptied of it, or one killed before its state was written), and a temporary
        owner record a kill mid-write left. A partial directory that some conversion can
        resume is kept until a run needs the place."""
        patterns = (sibling_pattern(self.path, only_old=True), owner_temp_pattern(self.path))
        with os.scandir(self.path.parent) as entries:
            leftovers = [Path(e.path) for e in entries if any(p.fullmatch(e.name) for p in patterns)]
        for old in leftovers:
            _remove(old)
        if os.path.lexists(self.partial) and not (self.partial / STATE).exists():
            _remove(self.partial)

    # --- deciding what may be replaced -------------------------------------------------------
    def refuse_unless_replaceable(self, overwrite: bool) -> None:
        """Nothing to replace (OUT absent or an empty directory), or, with `overwrite`, a
        previous output of this tool; anything else is refused before anything is written."""
        if not os.path.lexists(self.path) or (self.path.is_dir() and not any(self.path.iterdir())):
            return
        if not overwrite:
            raise OutputError(
                f"{self.out}: exists and is not empty (and is not this "
                "conversion's up-to-date output); pass --overwrite to replace it",
                kind="output_exists",
                path=str(self.out),
            )
        reason = self._not_an_output()
        if reason is not None:
            raise OutputError(
                f"{self.out}: --overwrite refused: {reason}; only a previous "
                f"output of {TOOL} is replaced, so move or delete it yourself",
                kind="overwrite_refused",
                path=str(self.out),
            )

    def _not_an_output(self) -> str | None:
        """Why OUT is not a previous output of this tool, or None when it is one: a
        directory holding this tool's conversion.json, its config.json (with the layout
        record where the conversion writes one) and the files they list, and nothing else."""
        if not self.path.is_dir():
            return "it is not a directory"
        record = ConversionRecord.find(self.path)
        if record is None:
            return f"it holds no {TOOL} {CONVERSION_RECORD}"
        config = read_record(self.path / CONFIG)
        if not isinstance(config, dict):
            return f"its {CONFIG} is not a JSON object"
        # a reverse conversion and a draft directory keep the source's config, without the record
        try:
            layout = LayoutRecord.of(config, CONFIG)
        except RecordError:
            layout = None
        if record.has_layout_record and layout is None:
            return f"its {CONFIG} lacks the {LAYOUT_RECORD} layout record"
        files = {CONVERSION_RECORD, CONFIG, INDEX_NAME} | record.files | record.serve_files
        # OUT/serve/ (a draft for a serving target): a folder of files the record lists
        folders = {name.split("/")[0] for name in record.serve_files}
        for name, entry in _entries(self.path, folders):
            if name not in files or entry.is_symlink() or not entry.is_file():
                return f"{name} is not a file {TOOL} wrote"
        return None

    # --- the partial directory and publishing --------------------------------------------
    def start(self, fingerprint: dict[str, Any]) -> bool:
        """Make the partial directory ready for the conversion with this fingerprint;
        True when it already holds that conversion's work (resume), else it starts empty."""
        state = self.partial / STATE
        try:
            resumed = not self.partial.is_symlink() and state.read_bytes() == json_bytes(fingerprint)
        except OSError:
            resumed = False
        if not resumed:
            if os.path.lexists(self.partial):
                _remove(self.partial)
            self.partial.mkdir()
            write_record(state, fingerprint)
        else:  # a kill inside write_record leaves its hidden temporary file: never published
            for entry in self.partial.iterdir():
                if entry.name.startswith("."):
                    _remove(entry)
        return resumed

    def publish(self) -> None:
        """Turn the complete partial directory into OUT: one rename, or with a previous
        output two (OUT aside, partial into place) and the removal of the previous one.
        Only while this run's lock file is still in place (`ensure_owner`)."""
        self.ensure_owner()
        (self.partial / JOURNAL).unlink(missing_ok=True)
        (self.partial / STATE).unlink(missing_ok=True)
        fsync_dir(self.partial)
        if os.path.lexists(self.path):
            self._aside = sibling(self.path, f"{OLD}{os.getpid()}")
            self.path.rename(self._aside)
            try:
                self.partial.rename(self.path)
            except OSError:
                self._aside.rename(self.path)  # put the previous output back
                self._aside = None
                raise
        else:
            self.partial.rename(self.path)
        self.published = True
        fsync_dir(self.path.parent)
        if self._aside is not None:
            _remove(self._aside)
            self._aside = None

    def write_failed(self, exc: OSError) -> OutputError:
        """The exit-42 error for an OSError met while this run owned OUT, saying truly
        what became of OUT."""
        where = exc.filename or self.partial
        reason = exc.strerror or str(exc)
        if self.published:
            after = f"{self.out} was published complete" + (
                f"; the previous output is left in {self._aside}, which the next run on OUT removes"
                if self._aside is not None
                else ""
            )
        elif self._aside is not None:
            after = f"{self.out} was moved aside to {self._aside} and not restored; the next run on OUT removes it"
        elif os.path.exists(self.partial / STATE):  # False, not a second OSError, where it cannot be looked at
            after = f"{self.out} was not changed; rerun to resume from {self.partial}"
        else:
            after = f"{self.out} was not changed"
        return OutputError(f"{where}: {reason}; {after}", kind="write_failed")


@contextmanager
def claim_output(
    out: str | Path, *, source: Path | None = None, wait: bool = False, on_wait: Callable[[str], object] | None = None
) -> Iterator[OutputClaim]:
    """Own OUT for the duration of the block: refuse an unsafe OUT (exit 43-46) before
    anything is touched, take OUT's lock (exit 47 when another run holds it, unless
    `wait`), then remove leftovers of killed runs. `source` is the local source directory,
    None for a hub source. An OSError while taking, cleaning or releasing OUT exits 42;
    one raised by the block passes through unchanged (the block knows what it was doing:
    it turns its own writes' errors into `claim.write_failed`)."""
    out = Path(out)
    try:
        claim = OutputClaim(out, resolve_output(out, source))
        refuse_too_long(out, claim.path)
    except OSError as exc:
        raise OutputError(
            f"{exc.filename or out}: {exc.strerror or exc}; nothing was changed",
            kind="write_failed",
            path=str(exc.filename or out),
        ) from None
    try:
        claim.path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(
            f"{exc.filename or claim.path.parent}: OUT's parent directory cannot be created ({exc.strerror or exc})",
            kind="output_parent",
            path=str(exc.filename or claim.path.parent),
        ) from None
    raised: OSError | None = None
    try:
        with claim._locked(wait, on_wait):
            claim._clean_leftovers()
            try:
                yield claim
            except OSError as exc:
                raised = exc
    except OSError as exc:
        raise claim.write_failed(exc) from None
    if raised is not None:
        raise raised
