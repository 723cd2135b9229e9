"""`convert-dsv4` run in the test's own process, through the real entry point main()."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from dsv4.convert.cli import main

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
