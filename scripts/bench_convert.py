"""Benchmark: convert a real-size draft slice against `cp -r` + `sync` of the same files and
against the disk's own read and write speed, in alternating cold-cache rounds; measure the
converter's own memory on it and on the tiny checkpoint.

    .venv/bin/python scripts/bench_convert.py [--work DIR] [--rounds N] [--clean]
    .venv/bin/python scripts/bench_convert.py --variant dspark     # V4-Flash-0731's DSpark drafter (~13 GB)
    .venv/bin/python scripts/bench_convert.py --variant v41 --target draft   # V4.1-Flash's drafter (~10.6 GB)
    .venv/bin/python scripts/bench_convert.py --target draft       # another installed target (convert --target)
    .venv/bin/python scripts/bench_convert.py --profile            # where the converter's time goes
    .venv/bin/python scripts/bench_convert.py --io-profile         # what every round waited on (scripts/io_profile.py)
    .venv/bin/python scripts/bench_convert.py --target draft --serve-with T --draft-format overlay   # a serving route

Writes (once, kept for reruns unless --clean) the real-size slice with real data (not
sparse): embed.weight, head.weight and the MTP block of Flash, ~5.7 GB (`--variant dspark`:
the three DSpark stages of V4-Flash-0731, ~13 GB), and the tiny checkpoint. Then N rounds;
each round measures, in an order that alternates from one round to the next (odd rounds
as listed, even rounds reversed), each from a cold page cache (`echo 3 >
/proc/sys/vm/drop_caches`: root outside a container; the report says whether it worked):

* `cp+sync`: `cp -r SRC DST && sync` (the converter makes its output durable before it
  declares it complete, so `sync` belongs to the copy it is compared with);
* `convert`: the converter as a whole command (`convert-dsv4 SRC DST --target T --json`, its
  entry point run by CONVERT_AND_REPORT below: interpreter start-up, imports, table, planning,
  copy, sha256 of every tensor, fsync, publish; with --serve-with, --draft-format and
  --allow-lossy passed on: a route's computed tensors too); its start-up is the wall time minus
  the seconds it reports for the copy, and it reports its peak RSS (its own memory, below);
* `disk`: the disk alone on the same bytes: every source file read with O_DIRECT (8 MiB
  requests, 4 in flight: no page cache, no copy), then as many bytes written with O_DIRECT
  to one file on the same disk and fsynced. Its figure is read + write seconds.

Beside every round: the 1-minute load average before it; with --io-profile, each measurement's I/O
counters (scripts/io_profile.py: the converter's read/write overlap, iowait, PSI, dirty pages).
Ratios are throughput ratios (time of the comparison / time of the converter: >= 1 means the
converter is as fast).

--profile instead runs one cold conversion of the slice in this process under cProfile
and prints where its main thread (the writer) spends the time.

Memory: the converter's peak RSS minus that of a process that only imports what the
converter imported (the same module list, taken from the converting process itself), for
tiny and for the slice before the rounds, and for every round's conversion (`own_MiB`). With
--serve-with only the rounds': the serving target's config describes the slice, not tiny.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import hashlib
import json
import mmap
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from io_profile import IoSampler  # scripts/io_profile.py, beside this file

from dsv4.convert.choose import choose_table
from dsv4.convert.execute import hasher_lanes
from dsv4.convert.plan import plan_conversion
from dsv4.convert.sources.inventory import read_inventory
from dsv4.convert.synth import write_checkpoint

# Peak RSS as VmHWM: ru_maxrss survives exec, so a child of this (torch-importing) script
# would report at least this script's size.
PEAK_KIB = "int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"
# Runs the converter's own entry point in this process, then reports its peak RSS and
# every module it imported (for the import-only baseline).
CONVERT_AND_REPORT = f"""
import json, sys
from dsv4.convert.cli.main import main
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
DISK_BLOCK = 8 << 20  # bytes per direct request
DISK_QUEUE = 4  # direct requests in flight


def drop_caches() -> bool:
    """Cold-cache runs where the machine allows it (root outside a container)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(cmd: list[str], sampler: IoSampler | None = None) -> tuple[float, float, float, str]:
    """Wall seconds, the child's user and system CPU seconds, its stdout; `sampler` follows the
    child's own reads and writes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as child:
        if sampler is not None:
            sampler.watch(child.pid)
        stdout, _ = child.communicate()
    seconds = time.perf_counter() - t
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, cmd, stdout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return seconds, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime, stdout


def _direct_requests(size: int) -> list[tuple[int, int]]:
    return [(off, min(DISK_BLOCK, size - off)) for off in range(0, size, DISK_BLOCK)]


def disk_read_seconds(files: list[Path]) -> float:
    """Read every byte of `files` with O_DIRECT, DISK_QUEUE requests in flight."""
    buffers = [mmap.mmap(-1, DISK_BLOCK) for _ in range(DISK_QUEUE)]
    fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files}
    work = [(fds[f], off, n) for f in files for off, n in _direct_requests(f.stat().st_size)]

    def read(k: int) -> None:
        buf = memoryview(buffers[k % DISK_QUEUE])
        for fd, off, n in work[k::DISK_QUEUE]:  # each thread its own buffer and share of the requests
            os.preadv(fd, [buf[: -(-n // 4096) * 4096]], off)

    t = time.perf_counter()
    with ThreadPoolExecutor(DISK_QUEUE) as pool:
        list(pool.map(read, range(DISK_QUEUE)))
    seconds = time.perf_counter() - t
    for fd in fds.values():
        os.close(fd)
    return seconds


def disk_write_seconds(path: Path, nbytes: int) -> float:
    """Write `nbytes` of random data to `path` with O_DIRECT, DISK_QUEUE requests in
    flight, and fsync it (the data are made before the clock starts)."""
    nbytes = -(-nbytes // 4096) * 4096
    buffers = []
    for _ in range(DISK_QUEUE):
        m = mmap.mmap(-1, DISK_BLOCK)
        m.write(os.urandom(DISK_BLOCK))
        buffers.append(m)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    work = _direct_requests(nbytes)

    def write(k: int) -> None:
        buf = memoryview(buffers[k])
        for off, n in work[k::DISK_QUEUE]:
            os.pwritev(fd, [buf[:n]], off)

    try:
        t = time.perf_counter()
        with ThreadPoolExecutor(DISK_QUEUE) as pool:
            list(pool.map(write, range(DISK_QUEUE)))
        os.fsync(fd)
        return time.perf_counter() - t
    finally:
        os.close(fd)
        path.unlink()


def report(cmd: list[str], stdin: str | None = None) -> dict:
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, input=stdin)
    return json.loads(done.stdout.rsplit("REPORT", 1)[1])


def convert_command(src: Path, dst: Path, target: str, serve: list[str], *options: str) -> list[str]:
    """The converter's entry point on `src`, reporting its peak RSS and modules after its own output."""
    return [sys.executable, "-c", CONVERT_AND_REPORT, str(src), str(dst), "--target", target, *serve, *options]


def import_baseline_kib(modules: list[str]) -> int:
    """Peak RSS of a process importing `modules` and nothing else."""
    return report([sys.executable, "-c", IMPORT_ONLY], stdin=json.dumps(modules))["peak_kib"]


def converter_memory(src: Path, dst: Path, target: str) -> dict[str, int]:
    """Peak RSS of a conversion of `src`, of a process importing the same modules, and
    the difference (MiB)."""
    shutil.rmtree(dst, ignore_errors=True)
    conv = report(convert_command(src, dst, target, [], "-q"))
    base = {"peak_kib": import_baseline_kib(conv["modules"])}
    shutil.rmtree(dst, ignore_errors=True)
    return {
        "peak_MiB": round(conv["peak_kib"] / 1024),
        "import_baseline_MiB": round(base["peak_kib"] / 1024),
        "own_MiB": round((conv["peak_kib"] - base["peak_kib"]) / 1024),
    }


def sha256_gbps() -> float:
    """One thread of hashlib's sha256 on this machine (what one hasher lane can do)."""
    block = os.urandom(64 << 20)
    t = time.perf_counter()
    hashlib.sha256(block).digest()
    return round(len(block) / (time.perf_counter() - t) / 1e9, 2)


def profile(src: Path, dst: Path, target: str, serve: list[str]) -> None:
    from dsv4.convert.cli.common import serving_request
    from dsv4.convert.pipeline import convert

    shutil.rmtree(dst, ignore_errors=True)
    serving = serving_request(target, *serve_values(serve), reverse=False) if serve else None
    drop_caches()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.runcall(convert, src, dst, target=target, serving=serving)
    print(f"in-process conversion, cold cache: {time.perf_counter() - t:.2f} s", file=sys.stderr)
    shutil.rmtree(dst, ignore_errors=True)
    stats = pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative")
    stats.print_stats(
        r"(pipeline|execute).py.*\((run_plan|run|_all_zero|still_valid)\)|writer.py.*\((write|start_writeback|sync)\)|"
        r"_base.py.*\(result\)|\{method 'get' of '_queue|posix.posix_fadvise|method 'write' of '_io|posix.fsync|"
        r"execute.py.*\((compute|read_whole)\)|transforms.py.*\(compute\)|transform_ops.py|requant.py.*\(requantise\)"
    )


def serve_options(args: argparse.Namespace) -> list[str]:
    """The converter's serving options as given here (empty without --serve-with)."""
    if args.serve_with is None:
        return []
    return ["--serve-with", str(args.serve_with), "--draft-format", args.draft_format] + (
        ["--allow-lossy"] if args.allow_lossy else []
    )


def serve_values(serve: list[str]) -> tuple[str, str, bool]:
    """serve_options' list back as serving_request's (serve_with, draft_format, allow_lossy)."""
    return serve[1], serve[3], "--allow-lossy" in serve


def measure(
    kind: str, src: Path, dst: Path, files: list[Path], nbytes: int, target: str, serve: list[str], io: bool
) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    drop_caches()
    row: dict = {"kind": kind, "load_avg": round(os.getloadavg()[0], 2)}
    sampler = IoSampler(dst.parent) if io else None
    with sampler or contextlib.nullcontext():
        if kind == "disk":
            dst.mkdir(parents=True)
            read_s = disk_read_seconds(files)
            drop_caches()
            write_s = disk_write_seconds(dst / "disk-write.bin", nbytes)
            row |= {"seconds": round(read_s + write_s, 2), "read_s": round(read_s, 2), "write_s": round(write_s, 2)}
        else:
            cmd = (
                ["sh", "-c", f"cp -r '{src}' '{dst}' && sync"]
                if kind == "cp+sync"
                else convert_command(src, dst, target, serve, "--json")
            )
            seconds, user, system, out = timed(cmd, sampler)
            row |= {"seconds": round(seconds, 2), "user_s": round(user, 2), "sys_s": round(system, 2)}
    if sampler is not None:
        row["io"] = sampler.summary()
    if kind == "convert":
        cli_out, reported = out.rsplit("REPORT", 1)
        result, conv = json.loads(cli_out), json.loads(reported)
        row |= {
            "copy_s": round(result["seconds"], 2),
            "startup_s": round(row["seconds"] - result["seconds"], 2),
            "read_vs_plan": round(result["bytes_read"] / result["bytes_planned"], 4),
            "bytes_written": result["bytes_written"],
            "written_MB_per_s": round(result["bytes_written"] / row["seconds"] / 1e6),
            "peak_kib": conv["peak_kib"],
            "modules": conv["modules"],
        }
    return row


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="out/bench", type=Path)
    ap.add_argument(
        "--rounds",
        "--repeat",
        default=5,
        type=int,
        help="alternating rounds (--repeat: the earlier name, in BENCHMARKS.md's older commands)",
    )
    ap.add_argument("--clean", action="store_true", help="Delete the source checkpoints afterwards too.")
    ap.add_argument("--profile", action="store_true", help="Profile one cold in-process conversion instead.")
    ap.add_argument(
        "--variant",
        choices=["instruct", "dspark", "v41"],
        default="instruct",
        help="Flash's MTP slice, V4-Flash-0731's DSpark drafter, or DeepSeek V4.1-Flash's (--target draft only)",
    )
    ap.add_argument("--target", default="xpu", help="the converter's --target")
    ap.add_argument("--serve-with", type=Path, help="the converter's --serve-with TARGET (a target model's directory)")
    ap.add_argument("--draft-format", default="auto", help="the converter's --draft-format (with --serve-with)")
    ap.add_argument("--allow-lossy", action="store_true", help="the converter's --allow-lossy (with --serve-with)")
    ap.add_argument("--skip-memory", action="store_true", help="Do not measure the converter's memory.")
    ap.add_argument(
        "--io-profile",
        action="store_true",
        help="Beside every measurement, the kernel's I/O counters (scripts/io_profile.py): disk busy, request "
        "times, iowait, PSI, the converter's read/write overlap.",
    )
    return ap.parse_args()


def source_checkpoints(work: Path, variant: str) -> tuple[Path, Path]:
    """The real-size slice and the tiny checkpoint under `work`, written where missing."""
    src, tiny = (
        work
        / {"instruct": "flash-mtp-slice", "dspark": "flash-0731-dspark-slice", "v41": "flash-v41-dspark-slice"}[
            variant
        ],
        work / "tiny-real",
    )
    if not (src / "config.json").exists():
        t = time.perf_counter()
        write_checkpoint(src, preset="flash", variant=variant, main_layers=0, sparse=False, seed=0)
        print(f"wrote the Flash {variant} slice in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    if not (tiny / "config.json").exists():
        write_checkpoint(tiny, preset="tiny", main_layers="all", seed=0)
    return src, tiny


def one_round(
    r: int, src: Path, dst: Path, files: list[Path], nbytes: int, target: str, serve: list[str], io: bool
) -> dict:
    """Round `r`: the three measurements, in the listed order in odd rounds, reversed in even."""
    kinds = ("cp+sync", "disk", "convert") if r % 2 else ("convert", "disk", "cp+sync")
    rows = {kind: measure(kind, src, dst, files, nbytes, target, serve, io) for kind in kinds}
    shutil.rmtree(dst, ignore_errors=True)
    c = rows["convert"]
    return {
        "round": r,
        "order": " > ".join(kinds),
        "load_avg": [rows[k]["load_avg"] for k in kinds],
        **{k: rows[k] for k in kinds},
        "convert_vs_cp_sync": round(rows["cp+sync"]["seconds"] / c["seconds"], 3),
        "convert_vs_disk": round(rows["disk"]["seconds"] / c["seconds"], 3),
    }


def print_round_table(rounds: list[dict], vs_cp: list[float], vs_disk: list[float]) -> None:
    """The per-round table (markdown) and the ratios' median and min, on stderr: stdout stays
    one JSON document."""
    print(
        "\n| round | order | load avg | cp -r + sync s | convert s (start-up) | convert user/sys s "
        "| disk read + write s | convert / cp+sync | convert / disk | written GB (MB/s) | own MiB |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        file=sys.stderr,
    )
    for row in rounds:
        c, d = row["convert"], row["disk"]
        print(
            f"| {row['round']} | {row['order']} | {', '.join(f'{x:.1f}' for x in row['load_avg'])} "
            f"| {row['cp+sync']['seconds']:.2f} | {c['seconds']:.2f} ({c['startup_s']:.2f}) "
            f"| {c['user_s']:.1f}/{c['sys_s']:.1f} | {d['read_s']:.2f} + {d['write_s']:.2f} "
            f"| {row['convert_vs_cp_sync']:.2f}x | {row['convert_vs_disk']:.2f}x "
            f"| {c['bytes_written'] / 1e9:.3f} ({c['written_MB_per_s']}) | {c['own_MiB']} |",
            file=sys.stderr,
        )
    if "io" in rounds[0]["convert"]:
        print_io_table(rounds)
    print(
        f"\nconvert / cp+sync: median {statistics.median(vs_cp):.3f}, min {min(vs_cp):.3f}; "
        f"convert / disk: median {statistics.median(vs_disk):.3f}, min {min(vs_disk):.3f}",
        file=sys.stderr,
    )


def _io_split(x: dict) -> str:
    """Seconds reading and writing at once / only reading / only writing / idle, or '-' (not measured)."""
    return " / ".join(f"{x[k]:.2f}" for k in ("both_s", "read_only_s", "write_only_s", "idle_s")) if x else "-"


def print_io_table(rounds: list[dict]) -> None:
    """With --io-profile: each measurement's I/O counters (scripts/io_profile.py), one row each."""
    print(
        "\n| round | measured | wall s | disk MB read / written | disk busy | ms per read / write request | "
        "mean queue | disk reading+writing / only reading / only writing / idle s | iowait cpu-s "
        "| PSI io some / full s | dirty MB at start / max | process reads end / disk writes end s "
        "| process reading+writing / only reading / only writing / idle s |\n"
        "|---|---|---:|---|---:|---|---:|---|---:|---|---|---|---|",
        file=sys.stderr,
    )
    for row in rounds:
        for kind in row["order"].split(" > "):
            io = row[kind]["io"]
            d, p = io.get("disk", {}), io.get("process", {})
            print(
                f"| {row['round']} | {kind} | {io['wall_s']:.2f} | {d.get('read_MB', '-')} / {d.get('write_MB', '-')} "
                f"| {d.get('busy', '-')} | {d.get('read_ms_per_request', '-')} / {d.get('write_ms_per_request', '-')} "
                f"| {d.get('mean_queue', '-')} | {_io_split(d)} | {io['iowait_cpu_s']:.2f} "
                f"| {io.get('psi_io_some_s', '-')} / {io.get('psi_io_full_s', '-')} "
                f"| {io['dirty_MB_at_start']} / {io['dirty_MB_max']} "
                f"| {p.get('reads_end_s', '-')} / {d.get('writes_end_s', '-')} | {_io_split(p)} |",
                file=sys.stderr,
            )


def main() -> None:
    args = parse_args()
    src, tiny = source_checkpoints(args.work, args.variant)
    dst = args.work / "dst"
    serve = serve_options(args)
    if args.profile:
        profile(src, dst, args.target, serve)
        return
    inv = read_inventory(src)
    plan = plan_conversion(inv, choose_table(args.target, inv))
    files = [src / f for f in plan.files_needed]
    nbytes = plan.bytes_to_read
    source_bytes = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    memory = (
        {}
        if args.skip_memory or serve
        else {"tiny": converter_memory(tiny, dst, args.target), "slice": converter_memory(src, dst, args.target)}
    )  # also warms the layout cache
    print(json.dumps({"memory": memory}), file=sys.stderr)
    cold = drop_caches()
    rounds = []
    for r in range(1, args.rounds + 1):
        rounds.append(one_round(r, src, dst, files, nbytes, args.target, serve, args.io_profile))
        modules = rounds[-1]["convert"].pop("modules")
        if r == 1:
            base_kib = import_baseline_kib(modules)  # every round imports the same modules
        c = rounds[-1]["convert"]
        c |= {"peak_MiB": round(c["peak_kib"] / 1024), "own_MiB": round((c.pop("peak_kib") - base_kib) / 1024)}
        print(json.dumps(rounds[-1]), file=sys.stderr)
    if args.clean:
        shutil.rmtree(src)
        shutil.rmtree(tiny)
    vs_cp = [r["convert_vs_cp_sync"] for r in rounds]
    vs_disk = [r["convert_vs_disk"] for r in rounds]
    print(
        json.dumps(
            {
                "source": str(src),
                "target": args.target,
                "serve": serve,
                "import_baseline_MiB": round(base_kib / 1024),
                "bytes_planned": nbytes,
                "bytes_in_source_dir": source_bytes,
                "cold_cache": cold,
                "cpus": len(os.sched_getaffinity(0)),
                "hasher_lanes": hasher_lanes(),
                "sha256_one_thread_GB/s": sha256_gbps(),
                "rounds": rounds,
                "convert_vs_cp_sync": {"per_round": vs_cp, "median": statistics.median(vs_cp), "min": min(vs_cp)},
                "convert_vs_disk": {"per_round": vs_disk, "median": statistics.median(vs_disk), "min": min(vs_disk)},
                "memory": memory,
            },
            indent=2,
        )
    )
    print_round_table(rounds, vs_cp, vs_disk)


if __name__ == "__main__":
    main()
