"""Benchmark: convert a real-size Flash MTP slice and compare with `cp` of the same bytes;
measure the converter's own memory on it and on the tiny checkpoint.

    .venv/bin/python scripts/bench_convert.py [--work DIR] [--repeat N] [--clean]
    .venv/bin/python scripts/bench_convert.py --profile   # where the converter's time goes
    .venv/bin/python scripts/bench_convert.py --variant dspark   # the V4-Flash-0731 DSpark drafter (~13 GB)

Writes (once, kept for reruns unless --clean) the real-size DeepSeek V4 Flash MTP slice
with real data (not sparse): embed.weight, head.weight and the MTP block, ~5.7 GB (with
`--variant dspark`: the three DSpark stages of V4-Flash-0731, ~13 GB), and the tiny checkpoint. Then, on the same disk, in each round and each from a cold page cache
(`echo 3 > /proc/sys/vm/drop_caches`; root outside a container; the report says whether
it worked): `cp` of exactly the files the plan reads, the same `cp` followed by `sync`
(the converter makes its output durable before declaring it complete), and the converter
as a whole command (`python -m dsv4 SRC DST --json`: interpreter start-up, imports,
table, planning, copy, sha256 of every tensor, fsync, publish). Its start-up is the wall
time minus the seconds the converter itself reports for the copy.

--profile instead runs one cold conversion of the slice in this process under cProfile
and prints where its main thread (the writer) spends the time: waiting for a read,
writing, starting writeback, the zero test, the per-shard fsync.

Memory: the converter's peak RSS minus that of a process that only imports what the
converter imported (the same module list, taken from the converting process itself), for
tiny and for the Flash slice.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dsv4.convert.inventory import read_inventory
from dsv4.convert.execute import hasher_lanes
from dsv4.convert.plan import choose_table, plan_conversion
from dsv4.convert.synth import write_checkpoint

# Peak RSS as VmHWM: ru_maxrss survives exec, so a child of this (torch-importing) script
# would report at least this script's size.
PEAK_KIB = "int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"
# Runs the converter's own entry point in this process, then reports its peak RSS and
# every module it imported (for the import-only baseline).
CONVERT_AND_REPORT = f"""
import json, sys
from dsv4.convert.cli import main
sys.argv = ["convert-dsv4", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
print("REPORT", json.dumps({{"peak_kib": {PEAK_KIB}, "modules": sorted(sys.modules)}}))
"""
# Imports those modules and nothing else.
IMPORT_ONLY = f"""
import importlib, json, sys
for name in json.loads(sys.stdin.read()):
    if name.split(".")[-1] != "__main__" and name not in sys.modules:
        try:
            importlib.import_module(name)
        except Exception:
            pass
print("REPORT", json.dumps({{"peak_kib": {PEAK_KIB}}}))
"""


def drop_caches() -> bool:
    """Cold-cache runs where the machine allows it (root outside a container)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(cmd: list[str]) -> tuple[float, float, float, str]:
    """Wall seconds, the child's user and system CPU seconds, its stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return seconds, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime, done.stdout


def report(cmd: list[str], stdin: str | None = None) -> dict:
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, input=stdin)
    return json.loads(done.stdout.rsplit("REPORT", 1)[1])


def converter_memory(src: Path, dst: Path) -> dict[str, int]:
    """Peak RSS of a conversion of `src`, of a process importing the same modules, and
    the difference (MiB)."""
    shutil.rmtree(dst, ignore_errors=True)
    conv = report([sys.executable, "-c", CONVERT_AND_REPORT, str(src), str(dst), "-q"])
    base = report([sys.executable, "-c", IMPORT_ONLY], stdin=json.dumps(conv["modules"]))
    shutil.rmtree(dst, ignore_errors=True)
    return {"peak_MiB": round(conv["peak_kib"] / 1024), "import_baseline_MiB": round(base["peak_kib"] / 1024), "own_MiB": round((conv["peak_kib"] - base["peak_kib"]) / 1024)}


def sha256_gbps() -> float:
    """One thread of hashlib's sha256 on this machine (what one hasher lane can do)."""
    block = os.urandom(64 << 20)
    t = time.perf_counter()
    hashlib.sha256(block).digest()
    return round(len(block) / (time.perf_counter() - t) / 1e9, 2)


def profile(src: Path, dst: Path) -> None:
    from dsv4.convert.pipeline import convert

    shutil.rmtree(dst, ignore_errors=True)
    drop_caches()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.runcall(convert, src, dst)
    print(f"in-process conversion, cold cache: {time.perf_counter() - t:.2f} s", file=sys.stderr)
    shutil.rmtree(dst, ignore_errors=True)
    stats = pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative")
    stats.print_stats(r"(pipeline|execute).py.*\((run_plan|run|_all_zero|still_valid)\)|writer.py.*\((write|start_writeback|sync)\)|_base.py.*\(result\)|\{method 'get' of '_queue|posix.posix_fadvise|method 'write' of '_io|posix.fsync")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="out/bench", type=Path)
    ap.add_argument("--repeat", default=3, type=int)
    ap.add_argument("--clean", action="store_true", help="Delete the source checkpoints afterwards too.")
    ap.add_argument("--profile", action="store_true", help="Profile one cold in-process conversion instead.")
    ap.add_argument("--variant", choices=["instruct", "dspark"], default="instruct", help="Flash's MTP slice, or V4-Flash-0731's DSpark drafter")
    args = ap.parse_args()
    src, tiny = args.work / ("flash-mtp-slice" if args.variant == "instruct" else "flash-0731-dspark-slice"), args.work / "tiny-real"
    if not (src / "config.json").exists():
        t = time.perf_counter()
        write_checkpoint(src, preset="flash", variant=args.variant, main_layers=0, sparse=False, seed=0)
        print(f"wrote the Flash {args.variant} slice in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    if not (tiny / "config.json").exists():
        write_checkpoint(tiny, preset="tiny", main_layers="all", seed=0)
    dst = args.work / "dst"
    if args.profile:
        profile(src, dst)
        return
    inv = read_inventory(src)
    plan = plan_conversion(inv, choose_table("xpu", inv))
    files = [src / f for f in plan.files_needed]
    nbytes = plan.bytes_to_read
    memory = {"tiny": converter_memory(tiny, dst), "flash": converter_memory(src, dst)}  # also warms the layout cache
    print(json.dumps({"memory": memory}), file=sys.stderr)
    cold = drop_caches()
    rows = []
    for round_ in range(1, args.repeat + 1):
        for kind in ("cp", "cp+sync", "convert"):
            shutil.rmtree(dst, ignore_errors=True)
            if kind != "convert":
                dst.mkdir(parents=True)
            drop_caches()
            if kind == "convert":
                cmd = [sys.executable, "-m", "dsv4", str(src), str(dst), "--json"]
            else:
                cmd = ["cp", *map(str, files), str(dst)]
                if kind == "cp+sync":
                    cmd = ["sh", "-c", " ".join(cmd) + " && sync"]
            seconds, user, system, out = timed(cmd)
            row = {"round": round_, "kind": kind, "seconds": round(seconds, 2), "GB/s": round(nbytes / seconds / 1e9, 3), "user_s": round(user, 2), "sys_s": round(system, 2)}
            if kind == "convert":
                result = json.loads(out)
                copy = result["seconds"]
                row |= {"copy_s": round(copy, 2), "startup_s": round(seconds - copy, 2), "read_vs_plan": round(result["bytes_read"] / result["bytes_planned"], 4)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    shutil.rmtree(dst, ignore_errors=True)
    if args.clean:
        shutil.rmtree(src)
        shutil.rmtree(tiny)
    by_round = {r: {row["kind"]: row for row in rows if row["round"] == r} for r in range(1, args.repeat + 1)}
    ratios = [round(k["cp+sync"]["seconds"] / k["convert"]["seconds"], 3) for k in by_round.values()]
    best = {k: min(r["seconds"] for r in rows if r["kind"] == k) for k in ("cp", "cp+sync", "convert")}
    print(json.dumps({
        "bytes": nbytes,
        "cold_cache": cold,
        "cpus": len(os.sched_getaffinity(0)),
        "hasher_lanes": hasher_lanes(),
        "sha256_one_thread_GB/s": sha256_gbps(),
        "runs": rows,
        "best_seconds": best,
        "ratio_vs_cp_sync_per_round": ratios,
        "throughput_ratio_vs_cp_sync_best": round(best["cp+sync"] / best["convert"], 3),
        "throughput_ratio_vs_cp_best": round(best["cp"] / best["convert"], 3),
        "memory": memory,
    }, indent=2))
    # the per-round table (markdown) on stderr: stdout stays one JSON document
    print("\n| round | cp s | cp+sync s | convert s | start-up s | convert user/sys s | convert / cp+sync |\n|---|---:|---:|---:|---:|---:|---:|", file=sys.stderr)
    for r, k in by_round.items():
        c = k["convert"]
        print(f"| {r} | {k['cp']['seconds']:.2f} | {k['cp+sync']['seconds']:.2f} | {c['seconds']:.2f} | {c['startup_s']:.2f} | {c['user_s']:.1f}/{c['sys_s']:.1f} | {k['cp+sync']['seconds'] / c['seconds']:.2f}x |", file=sys.stderr)


if __name__ == "__main__":
    main()
