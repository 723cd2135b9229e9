"""Benchmark: `convert-dsv4 plan` of the full-size Flash replica on a hub 50 ms away, against
the same plan from local disk.

    .venv/bin/python scripts/bench_hub_plan.py [--work DIR] [--latency-s 0.05] [--repeat 5]

Serves the sparse Flash replica (46 shards, 69,187 tensors; written by `synth --sparse` if
DIR/flash-sparse-all is missing) from the test suite's fake hub (tests/hubserver.py) on
127.0.0.1 with `--latency-s` added to every request, and times `convert-dsv4 plan org/flash
--json` and `convert-dsv4 plan DIR/flash-sparse-all --json` as commands, alternating in the
same run, a cold download cache each time. Per round it prints the load average, each
command's wall and CPU seconds (user + system), the ratio of the hub command's wall time to
the local one's (issue 29's goal: <= 1.3), the hub's request count and the sequential round
trips as the hub saw them (the longest chain of requests each taken after the one before it
was answered; the fake hub's 32 handler threads make a wave of more requests two); then
medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hubserver import FakeHub, Request, hub_env  # noqa: E402

from dsv4.convert.synth import write_checkpoint  # noqa: E402

REPO = "org/flash"
CLI = "from dsv4.convert.cli import main; main()"


def plan_command(source: str, env: dict[str, str]) -> tuple[float, float, dict[str, object]]:
    """(wall seconds, CPU seconds, the plan printed) of `convert-dsv4 plan SOURCE --json`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", CLI, "plan", source, "--json"], env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise SystemExit(f"plan {source} failed ({r.returncode}): {r.stderr.strip()}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, json.loads(r.stdout)


def round_trips(requests: list[Request]) -> int:
    """Sequential round trips as the hub saw them: the longest chain of requests each of
    which a handler took after the one before it was answered."""
    chain: list[tuple[float, int]] = []  # (answered_at, chain length) of the requests seen
    for q in sorted(requests, key=lambda q: q.arrived_at):
        chain.append((q.answered_at, 1 + max((n for answered, n in chain if answered <= q.arrived_at), default=0)))
    return max(n for _, n in chain)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="out/bench", type=Path)
    ap.add_argument("--latency-s", default=0.05, type=float)
    ap.add_argument("--repeat", default=5, type=int)
    args = ap.parse_args()
    src = args.work / "flash-sparse-all"
    if not (src / "config.json").exists():
        write_checkpoint(src, preset="flash", main_layers="all", sparse=True)
    rounds = []
    with FakeHub(latency_s=args.latency_s) as hub, tempfile.TemporaryDirectory() as tmp:
        hub.commit_sparse_dir(REPO, src)
        for k in range(args.repeat):  # alternating, so both see the same machine load
            load = os.getloadavg()[0]
            hub.reset_counters()
            hub_wall, hub_cpu, hub_plan = plan_command(REPO, hub_env(hub, Path(tmp) / f"hf-{k}"))
            requests = list(hub.requests)
            local_wall, local_cpu, local_plan = plan_command(str(src), hub_env(hub, Path(tmp) / f"hf-local-{k}"))
            assert hub_plan["tensors"] == local_plan["tensors"] and hub_plan["skipped"] == local_plan["skipped"]
            rounds.append(
                {
                    "round": k + 1,
                    "load_average": round(load, 2),
                    "hub_wall_s": round(hub_wall, 3),
                    "local_wall_s": round(local_wall, 3),
                    "hub_over_local": round(hub_wall / local_wall, 3),
                    "hub_cpu_s": round(hub_cpu, 3),
                    "local_cpu_s": round(local_cpu, 3),
                    "requests": len(requests),
                    "round_trips": round_trips(requests),
                }
            )
            print(json.dumps(rounds[-1]), flush=True)
    keys = [k for k in rounds[0] if k != "round"]
    print(
        json.dumps(
            {
                "latency_s": args.latency_s,
                "cpus": os.cpu_count(),
                "median": {k: statistics.median(r[k] for r in rounds) for k in keys},
                "max_hub_over_local": max(r["hub_over_local"] for r in rounds),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
