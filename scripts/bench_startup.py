"""Benchmark: where a `convert-dsv4` run's seconds go before and after its copy, for two trees
in alternating rounds (the tree as checked out, and another, e.g. an older commit's
`git archive` unpacked as DIR/dsv4), each round a fresh process.

    .venv/bin/python scripts/bench_startup.py --other DIR --rounds 5 -- SRC OUT --target draft \\
        --serve-with T --draft-format overlay

Per run, from the launching of the process: `start-up` (until the first output byte is about to
be written: interpreter, imports, planning, the serve plan), `wall` (to exit), and where the run
waited for a serve verdict (convert/verdict.py) how long that join took; the 1-minute load average
before each round, and the run's peak RSS (VmHWM). OUT is removed before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Runs the entry point with two clocks hooked in: the first progress bar (made just before the
# first tensor is written, convert/pipeline.py) and the verdict's join, where the tree has one.
RUN = """
import json, sys, time
import dsv4.convert.pipeline as pipeline
from dsv4.convert.cli.main import main
marks = {}
bar = pipeline.progress_bar
def first_bar(*a, **k):
    marks.setdefault("writing", time.time())
    return bar(*a, **k)
pipeline.progress_bar = first_bar
try:
    from dsv4.convert import verdict
    final = verdict.Verdict.final
    def timed(self, plan):
        t = time.time()
        try:
            return final(self, plan)
        finally:
            marks["verdict_s"] = time.time() - t
    verdict.Verdict.final = timed
except ImportError:
    pass
sys.argv = ["convert-dsv4", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
print("\\nMARKS", json.dumps({**marks, "peak_kib": peak}))
"""


def one(tree: str | None, args: list[str], out: Path) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": tree} if tree else dict(os.environ)
    start = time.time()
    done = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, env=env, check=True)
    wall = time.time() - start
    marks = json.loads(done.stdout.rsplit("MARKS", 1)[1])
    row = {"wall_s": round(wall, 3), "startup_s": round(marks["writing"] - start, 3)}
    if "verdict_s" in marks:
        row["verdict_join_s"] = round(marks["verdict_s"], 3)
    return {**row, "peak_MiB": round(marks["peak_kib"] / 1024)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True, help="the directory holding the other tree as dsv4/")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("convert", nargs=argparse.REMAINDER, help="-- SRC OUT [convert options]")
    ns = parser.parse_args()
    args = [a for a in ns.convert if a != "--"]
    out = Path(args[1])
    rows = []
    for k in range(ns.rounds):
        order = [("this", None), ("other", ns.other)]
        order = order if k % 2 == 0 else order[::-1]
        for name, tree in order:
            load = os.getloadavg()[0]
            rows.append({"round": k + 1, "tree": name, "load_1m": round(load, 2), **one(tree, args, out)})
            print(json.dumps(rows[-1]), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    for name in ("this", "other"):
        mine = [r for r in rows if r["tree"] == name]
        print(
            json.dumps(
                {
                    "tree": name,
                    "startup_median_s": statistics.median(r["startup_s"] for r in mine),
                    "wall_median_s": statistics.median(r["wall_s"] for r in mine),
                }
            )
        )


if __name__ == "__main__":
    main()
