"""Two converter processes on one OUT, over many rounds: each round ends with exactly one
complete OUT that passes `check` (checksums included) and holds only the converter's own
files; the other process waited (exit 0) or was refused with exit 47 naming the winner."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from dsv4.convert.check import run_checks
from dsv4.convert.exit_codes import code_of
from dsv4.convert.synth import write_checkpoint
from dsv4.model.checkpoint import INDEX_NAME

# A test-only launcher: one Python that has imported the converter (and run it once, so
# every lazy import is done) forks both converter processes of a round; each runs
# `convert-dsv4 ARGS` as the command line would, with its own pid and its own lock, and
# twenty rounds do not pay forty interpreter start-ups. One torch thread keeps the fork
# safe. Each shard write sleeps a little, so a conversion lasts long enough to overlap.
LAUNCHER = """
import json, os, sys, time
import torch
torch.set_num_threads(1)
from dsv4.convert.cli import main
from dsv4.convert.pipeline import convert
from dsv4.convert.writer import ShardWriter
from dsv4.convert.exit_codes import code_of

spec = json.loads(sys.argv[1])
convert(*spec["warm_up"])
real_write = ShardWriter.write
def slow_write(self, name, data, at=0):
    time.sleep(spec["write_delay"])
    return real_write(self, name, data, at)
ShardWriter.write = slow_write

def converter(args, log):
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = ["convert-dsv4", *args]
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

rounds = []
for r in spec["rounds"]:
    pids = []
    for k, (delay, args) in enumerate(r["runs"]):
        time.sleep(delay)
        pid = os.fork()
        if pid == 0:
            converter(args, r["logs"][k])
        pids.append(pid)
    rounds.append({"pids": pids, "codes": [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]})
print(json.dumps(rounds))
"""

ROUNDS = 24
STAGGER = [0.0, 0.05, 0.1, 0.2, 0.3, 0.5]  # seconds between the two starts
OWN_FILES = {INDEX_NAME, "config.json", "conversion.json"}


def kinds(a: Path, b: Path) -> list[tuple[str, list[list[str]]]]:
    """What the two processes run, by kind of round."""
    return [
        ("same source, no --wait", [[str(a), "{out}", "-q"], [str(a), "{out}", "-q"]]),
        ("same source, the second waits", [[str(a), "{out}", "-q"], [str(a), "{out}", "-q", "--wait"]]),
        (
            "two sources, both wait and overwrite",
            [[str(a), "{out}", "-q", "--wait", "--overwrite"], [str(b), "{out}", "-q", "--wait", "--overwrite"]],
        ),
    ]


def test_two_converters_on_one_out_leave_exactly_one_complete_output(tiny_native: Path, tmp_path: Path) -> None:
    other = write_checkpoint(tmp_path / "other", preset="tiny", main_layers="all", seed=5)
    plan = []
    for k in range(ROUNDS):
        kind, runs = kinds(tiny_native, other)[k % 3]
        out = tmp_path / f"round-{k:02d}" / "out"
        out.parent.mkdir()
        delay = STAGGER[(k // 3) % len(STAGGER)]  # every kind of round meets every stagger
        plan.append(
            {
                "kind": kind,
                "out": out,
                "delay": delay,
                "logs": [str(out.parent / "first.log"), str(out.parent / "second.log")],
                "runs": [[0.0, [a.format(out=out) for a in runs[0]]], [delay, [a.format(out=out) for a in runs[1]]]],
            }
        )
    spec = {
        "warm_up": [str(tiny_native), str(tmp_path / "warm-up")],
        "write_delay": 0.004,
        "rounds": [{"runs": p["runs"], "logs": p["logs"]} for p in plan],
    }
    launched = subprocess.run(
        [sys.executable, "-c", LAUNCHER, json.dumps(spec)], capture_output=True, text=True, timeout=300
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    results = json.loads(launched.stdout)
    host = socket.gethostname()
    refused = waited = 0
    for p, result in zip(plan, results):
        out, codes, pids = p["out"], result["codes"], result["pids"]
        logs = [Path(log).read_text() for log in p["logs"]]
        where = f"round {p['out'].parent.name} ({p['kind']}, second started {p['delay']} s later): exit codes {codes}, output {logs}"
        # exactly one complete OUT, only the converter's own files, checksums and all
        assert out.is_dir(), where
        shards = set(json.loads((out / INDEX_NAME).read_text())["weight_map"].values())
        assert {e.name for e in out.iterdir()} == OWN_FILES | shards, where
        report = run_checks(out)
        assert report.ok, (where, report.summary())
        assert report.result("checksums").status == "pass", where
        assert sorted(e.name for e in out.parent.iterdir() if e.name.startswith(".out.")) == [".out.lock"], where
        converted = [k for k, log in enumerate(logs) if log.startswith("converted")]
        assert converted, where
        for k in (0, 1):
            code, log, other_pid = codes[k], logs[k], pids[1 - k]
            if code == code_of("output_locked"):
                refused += 1
                assert "--wait" not in p["runs"][k][1], where
                # one line, naming the process that really held OUT
                assert log.count("\n") == 1 and f"locked by another run (pid {other_pid} on host {host}" in log, where
                assert converted == [1 - k], where
            else:
                assert code == 0, where
                assert log.startswith(("converted", f"{out}: already up to date")), where
                waited += "already up to date" in log or (k == 1 and "--wait" in p["runs"][k][1])
        if p["kind"].startswith("two sources"):
            # the later of the two replaced the earlier: OUT is one of them, whole
            record = json.loads((out / "conversion.json").read_text())
            # a local source is recorded by its directory's name, not its path (issue 19 item 8)
            assert record["source"]["location"] in {tiny_native.name, other.name}, where
    assert refused and waited  # both outcomes really happened in these rounds
