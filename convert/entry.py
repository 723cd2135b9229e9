"""The program's entry point, `convert-dsv4` and `python -m dsv4`: Ctrl-C and SIGTERM are
handled (convert/interrupts.py) before the seconds of imports the command line needs, so
a signal that lands while they load ends as one `interrupted` line, never a traceback; and
the process ends in its last exit hook, so a signal that lands after the result line ends
it as interrupted too (interrupts.end_before_teardown)."""

from __future__ import annotations

from dsv4.convert import interrupts


def main() -> None:
    interrupts.install()
    interrupts.end_before_teardown()  # first: its exit hook runs after every other one
    try:
        _run()
    except SystemExit as exc:
        interrupts.exiting(exc.code)
        raise
    interrupts.exiting(0)


def _run() -> None:
    try:
        with interrupts.running():
            from dsv4.convert.cli.main import main as run_command  # start-up time: click, the tables, the model's names
    except (interrupts.Interrupted, KeyboardInterrupt) as exc:
        interrupts.exit_interrupted(exc)
    run_command()
