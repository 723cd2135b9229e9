"""Ctrl-C (SIGINT) and SIGTERM, which CI runners and Slurm send: how a command stops.

Whatever moment a signal lands, the command ends with one line, `interrupted`, and exit
130 (SIGINT) or 143 (SIGTERM) (convert/exit_codes.py), never a traceback:

* while the command runs, the first signal raises `Interrupted` in the main thread, which
  unwinds like KeyboardInterrupt: every `finally` runs, so OUT's lock is released, files
  are closed and the partial directory keeps its resume state. It is a BaseException, not
  an Exception, so no `except Exception` takes it for a finding (a cancelled `check` never
  blames the checkpoint); code that catches broadly for its own reasons calls
  `raise_if_interrupted()` first.
* a second signal while that unwinding runs, or any signal after the command finished
  (its result line printed, the interpreter joining threads at exit), prints the line if
  it is not printed yet and exits at once: a burst of Ctrl-C cannot interrupt the cleanup
  into "Exception ignored in ..." lines. A lock still held then is released by the kernel
  (flock), and a rerun resumes as after kill -9.
* an Interrupted raised where Python cannot propagate it (inside a `__del__` or a weakref
  callback) is not printed; the command notices at its end and exits as interrupted.
* the program (convert/entry.py) ends in its last exit hook (`end_before_teardown`), not in
  the interpreter's teardown: that teardown first puts the default handlers back, so a
  signal landing there (tens of milliseconds after the result line) would kill the process
  by the signal itself, without the line or the code of its own.

Standard library only: the entry point (convert/entry.py) installs this before it
imports anything else, so a Ctrl-C during the seconds of imports is handled too.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, NoReturn

# 128 + the signal's number, as a shell reports a process the signal ended
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
LINE = "interrupted"


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived while the command ran."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _State:
    received: int | None = None  # the first signal
    running = False  # the command's body runs: a first signal unwinds it
    reported = False  # the `interrupted` line is printed
    status = 1  # the program's exit status, as `exiting` was told (1: an exception nothing caught)


def install() -> None:
    """Handle SIGINT and SIGTERM as this module says, for this process (main thread only:
    Python delivers signals there)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _State.received, _State.running, _State.reported = None, False, False
    for signum in EXIT_CODES:
        signal.signal(signum, _handler)
    sys.unraisablehook = _unraisable


def _handler(signum: int, frame: FrameType | None) -> None:
    first = _State.received is None
    if first:
        _State.received = signum
    if first and _State.running:
        raise Interrupted(signum)
    exit_now()


_default_unraisable = sys.unraisablehook


def _unraisable(args: Any) -> None:
    if not issubclass(args.exc_type, (Interrupted, KeyboardInterrupt)):
        _default_unraisable(args)


@contextmanager
def running() -> Iterator[None]:
    """The command's body: a first signal inside it raises Interrupted."""
    _State.running = True
    try:
        yield
    finally:
        _State.running = False


def received() -> int | None:
    """The first signal that arrived, or None."""
    return _State.received


def raise_if_interrupted() -> None:
    """For a broad `except`: an error that a signal caused (a library wrapping the
    interruption into its own exception) is the interruption, not a finding. Only while a
    command runs: a library caller in a process whose command ended is not affected."""
    if _State.running and _State.received is not None:
        raise Interrupted(_State.received)


def exit_code(exc: BaseException | None = None) -> int:
    """130 or 143: the first signal's code (a bare KeyboardInterrupt is Ctrl-C's)."""
    signum = _State.received or (exc.signum if isinstance(exc, Interrupted) else signal.SIGINT)
    return EXIT_CODES.get(signal.Signals(signum), EXIT_CODES[signal.SIGINT])


def report() -> None:
    """Print the one `interrupted` line, once, after what the command already printed."""
    if not _State.reported:
        _State.reported = True
        _flush()
        try:
            sys.stderr.write(f"{LINE}\n")
            sys.stderr.flush()
        except (
            OSError,
            ValueError,
            RuntimeError,
            AttributeError,
        ):  # RuntimeError: the signal landed inside a write to stderr
            try:
                os.write(2, f"{LINE}\n".encode())
            except OSError:
                pass


def end_before_teardown() -> None:
    """End this process in an exit hook that runs after every other one (it is registered
    before them) instead of the interpreter's teardown: with SIGINT and SIGTERM blocked, a
    signal that arrived ends it as interrupted, else it exits with the status `exiting`
    recorded. For the program's entry point only: a process that embeds the tool keeps its
    own end."""
    atexit.register(_end)


def exiting(code: object) -> None:
    """Record the program's exit status: SystemExit's `code` (None: 0; not an int: 1, the
    message Python printed)."""
    _State.status = 0 if code is None else code if isinstance(code, int) else 1


def _end() -> NoReturn:
    signal.pthread_sigmask(signal.SIG_BLOCK, set(EXIT_CODES))  # a signal from here on waits for the look below
    pending = sorted(set(EXIT_CODES) & signal.sigpending())
    if _State.received is None and pending:
        _State.received = pending[0]
    if _State.received is not None:
        exit_now()
    _flush()
    os._exit(_State.status)


def exit_interrupted(exc: BaseException | None = None) -> NoReturn:
    """The end of an interrupted command: the line, then exit 130 or 143. The interpreter
    still joins threads on the way out; a signal then exits at once (`exit_now`)."""
    report()
    sys.exit(exit_code(exc))


def exit_now() -> NoReturn:
    """Exit without unwinding further: the line if not yet printed, stdout flushed."""
    report()
    _flush()
    os._exit(exit_code())


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError, AttributeError):
            pass  # closed or redirected to nothing: nothing to keep
