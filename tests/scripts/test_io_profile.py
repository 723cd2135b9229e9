"""scripts/io_profile.py, the per-round I/O profile of scripts/bench_convert.py --io-profile: how its
samples become the figures docs/results/convert.md reads (which of a process's reads and writes moved
in each sample, when its reads ended, the machine's iowait and PSI stall between the first and last)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "io_profile", Path(__file__).resolve().parents[2] / "scripts" / "io_profile.py"
)
assert _SPEC is not None and _SPEC.loader is not None
io_profile = importlib.util.module_from_spec(_SPEC)
sys.modules["io_profile"] = io_profile
_SPEC.loader.exec_module(io_profile)


def _sample(t: float, proc: tuple[int, int] | None, iowait: int = 0, psi_full_us: int = 0) -> dict:
    return {
        "t": t,
        "disk": None,
        "iowait": iowait,
        "psi": {"some": psi_full_us, "full": psi_full_us},
        "mem": {"Dirty": 1024 * t, "Writeback": 0},
        "proc": proc,
    }


def test_a_process_that_reads_then_reads_and_writes_then_exits_is_split_by_what_moved() -> None:
    sampler = io_profile.IoSampler(Path.cwd())
    sampler.samples = [
        _sample(0.0, (0, 0)),
        _sample(1.0, (100, 0)),  # only reading
        _sample(2.0, (200, 50)),  # reading and writing
        _sample(3.0, (300, 100)),  # reading and writing: its reads end here
        _sample(3.5, (300, 150)),  # only writing
        _sample(4.0, (300, 150)),  # neither
        _sample(4.5, None, iowait=3 * io_profile.CLK_TCK, psi_full_us=2_500_000),  # it has exited
    ]
    summary = sampler.summary()
    assert summary["process"] == {
        "read_MB": 0,
        "write_MB": 0,
        "reads_end_s": 3.0,
        "writes_end_s": 3.5,
        "both_s": 2.0,
        "read_only_s": 1.0,
        "write_only_s": 0.5,
        "idle_s": 0.5,
    }
    assert summary["wall_s"] == 4.5
    assert summary["iowait_cpu_s"] == 3.0
    assert summary["psi_io_full_s"] == 2.5
    assert summary["dirty_MB_at_start"] == 0 and summary["dirty_MB_max"] == 4
    assert "disk" not in summary  # no block device counted: left out, not zero


def test_the_sampler_follows_a_live_process_reads() -> None:
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"io-profile-{os.getpid()}.bin"
    path.write_bytes(b"x" * (1 << 20))
    try:
        with io_profile.IoSampler(path.parent) as sampler:
            sampler.watch(os.getpid())
            for _ in range(3):
                path.read_bytes()
        assert sampler.summary()["process"]["read_MB"] >= 3  # rchar: bytes through read calls
    finally:
        path.unlink()
