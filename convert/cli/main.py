"""`convert-dsv4`: the command line. `convert-dsv4 IN OUT --target xpu` converts; the other
commands plan, check, smoke-test, synthesise and batch-convert. This module holds the group,
`targets` and main() (every outcome an exit code and at most one line); the commands live
by concern in cli_convert.py (convert, plan), cli_model.py (check, smoke, synth) and
cli_batch.py (batch), their shared options and output in cli_common.py.

Each command's body imports the library code it drives when it runs (start-up time: the
model needs torch and Triton, the hub client its network stack, and a conversion neither).
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
import warnings

import click

from dsv4 import __version__
from dsv4.convert import interrupts
from dsv4.convert.cli.batch import batch_command
from dsv4.convert.cli.common import echo_json, json_option, quiet_option
from dsv4.convert.cli.convert import convert_command, plan_command
from dsv4.convert.cli.model import check_command, smoke_command, synth_command
from dsv4.convert.exit_codes import INTERNAL_ERROR, exit_code
from dsv4.mapping.targets import runtimes_by_target, target_rows
from dsv4.model.errors import DSV4Error, OutOfMemoryError


class _Commands(click.Group):
    """`convert-dsv4 IN OUT ...` means `convert-dsv4 convert IN OUT ...`, unless IN is
    neither an existing path nor a hub id (no `/`) and looks like a mistyped command."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            first = args[0]
            close = difflib.get_close_matches(first, self.commands, n=1)
            if close and "/" not in first and not os.path.lexists(first):
                ctx.fail(f"No such command {first!r}. Did you mean {close[0]!r}?")
            args = ["convert", *args]
        return super().parse_args(ctx, args)


def _version_message() -> str:
    """`--version`: the tool's version and, per target, the runtime its layouts are those of."""
    return "%(prog)s %(version)s (" + "; ".join(f"target {t}: {r}" for t, r in runtimes_by_target().items()) + ")"


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="convert-dsv4", message=_version_message())
def cli() -> None:
    """Convert a native DeepSeek V4 checkpoint's draft layers: into a standalone draft
    directory vLLM and SGLang serve (--target draft), or vLLM's XPU draft layout (--target xpu).

    \b
      convert-dsv4 IN OUT --target draft   the draft directory runtimes serve (IN: directory, or hub repo [hf://]org/name[@rev])
      convert-dsv4 IN OUT --target xpu     vLLM's XPU in-memory layout (bundled model, check)
      convert-dsv4 plan IN --target xpu    show what a conversion would read and write
      convert-dsv4 check OUT               verify a converted checkpoint (for CI)
      convert-dsv4 smoke OUT               load it into the bundled model and run a forward
      convert-dsv4 synth OUT --preset tiny write a synthetic native checkpoint
      convert-dsv4 batch MANIFEST          convert many hub repositories
      convert-dsv4 targets                 the installed targets and their tables
    """


@click.command("targets")
@quiet_option
@json_option
def targets_command(quiet: bool, as_json: bool) -> None:
    """List the installed targets (--target) and their tables: the drafter each maps, its
    version, and the runtime and runtime class whose layout it writes."""
    rows = target_rows()
    if as_json:
        echo_json(rows)
        return
    width = max(len(r["table"]) for r in rows)
    for r in rows:
        family = f" (family {r['family']})" if r["family"] else ""
        click.echo(
            f"{r['target']:8} {r['table']:{width}} drafter {r['drafter']:7} v{r['table_version']:4} {r['runtime']} "
            f"({r['runtime_class']}){family}"
        )
        for family, releases in r.get("families", {}).items():  # the releases serving each family's draft
            click.echo(f"{'':8} {'':12} {family:15} {releases}")


for command in (convert_command, plan_command, check_command, smoke_command, synth_command, batch_command):
    cli.add_command(command)
cli.add_command(targets_command)


# Developers set DSV4_TRACEBACK=1 to see the traceback the last-resort handler hides.
TRACEBACK_ENV = "DSV4_TRACEBACK"


def _one_line(exc: BaseException, at_most: int = 300) -> str:
    """The first line of an exception we did not write, cut short: it may be any size."""
    lines = str(exc).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= at_most else line[: at_most - 3] + "..."


def _escape_newlines(text: str) -> str:
    """One line whatever a message quotes (a tensor name in a hostile header may hold a newline)."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _os_error(exc: OSError) -> str:
    """An OSError no part of the tool classified: the path(s) and the OS's reason."""
    paths = ": ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    reason = exc.strerror or _one_line(exc) or type(exc).__name__
    return f"error: {paths}: {reason}" if paths else f"error: {reason}"


class _NoticeFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return _escape_newlines(f"{record.levelname.lower()}: {record.getMessage()}")


def _log_to_stderr() -> None:
    """The library's notices (logging, logger "dsv4") as the command's own output: one
    line each on stderr, `warning: ...`, never a Python warning with a source path."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_NoticeFormatter())
    # every command that runs the model says in its result which path computed the fused
    # norms ("fused norms: torch fallback (...)"): the kernels' notice would repeat it
    handler.addFilter(lambda record: record.name != "dsv4.model.kernels")
    logger = logging.getLogger("dsv4")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main() -> None:
    """The entry point: every outcome is an exit code and at most one line on stderr.

    The tool's own errors carry their documented code; click's usage errors exit 2; Ctrl-C
    exits 130 and SIGTERM 143, with the one line `interrupted` whenever the signal lands
    (convert/interrupts.py). Anything else is a bug or an unclassified OS error: one line
    and exit 1, never a traceback (unless DSV4_TRACEBACK=1)."""
    # numpy is no dependency of this tool; torch warns at import when it is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    _log_to_stderr()
    interrupts.install()
    try:
        _run_command()
    except (click.exceptions.Abort, KeyboardInterrupt, interrupts.Interrupted) as exc:  # click turns Ctrl-C into Abort
        interrupts.exit_interrupted(exc)
    if interrupts.received() is not None:  # a signal the command swallowed (in a __del__): it still ends interrupted
        interrupts.exit_interrupted()


def _run_command() -> None:
    """The command, its errors turned into their line and code (SystemExit); an interruption,
    or an error a signal caused, is raised as Interrupted for main()."""
    with interrupts.running():  # errors are printed inside: a signal then still ends as `interrupted`
        try:
            cli(prog_name="convert-dsv4", standalone_mode=False)
        except DSV4Error as exc:
            interrupts.raise_if_interrupted()  # the error is what a signal left behind
            click.echo(f"error: {_escape_newlines(str(exc))}", err=True)
            sys.exit(exit_code(exc))
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.UsageError as exc:  # one line like every other error, not click's usage block
            if isinstance(
                exc, getattr(click.exceptions, "NoArgsIsHelpError", ())
            ):  # click >= 8.2: no arguments means help
                exc.show()
                sys.exit(exc.exit_code)
            hint = f" (see: {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
            click.echo(f"error: {_escape_newlines(exc.format_message())}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:  # click's form of a KeyboardInterrupt: main() ends it as interrupted
            raise
        except MemoryError:  # an allocation failed: the memory limit, not a bug
            click.echo("error: not enough memory: an allocation failed; raise the memory limit", err=True)
            sys.exit(exit_code(OutOfMemoryError("", kind="out_of_memory")))
        except BrokenPipeError:  # stdout closed early (`... --json | head`): nothing left to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
            sys.exit(1)
        except Exception as exc:
            interrupts.raise_if_interrupted()
            if os.environ.get(TRACEBACK_ENV) == "1":
                raise
            if isinstance(exc, OSError):
                click.echo(_os_error(exc), err=True)
            else:
                click.echo(
                    f"internal error: {type(exc).__name__}: {_one_line(exc)} (please report this bug with the command "
                    f"that caused it; {TRACEBACK_ENV}=1 shows the traceback)",
                    err=True,
                )
            sys.exit(INTERNAL_ERROR)
