"""`convert-dsv4` run through the real entry point main(): in the test's own process, or in a child process."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from dsv4.convert.cli.main import main

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_main(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str | Path
) -> tuple[int, str, str]:
    """`convert-dsv4 ARGS`: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["convert-dsv4", *map(str, args)])
    # main() takes SIGINT, SIGTERM and the unraisable hook over for its process, here
    # pytest's: they are given back afterwards
    handlers, hook = {s: signal.getsignal(s) for s in SIGNALS}, sys.unraisablehook
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        sys.unraisablehook = hook
    out, err = capsys.readouterr()
    return code, out, err


def run_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`convert-dsv4 ARGS` in this process: (exit code, the one line on stderr)."""
    code, _, err = run_main(monkeypatch, capsys, *args)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) <= 1, err
    return code, lines[0] if lines else ""


def run_in_subprocess_one_line(*args: str) -> tuple[int, str]:
    """The CLI in its own process, so that a read blocked on a FIFO fails this test instead of hanging the suite:
    (exit code, the one line on stderr)."""
    done = subprocess.run([sys.executable, "-m", "dsv4", *args], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return done.returncode, lines[0]


def one_error_line(err: str) -> str:
    """The one line a refusal writes on stderr (no traceback, no second line)."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def raising(exc: BaseException) -> Callable[..., object]:
    """A stand-in for a function that raises `exc` whatever it is called with."""

    def convert(*args: object, **kwargs: object) -> object:
        raise exc

    return convert


@contextmanager
def held_by_a_thread(hold: Callable[[], AbstractContextManager[object]]) -> Iterator[None]:
    """What `hold()` takes (a lock, OUT) held, for the with-block, by another thread of this
    process: another run as it looks from here, whose pid is ours."""
    taken, done = threading.Event(), threading.Event()

    def holder() -> None:
        with hold():
            taken.set()
            done.wait()

    thread = threading.Thread(target=holder)
    thread.start()
    assert taken.wait(30)
    try:
        yield
    finally:
        done.set()
        thread.join()
