"""Benchmark: `convert-dsv4 plan` of the full-size Flash replica on a hub 50 ms away.

    .venv/bin/python scripts/bench_hub_plan.py [--work DIR] [--latency-s 0.05] [--repeat 5]

Serves the sparse Flash replica (46 shards, 69,187 tensors; written by `synth --sparse` if
DIR/flash-sparse-all is missing) from the test suite's fake hub (tests/hubserver.py) on
127.0.0.1 with `--latency-s` added to every request, and times `convert-dsv4 plan org/flash
--json` as a command, alternating in the same run: "parallel" (the code as it is), "one at
a time" (the same code with a pool of one header reader: the request pattern of the
earlier sequential loop) and "local" (`plan DIR --json` of the same replica on disk: what
the command costs without a hub). Per hub run it prints the command's wall time, the
header phase (first shard request to last answer, as the hub saw them), the number of
requests and the most ranged reads the hub held at once, and per round the ratio of the
hub command's wall time to the local one's (issue 20's goal: <= 1.5); then medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hubserver import FakeHub, hub_env  # noqa: E402

from dsv4.convert.synth import write_checkpoint  # noqa: E402

REPO = "org/flash"
CLI = "from dsv4.convert.cli import main; main()"
HUB_VARIANTS = {
    "parallel": CLI,
    "one at a time": f"from dsv4.convert.hub import HubReader; HubReader.header_reads = 1\n{CLI}",
}


def plan_command(program: str, source: str, env: dict[str, str]) -> tuple[float, dict[str, object]]:
    """Wall seconds of `convert-dsv4 plan SOURCE --json` and the plan it printed."""
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", program, "plan", source, "--json"], env=env, capture_output=True, text=True, timeout=600
    )
    wall = time.monotonic() - t0
    if r.returncode:
        raise SystemExit(f"plan {source} failed ({r.returncode}): {r.stderr.strip()}")
    return wall, json.loads(r.stdout)


def hub_run(hub: FakeHub, program: str, hf_home: Path) -> dict[str, object]:
    hub.reset_counters()
    hub.max_ranges_in_flight = 0
    wall, plan = plan_command(program, REPO, hub_env(hub, hf_home))
    shard_reads = [q for q in hub.requests if q.route == "resolve" and q.path and q.path.endswith(".safetensors")]
    # a shard request is answered latency_s after it started: the phase begins one latency before the first answer
    header_phase = max(q.answered_at for q in shard_reads) - min(q.answered_at for q in shard_reads) + hub.latency_s
    return {
        "wall_s": round(wall, 3),
        "header_phase_s": round(header_phase, 3),
        "requests": len(hub.requests),
        "shard_requests": len(shard_reads),
        "max_ranges_in_flight": hub.max_ranges_in_flight,
        "plan_tensors": len(plan["tensors"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="out/bench", type=Path)
    ap.add_argument("--latency-s", default=0.05, type=float)
    ap.add_argument("--repeat", default=5, type=int)
    args = ap.parse_args()
    src = args.work / "flash-sparse-all"
    if not (src / "config.json").exists():
        write_checkpoint(src, preset="flash", main_layers="all", sparse=True)
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in (*HUB_VARIANTS, "local")}
    ratios: list[float] = []
    with FakeHub(latency_s=args.latency_s) as hub, tempfile.TemporaryDirectory() as tmp:
        hub.commit_sparse_dir(REPO, src)
        for k in range(args.repeat):  # the variants alternate, so all see the same machine load
            for name, program in HUB_VARIANTS.items():
                runs[name].append(
                    hub_run(hub, program, Path(tmp) / f"hf-{k}-{name.replace(' ', '-')}")
                )  # a cold download cache each time
            wall, _ = plan_command(CLI, str(src), hub_env(hub, Path(tmp) / "hf-local"))
            runs["local"].append({"wall_s": round(wall, 3), "load_average": os.getloadavg()[0]})
            for name, rs in runs.items():
                print(json.dumps({"variant": name, "run": k + 1, **rs[-1]}), flush=True)
            ratios.append(float(runs["parallel"][-1]["wall_s"]) / wall)  # type: ignore[arg-type]
            print(json.dumps({"run": k + 1, "hub_over_local": round(ratios[-1], 3)}), flush=True)
    medians = {
        name: {key: statistics.median(float(r[key]) for r in rs) for key in rs[0] if key.endswith("_s")}
        for name, rs in runs.items()
    }
    print(
        json.dumps(
            {
                "latency_s": args.latency_s,
                "cpus": os.cpu_count(),
                "median": medians,
                "hub_over_local": {"median": round(statistics.median(ratios), 3), "max": round(max(ratios), 3)},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
