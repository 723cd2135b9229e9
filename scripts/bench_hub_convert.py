"""Benchmark: `convert-dsv4 org/flash OUT --target draft` from a distant hub, against what a user
would do instead: `hf_hub_download` of the shards the conversion reads, then a local conversion.

    .venv/bin/python scripts/bench_hub_convert.py [--work DIR] [--rounds 5] [--latency-s 0.05]
        [--stream-mb-s 100] [--workers 8] [--before CODE]

Every side is served by one benchmark hub (scripts/hub_bench_server.py) on 127.0.0.1: the
sparse Flash replica (`synth --sparse --main-layers all`, written into DIR/flash-sparse if
missing: 46 shards, tensor data file holes served as zeros) with `--latency-s` before every
answer and every answer paced to `--stream-mb-s`. The sides: "tool" (the conversion from the
hub), "download" (`hf_hub_download` of config, index and the shards the plan reads,
`--workers` at a time, then `convert-dsv4` of a folder holding them beside the replica's other
shards) and, with `--before CODE` (a folder holding another checkout's `dsv4` package, run
through PYTHONPATH), "before": the tool as that code has it. The order of the sides rotates
from round to round so all see the same machine; each side prints the load average before
it. Per side: wall seconds, CPU seconds of the command (user + system) and its peak RSS,
what the hub answered (requests, the most in flight) and the hub's own CPU seconds (this
process), and for a conversion from the hub its data phase as the hub saw it (data_phase).
Per round: the ratios to the tool, and whether every output is the same bytes as the tool's
(every file; conversion.json but for the source it names). Each round's files are deleted.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hub_bench_server import BenchHub

from dsv4.convert.synth import write_checkpoint

REPO = "org/flash"
CLI = "from dsv4.convert.entry import main; main()"  # the console script's entry, in this tree and in --before's
DOWNLOAD = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
from huggingface_hub import hf_hub_download
repo, workers, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
with ThreadPoolExecutor(max_workers=workers) as pool:
    print(json.dumps(dict(zip(files, pool.map(lambda f: hf_hub_download(repo, f), files)))))
"""
RECORD_SOURCE_KEYS = ("source", "fingerprint")  # the parts of conversion.json that name the source


def env_for(hub: BenchHub, hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1")
    env.update(HF_HUB_DISABLE_PROGRESS_BARS="1")  # neither side draws bars: not what is measured
    return env


def timed(args: list[str], env: dict[str, str]) -> dict[str, object]:
    """A command that must succeed: its wall and CPU seconds (user + system), peak RSS and stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.NamedTemporaryFile("r") as rss:
        t0 = time.monotonic()
        r = subprocess.run(
            ["/usr/bin/time", "-f", "%M", "-o", rss.name, *args], env=env, capture_output=True, text=True, timeout=1800
        )
        wall = time.monotonic() - t0
        peak_kb = int(rss.read().split()[-1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise SystemExit(f"{' '.join(args[:4])}... failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_kb": peak_kb, "stdout": r.stdout}


def data_phase(hub: BenchHub, ranges: list[tuple[float, float, int, int]]) -> dict[str, float]:
    """The tensor reads as the hub saw them (ranged reads not at a file's start: those are
    the speculative header reads): how long from the first taken to the last sent, how many
    were in flight on average, their mean size, and `stretch`: their mean time from taken
    to sent over what the latency and the cap alone make it (1: the hub's pace bounds each
    read; more: the client drained its socket slower than the cap)."""
    data = [r for r in ranges if r[2] != 0]
    if not data:
        return {}
    span = max(r[1] for r in data) - min(r[0] for r in data)
    busy = sum(r[1] - r[0] for r in data)
    paced = sum(hub.latency_s + r[3] / hub.rate for r in data)
    return {
        "data_phase_s": round(span, 2),
        "data_reads": len(data),
        "mean_in_flight": round(busy / span, 2),
        "mean_read_mb": round(sum(r[3] for r in data) / len(data) / 1e6, 2),
        "stretch": round(busy / paced, 2),
    }


def with_hub(hub: BenchHub, run: Callable[[], dict[str, object]]) -> dict[str, object]:
    """`run()`'s result with what the hub answered meanwhile and the CPU it spent."""
    hub.reset_counters()
    cpu0 = time.process_time()
    result = run()
    counted = hub.reset_counters()
    return {
        **data_phase(hub, counted.ranges),
        **result,
        "requests": counted.requests,
        "ranged": counted.ranged,
        "max_in_flight": counted.max_in_flight,
        "hub_body_bytes": counted.body_bytes,
        "hub_cpu_s": round(time.process_time() - cpu0, 2),
    }


def tool_round(hub: BenchHub, tmp: Path, out: Path, code: Path | None = None) -> dict[str, object]:
    """`convert-dsv4 org/flash OUT --target draft`; `code`: a folder holding another dsv4 to run instead."""
    env = env_for(hub, tmp / f"hf-{out.name}")
    if code is not None:
        env["PYTHONPATH"] = str(code)

    def run() -> dict[str, object]:
        got = timed([sys.executable, "-c", CLI, REPO, str(out), "--target", "draft", "--json"], env)
        del got["stdout"]
        return got

    return with_hub(hub, run)


def download_round(
    hub: BenchHub, src: Path, shards: list[str], tmp: Path, out: Path, workers: int
) -> dict[str, object]:
    """hf_hub_download of config, index and `shards` (`workers` at a time), then a local
    conversion of a folder holding them and the replica's other shards (whose headers a
    local plan reads: a user would have them or would have had to download them), each
    hard-linked (the local reader refuses a link that leads out of the folder)."""
    env = env_for(hub, tmp / "hf-download")
    files = ["config.json", "model.safetensors.index.json", *shards]

    def run() -> dict[str, object]:
        got = timed([sys.executable, "-c", DOWNLOAD, REPO, str(workers), *files], env)
        return {"download_s": got["wall_s"], "download_cpu_s": got["cpu_s"], "paths": json.loads(str(got["stdout"]))}

    got = with_hub(hub, run)
    folder = tmp / "downloaded"
    folder.mkdir()
    paths = dict(got.pop("paths"))  # type: ignore[call-overload]
    for p in src.iterdir():
        os.link(os.path.realpath(paths.get(p.name, p)), folder / p.name)
    local = timed([sys.executable, "-c", CLI, str(folder), str(out), "--target", "draft", "--json"], env)
    got.update(local_convert_s=local["wall_s"], local_cpu_s=local["cpu_s"], local_peak_rss_kb=local["peak_rss_kb"])
    got["wall_s"] = round(float(got["download_s"]) + float(local["wall_s"]), 2)  # type: ignore[arg-type]
    return got


def same_output(a: Path, b: Path) -> bool:
    """Every file the same bytes; conversion.json the same but for the source it names."""
    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()):
        return False
    for name in names:
        if name == "conversion.json":
            ra, rb = (json.loads((d / name).read_text()) for d in (a, b))
            for r in (ra, rb):
                for key in RECORD_SOURCE_KEYS:
                    r.pop(key, None)
            if ra != rb:
                return False
        elif not filecmp.cmp(a / name, b / name, shallow=False):
            return False
    return True


def one_round(k: int, hub: BenchHub, args: argparse.Namespace, shards: list[str], planned: int) -> dict[str, object]:
    """Round k (0-based): each side once, in an order that rotates with k; outputs compared."""
    sides = ["tool", "download", *(["before"] if args.before else [])]
    order = sides[k % len(sides) :] + sides[: k % len(sides)]
    got: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(dir=args.work, prefix="round-") as t:
        tmp = Path(t)
        for side in order:
            load = [round(x, 2) for x in os.getloadavg()]
            if side == "download":
                got[side] = download_round(hub, args.src, shards, tmp, tmp / "out-download", args.workers)
            else:
                got[side] = tool_round(hub, tmp, tmp / f"out-{side}", args.before if side == "before" else None)
            got[side]["load_before"] = load
        row: dict[str, object] = {"round": k + 1, "order": order, **got}
        tool_s = float(got["tool"]["wall_s"])  # type: ignore[arg-type]
        row["tool_mb_s"] = round(planned / 1e6 / tool_s, 1)
        row["download_then_convert_over_tool"] = round(float(got["download"]["wall_s"]) / tool_s, 3)  # type: ignore[arg-type]
        if args.before:
            row["before_over_tool"] = round(float(got["before"]["wall_s"]) / tool_s, 3)  # type: ignore[arg-type]
        row["identical"] = all(same_output(tmp / "out-tool", tmp / f"out-{side}") for side in sides[1:])
        row["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="out/bench", type=Path)
    ap.add_argument("--rounds", default=5, type=int)
    ap.add_argument("--latency-s", default=0.05, type=float)
    ap.add_argument("--stream-mb-s", default=100.0, type=float)
    ap.add_argument("--workers", default=8, type=int, help="hf_hub_download calls at a time")
    ap.add_argument(
        "--before", type=Path, help="a folder holding the dsv4 package of the code before a change: a third side"
    )
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.src = args.work / "flash-sparse"
    if not (args.src / "config.json").exists():
        write_checkpoint(args.src, preset="flash", main_layers="all", sparse=True)
    plan = json.loads(
        timed([sys.executable, "-c", CLI, "plan", str(args.src), "--target", "draft", "--json"], {**os.environ})[
            "stdout"
        ]
    )  # type: ignore[arg-type]
    shards, planned = plan["files_to_read"], plan["bytes_to_read"]
    rows = []
    with BenchHub(args.src, REPO, latency_s=args.latency_s, stream_mb_s=args.stream_mb_s, max_seconds=7200) as hub:
        for k in range(args.rounds):
            rows.append(one_round(k, hub, args, shards, planned))
            print(json.dumps(rows[-1]), flush=True)
            if not rows[-1]["identical"]:
                raise SystemExit(f"round {k + 1}: the outputs differ")
    summary: dict[str, object] = {
        "bytes_planned": planned,
        "shards": shards,
        "latency_s": args.latency_s,
        "stream_mb_s": args.stream_mb_s,
    }
    for side in ("tool", "download", "before") if args.before else ("tool", "download"):
        summary[f"{side}_wall_s_median"] = statistics.median(float(r[side]["wall_s"]) for r in rows)  # type: ignore[index]
    for key in ("download_then_convert_over_tool", "before_over_tool"):
        ratios = [float(r[key]) for r in rows if key in r]  # type: ignore[arg-type]
        if ratios:
            summary[key] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
