"""Benchmark: convert a real-size Flash MTP slice and compare with `cp` of the same bytes.

    .venv/bin/python scripts/bench_convert.py [--work DIR] [--repeat N]

Writes (once, kept for reruns) the real-size DeepSeek V4 Flash MTP slice with real data
(not sparse): embed.weight, head.weight and the MTP block, ~5.7 GB. Then, on the same
disk, alternately: `cp` of exactly the files the plan reads, and the converter in a child
process (its peak RSS from getrusage). The converter makes its output durable (fsync)
before it is declared complete, so `cp` is timed both alone and followed by `sync`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dsv4.convert.inventory import read_inventory
from dsv4.convert.plan import plan_conversion
from dsv4.convert.synth import write_checkpoint
from dsv4.mapping.table import load_table


def drop_caches() -> bool:
    """Cold-cache runs where the machine allows it (root outside a container)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(cmd: list[str]) -> tuple[float, int]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - t
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return seconds, peak_kib if peak_kib > before else before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="out/bench", type=Path)
    ap.add_argument("--repeat", default=2, type=int)
    args = ap.parse_args()
    src = args.work / "flash-mtp-slice"
    if not (src / "config.json").exists():
        t = time.perf_counter()
        write_checkpoint(src, preset="flash", main_layers=0, sparse=False, seed=0)
        print(f"wrote the Flash MTP slice in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    plan = plan_conversion(read_inventory(src), load_table())
    files = [src / f for f in plan.files_needed]
    nbytes = plan.bytes_to_read
    cold = drop_caches()
    rows = []
    for _ in range(args.repeat):
        for kind in ("cp", "cp+sync", "convert"):
            dst = args.work / "dst"
            shutil.rmtree(dst, ignore_errors=True)
            dst.mkdir(parents=True)
            drop_caches()
            if kind == "convert":
                shutil.rmtree(dst)
                seconds, peak = timed([sys.executable, "-m", "dsv4", str(src), str(dst), "-q"])
            else:
                cmd = ["cp", *map(str, files), str(dst)]
                if kind == "cp+sync":
                    cmd = ["sh", "-c", " ".join(cmd) + " && sync"]
                seconds, peak = timed(cmd)
            rows.append({"kind": kind, "seconds": round(seconds, 2), "GB/s": round(nbytes / seconds / 1e9, 3), "peak_rss_MiB": round(peak / 1024) if kind == "convert" else None})
            print(json.dumps(rows[-1]), file=sys.stderr)
    best = {k: min(r["seconds"] for r in rows if r["kind"] == k) for k in ("cp", "cp+sync", "convert")}
    report = {
        "bytes": nbytes,
        "cold_cache": cold,
        "runs": rows,
        "best_seconds": best,
        "throughput_ratio_vs_cp": round(best["cp"] / best["convert"], 3),
        "throughput_ratio_vs_cp_sync": round(best["cp+sync"] / best["convert"], 3),
        "converter_peak_rss_MiB": max(r["peak_rss_MiB"] for r in rows if r["kind"] == "convert"),
    }
    print(json.dumps(report, indent=2))
    shutil.rmtree(args.work / "dst", ignore_errors=True)


if __name__ == "__main__":
    main()
