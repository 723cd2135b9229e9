"""Ctrl-C and SIGTERM at any moment (convert/interrupts.py): every run ends with exit 130
(SIGINT) or 143 (SIGTERM) and the one line `interrupted`, or completes; never a traceback
or an "Exception ignored" line; a rerun after an interrupted conversion resumes and gives
byte-identical files; an interrupted `check` never reports a defect of a good checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from inprocess import run_main

from dsv4.convert.check import files as check_files
from dsv4.convert.pipeline import convert

# A test-only launcher (as in tests/convert/test_output.py's concurrency test): one Python that has imported
# the tool and run a conversion and a check once forks each round's command, which runs
# through the real entry point (dsv4.convert.entry.main) with its output in log files, and
# signals it after a seeded random delay within the command's measured duration. The
# launcher installs the tool's handlers first, as the entry point does before anything
# else, so a child signalled at once meets them. Each shard write sleeps a little, so a
# conversion spans many moments. After each conversion round the launcher converts again
# (in its own process) into the same OUT: the rerun the test compares byte for byte.
LAUNCHER = """
import json, os, random, signal, sys, time, traceback
import torch
torch.set_num_threads(1)
from dsv4.convert import interrupts
from dsv4.convert.check.run import run_checks
from dsv4.convert.entry import main
from dsv4.convert.pipeline import convert
from dsv4.convert.writer import ShardWriter

spec = json.loads(sys.argv[1])
real_write = ShardWriter.write
def slow_write(self, name, data, at=0):
    time.sleep(spec["write_delay"])
    return real_write(self, name, data, at)
ShardWriter.write = slow_write

def timed(f):
    t = time.monotonic()
    f()
    return time.monotonic() - t
native, shard = spec["native"], spec["max_shard_size"]
took = {
    "convert": timed(lambda: convert(native, spec["warm_up"], max_shard_size=shard)),
    "check": timed(lambda: run_checks(spec["warm_up"])),
}
interrupts.install()

SIGNALS = {signal.SIGINT, signal.SIGTERM}
def child(args, out, err, late):
    for fd, log in ((1, out), (2, err)):
        os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # a signal sent already lands now, its line in the log
    sys.argv = ["convert-dsv4", *args]
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        if late:  # a signal after the result line, while the program would exit
            os.kill(os.getpid(), late)
            time.sleep(5)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

rng = random.Random(spec["seed"])
results = []
for r in spec["rounds"]:
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # until the child's output goes to its logs
    pid = os.fork()
    if pid == 0:
        child(r["args"], r["out"], r["err"], r.get("late"))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    sent = []
    if not r.get("late"):
        time.sleep(rng.uniform(0, 1.2 * took[r["kind"]]))
        for k in range(r["burst"]):
            try:
                os.kill(pid, r["signal"])
                sent.append(r["signal"])
            except ProcessLookupError:
                break
            time.sleep(rng.uniform(0, 0.005))
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if r["kind"] == "convert":
        convert(native, r["target"], max_shard_size=shard)
    results.append({"code": code, "sent": sent})
print(json.dumps({"took": took, "rounds": results}))
"""

ROUNDS = 20  # of each command
MAX_SHARD = 100_000  # the tiny draft's 1.6 MB in 17 shards: a conversion of many steps
INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}


def files(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


@pytest.mark.slow
def test_sigint_and_sigterm_at_random_moments_end_in_one_line_or_a_completed_run(
    tiny_native: Path, tmp_path: Path
) -> None:
    reference = tmp_path / "reference"
    convert(tiny_native, reference, max_shard_size=MAX_SHARD)
    assert len(list(reference.glob("*.safetensors"))) > 10
    rounds = []
    for k in range(2 * ROUNDS + 4):
        kind = "convert" if k % 2 == 0 else "check"
        signum = (signal.SIGINT, signal.SIGTERM)[(k // 2) % 2]
        root = tmp_path / f"round-{k:02d}"
        root.mkdir()
        target = root / "out"
        args = (
            [str(tiny_native), str(target), "-q", "--max-shard-size", str(MAX_SHARD)]
            if kind == "convert"
            else ["check", str(reference), "-q"]
        )
        late = signum if k >= 2 * ROUNDS else None  # the last four rounds: the signal lands after the result line
        burst = 3 if k % 5 == 4 else 1  # every fifth round a burst of signals
        rounds.append(
            {
                "kind": kind,
                "signal": signum,
                "burst": burst,
                "late": late,
                "args": args,
                "target": str(target),
                "out": str(root / "stdout"),
                "err": str(root / "stderr"),
            }
        )
    spec = {
        "seed": 18,
        "native": str(tiny_native),
        "warm_up": str(tmp_path / "warm-up"),
        "max_shard_size": MAX_SHARD,
        "write_delay": 0.003,
        "rounds": rounds,
    }
    launched = subprocess.run(
        [sys.executable, "-c", LAUNCHER, json.dumps(spec)], capture_output=True, text=True, timeout=300
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    results = json.loads(launched.stdout)["rounds"]
    interrupted = completed = 0
    for r, result in zip(rounds, results, strict=True):
        code, out, err = result["code"], Path(r["out"]).read_text(), Path(r["err"]).read_text()
        late = " after the result" if r["late"] else ""
        where = (
            f"{r['kind']} round {Path(r['target']).parent.name}, {signal.Signals(r['signal']).name} x{r['burst']}"
            f"{late}: exit {code}, stdout {out!r}, stderr {err!r}"
        )
        if r["late"] or result["sent"] and code != 0:
            assert (code, err) == (INTERRUPTED[r["signal"]], "interrupted\n"), where
            interrupted += 1
        else:
            assert (code, err) == (0, ""), where
            completed += 1
        if code == 0 or r["late"]:  # the command finished: its result line is there
            assert (
                out.startswith(("converted", "resumed"))
                if r["kind"] == "convert"
                else re.fullmatch(rf"{re.escape(r['args'][1])}: OK: \d+ passed, 0 failed, \d+ skipped\n", out)
            ), where
        if r["kind"] == "convert":  # the launcher's rerun resumed or found OUT up to date
            assert files(Path(r["target"])) == files(reference), where
            assert sorted(p.name for p in Path(r["target"]).parent.iterdir() if p.name.startswith(".")) == [
                ".out.lock"
            ], where
    assert interrupted >= ROUNDS // 2 and completed  # both outcomes really happened


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_command_line_is_still_importing_is_one_line(signum: int) -> None:
    # the installed entry point, loaded as its console script loads it; the signal is sent
    # by an import hook at the moment click starts loading
    script = f"""
import os, sys
from importlib.metadata import entry_points
class SignalOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == "click":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), {int(signum)})
        return None
main = entry_points(group="console_scripts")["convert-dsv4"].load()
sys.meta_path.insert(0, SignalOnImport())
sys.argv = ["convert-dsv4", "--version"]
sys.exit(main())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (INTERRUPTED[signum], "", "interrupted\n")


# The program (the entry point, as `python -m dsv4` runs it) converting, with a SIGINT raised at
# one moment after its result line is printed: MOMENT picks it.
AFTER_THE_RESULT = """
import atexit, os, signal, sys, time
import click
MOMENT = sys.argv.pop(1)
echo = click.echo
def echo_then_signal(message=None, *args, **kwargs):
    echo(message, *args, **kwargs)
    if str(message).startswith("converted"):
        if MOMENT == "right after the result line":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        elif MOMENT == "in an exit hook":  # as a library's: registered after the entry point's own
            atexit.register(os.kill, os.getpid(), signal.SIGINT)
click.echo = echo_then_signal

class SignalInTeardown:
    def __del__(self):  # runs if the interpreter tears its modules down, the default handlers back
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
if MOMENT == "in the interpreter's teardown":
    click.signal_in_teardown = SignalInTeardown()

from dsv4.convert.entry import main
sys.argv = ["convert-dsv4", *sys.argv[1:]]
main()
"""


def after_the_result(moment: str, native: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", AFTER_THE_RESULT, moment, str(native), str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("moment", ["right after the result line", "in an exit hook"])
def test_a_signal_after_the_result_line_is_one_line_and_130(moment: str, tiny_native: Path, tmp_path: Path) -> None:
    done = after_the_result(moment, tiny_native, tmp_path / "out")
    assert (done.returncode, done.stderr) == (130, "interrupted\n"), done
    assert done.stdout.startswith("converted ") and (tmp_path / "out" / "conversion.json").is_file()


def test_the_program_ends_before_the_interpreter_s_teardown_where_a_signal_would_kill_it(
    tiny_native: Path, tmp_path: Path
) -> None:
    """Issue 28: the interpreter's teardown puts the default handlers back first; a Ctrl-C landing
    there (tens of milliseconds after the result line) killed the process by the signal itself
    (returncode -2, no `interrupted` line). The program now ends in its last exit hook: the
    teardown, and the signal this test plants in it, never come."""
    done = after_the_result("in the interpreter's teardown", tiny_native, tmp_path / "out")
    assert (done.returncode, done.stderr) == (0, ""), done
    assert done.stdout.startswith("converted ")


def test_an_interruption_a_library_wrapped_in_its_own_error_is_no_finding_of_check(
    tiny_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    read = check_files._read_tensor
    signalled = []

    def read_interrupted(*args: object) -> None:
        if signalled:
            return read(*args)
        signalled.append(True)
        try:
            os.kill(os.getpid(), signal.SIGINT)  # one Ctrl-C while safetensors reads
            time.sleep(1)
        except BaseException as exc:  # as a Rust extension may report it: an Exception of its own
            raise RuntimeError("read interrupted") from exc

    monkeypatch.setattr(check_files, "_read_tensor", read_interrupted)
    code, _, err = run_main(monkeypatch, capsys, "check", tiny_pair[1], "-q")
    assert (code, err) == (130, "interrupted\n")  # not 72, "tensor ... unreadable"
