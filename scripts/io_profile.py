"""Where a measured command's time went: the kernel's I/O counters, sampled every 50 ms while it runs.

    with IoSampler(work_dir) as s:
        s.watch(pid)            # optional: a process whose own read/write syscalls are followed
        ...                     # the measured command
    s.summary()                 # a dict, see below

Read beside each round of scripts/bench_convert.py (`--io-profile`), so that a slow round says what it
waited on. Every counter is the kernel's own (Documentation/admin-guide/iostats.rst, proc(5)); one the
machine lacks (no /proc/pressure, a file system on no block device) is left out of the summary, not faked.
On the H200 machine (Firecracker, a virtio disk) /proc/diskstats does not count the disk's own I/O (0-1 MB
read in rounds that read 5.7-13 GB, docs/results/convert.md): read the process, iowait and PSI figures there.

* the disk under the work directory (/proc/diskstats, the line of st_dev's major:minor): MB read and
  written, the share of the wall it was busy (io_ticks), the mean time a read and a write request took
  (ms reading / reads completed), the mean queue depth (weighted ms / wall ms), and the seconds in which
  it was reading and writing at once, only reading, only writing, idle (each 50 ms sample classified by
  which of its sector counts moved);
* the watched process (/proc/PID/io rchar and wchar: bytes through its read and write calls, direct
  reads included): the same four-way split of its own reads and writes (the executor's read/write
  overlap), and when its reads ended against when the disk's writes did (the writeback tail);
* the whole machine: CPU seconds in iowait (/proc/stat, summed over the cores), PSI's io stall
  seconds (/proc/pressure/io: "some" = at least one task waited on I/O), the most dirty and writeback
  page-cache MB (/proc/meminfo) and the dirty MB at the start.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

INTERVAL_S = 0.05
SECTOR = 512  # /proc/diskstats counts 512-byte sectors whatever the device's block size
CLK_TCK = os.sysconf("SC_CLK_TCK")
# /proc/diskstats fields after major, minor, name (iostats.rst): the ones read here
READS, SECTORS_READ, MS_READING, WRITES, SECTORS_WRITTEN, MS_WRITING, IN_FLIGHT, IO_TICKS, WEIGHTED_MS = range(9)


def disk_line_of(path: Path) -> str | None:
    """The /proc/diskstats name of the block device holding `path`, or None (no such device)."""
    dev = os.stat(path).st_dev
    wanted = (os.major(dev), os.minor(dev))
    try:
        for line in Path("/proc/diskstats").read_text().splitlines():
            f = line.split()
            if (int(f[0]), int(f[1])) == wanted:
                return f[2]
    except OSError:
        pass
    return None


def _disk(name: str | None) -> list[int] | None:
    if name is None:
        return None
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if f[2] == name:
            return [int(x) for x in f[3:12]]
    return None


def _cpu_iowait_ticks() -> int:
    return int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[5])  # cpu user nice system idle iowait


def _psi_io_us() -> dict[str, int] | None:
    try:
        rows = Path("/proc/pressure/io").read_text().splitlines()
    except OSError:
        return None
    return {r.split()[0]: int(r.rsplit("total=", 1)[1]) for r in rows}


def _meminfo_kb(keys: tuple[str, ...] = ("Dirty:", "Writeback:")) -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        f = line.split()
        if f[0] in keys:
            out[f[0].rstrip(":")] = int(f[1])
    return out


def _proc_io(pid: int | None) -> tuple[int, int] | None:
    if pid is None:
        return None
    try:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    except (OSError, ValueError):
        return None  # it has exited, or the file is not there
    return int(fields["rchar"]), int(fields["wchar"])


def _split(moves: list[tuple[float, bool, bool]]) -> dict[str, float]:
    """Seconds of samples in which reads and writes both moved, only reads, only writes, neither."""
    split = {"both_s": 0.0, "read_only_s": 0.0, "write_only_s": 0.0, "idle_s": 0.0}
    for dt, r, w in moves:
        split["both_s" if r and w else "read_only_s" if r else "write_only_s" if w else "idle_s"] += dt
    return {k: round(v, 2) for k, v in split.items()}


class IoSampler:
    """Samples the counters above every INTERVAL_S in a thread between __enter__ and __exit__."""

    def __init__(self, work: Path) -> None:
        self.disk = disk_line_of(work)
        self.pid: int | None = None
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, pid: int) -> None:
        """Follow `pid`'s own counters from now on (a sample is taken at once, so a short run has two)."""
        self.pid = pid
        self._append()

    def _append(self) -> None:
        with self._lock:  # the sampling thread and watch() both append; keep the samples in time order
            self.samples.append(self._sample())

    def _sample(self) -> dict[str, Any]:
        return {
            "t": time.perf_counter(),
            "disk": _disk(self.disk),
            "iowait": _cpu_iowait_ticks(),
            "psi": _psi_io_us(),
            "mem": _meminfo_kb(),
            "proc": _proc_io(self.pid),
        }

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self._append()

    def __enter__(self) -> IoSampler:
        self._append()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._append()

    def summary(self) -> dict[str, Any]:
        first, last = self.samples[0], self.samples[-1]
        wall = last["t"] - first["t"]
        out: dict[str, Any] = {
            "wall_s": round(wall, 2),
            "iowait_cpu_s": round((last["iowait"] - first["iowait"]) / CLK_TCK, 2),
            "dirty_MB_at_start": round(first["mem"].get("Dirty", 0) / 1024),
            "dirty_MB_max": round(max(s["mem"].get("Dirty", 0) for s in self.samples) / 1024),
            "writeback_MB_max": round(max(s["mem"].get("Writeback", 0) for s in self.samples) / 1024),
        }
        if first["psi"] and last["psi"]:
            out |= {f"psi_io_{k}_s": round((last["psi"][k] - first["psi"][k]) / 1e6, 2) for k in first["psi"]}
        if first["disk"] and last["disk"]:
            out["disk"] = self._disk_summary(wall)
        procs = [s for s in self.samples if s["proc"] is not None]
        if len(procs) > 1:
            out["process"] = self._process_summary(procs)
        return out

    def _disk_summary(self, wall: float) -> dict[str, Any]:
        d0, d1 = self.samples[0]["disk"], self.samples[-1]["disk"]
        delta = [b - a for a, b in zip(d0, d1, strict=True)]
        pairs = list(zip(self.samples, self.samples[1:], strict=False))
        moves = [
            (
                b["t"] - a["t"],
                b["disk"][SECTORS_READ] > a["disk"][SECTORS_READ],
                b["disk"][SECTORS_WRITTEN] > a["disk"][SECTORS_WRITTEN],
            )
            for a, b in pairs
        ]
        return {
            "name": self.disk,
            "read_MB": round(delta[SECTORS_READ] * SECTOR / 1e6),
            "write_MB": round(delta[SECTORS_WRITTEN] * SECTOR / 1e6),
            "busy": round(delta[IO_TICKS] / 1e3 / wall, 3) if wall else None,
            "read_ms_per_request": round(delta[MS_READING] / delta[READS], 2) if delta[READS] else None,
            "write_ms_per_request": round(delta[MS_WRITING] / delta[WRITES], 2) if delta[WRITES] else None,
            "mean_queue": round(delta[WEIGHTED_MS] / 1e3 / wall, 2) if wall else None,
            "writes_end_s": round(_last_move(self.samples, lambda s: s["disk"][SECTORS_WRITTEN]), 2),
            **_split(moves),
        }

    def _process_summary(self, procs: list[dict[str, Any]]) -> dict[str, Any]:
        moves = [
            (b["t"] - a["t"], b["proc"][0] > a["proc"][0], b["proc"][1] > a["proc"][1])
            for a, b in zip(procs, procs[1:], strict=False)
        ]
        return {
            "read_MB": round((procs[-1]["proc"][0] - procs[0]["proc"][0]) / 1e6),
            "write_MB": round((procs[-1]["proc"][1] - procs[0]["proc"][1]) / 1e6),
            "reads_end_s": round(_last_move(procs, lambda s: s["proc"][0], self.samples[0]["t"]), 2),
            "writes_end_s": round(_last_move(procs, lambda s: s["proc"][1], self.samples[0]["t"]), 2),
            **_split(moves),
        }


def _last_move(samples: list[dict[str, Any]], value: Any, t0: float | None = None) -> float:
    """Seconds from t0 (default: the first sample) to the last sample at which `value` still grew."""
    start = samples[0]["t"] if t0 is None else t0
    end = start
    for a, b in zip(samples, samples[1:], strict=False):
        if value(b) > value(a):
            end = b["t"]
    return end - start
