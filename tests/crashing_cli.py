"""Test-only entry point: `python tests/crashing_cli.py BYTES ARGS...` runs `convert-dsv4 ARGS...`
and SIGKILLs itself once the output stream (tensors in write order, those an earlier run
finished included) reaches byte BYTES: the kill tests' seam, owned by the tests. It wraps the
pipeline's progress bar, which the executor advances after each chunk is written."""

from __future__ import annotations

import os
import signal
import sys

from dsv4.convert import pipeline
from dsv4.convert.cli.main import main


def crash_at(point: int) -> None:
    make_bar = pipeline.progress_bar

    def killing_bar(total: int, done: int, quiet: bool):  # noqa: ANN202  (tqdm's type)
        bar = make_bar(total, done, quiet)
        position = done
        update = bar.update

        def counting_update(n: int = 1) -> None:
            nonlocal position
            update(n)
            position += n
            if position >= point:
                os.kill(os.getpid(), signal.SIGKILL)

        bar.update = counting_update
        return bar

    pipeline.progress_bar = killing_bar


if __name__ == "__main__":
    crash_at(int(sys.argv[1]))
    sys.argv = ["convert-dsv4", *sys.argv[2:]]
    main()
