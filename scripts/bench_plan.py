"""Benchmark: header-only inventory and planning of the full-size sparse Flash replica.

    .venv/bin/python scripts/bench_plan.py [--work DIR]

Times (best of 5, in-process, after imports) reading all 46 shard headers (69,187
tensors), loading and validating the mapping table (against the native format and the
bundled model's target layout, from the layout cache), and planning; reports the bytes
read (headers only) against the checkpoint's logical size. Then `convert-dsv4 plan` as a
whole command (best of 5 with the layout cache filled, and once with an empty cache,
which builds the model on the meta device and so imports torch).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsv4.convert.plan import plan_conversion
from dsv4.convert.sources.inventory import read_inventory
from dsv4.convert.synth import write_checkpoint
from dsv4.mapping.probe import probe_keys
from dsv4.mapping.table import load_table


def best_of(n: int, fn):
    times, result = [], None
    for _ in range(n):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return min(times), result


def command_seconds(src: Path, env: dict[str, str] | None = None) -> float:
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "dsv4", "plan", str(src)],
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="out/bench", type=Path)
    args = ap.parse_args()
    src = args.work / "flash-sparse-all"
    if not (src / "config.json").exists():
        write_checkpoint(src, preset="flash", main_layers="all", sparse=True)
    t_inv, inv = best_of(5, lambda: read_inventory(src))

    def uncached_table():
        probe_keys.cache_clear()  # the native format and the (disk-cached) layouts every time
        return load_table("xpu")

    t_table, table = best_of(5, uncached_table)
    t_plan, plan = best_of(5, lambda: plan_conversion(inv, table))
    with tempfile.TemporaryDirectory() as empty:
        t_miss = command_seconds(src, {"XDG_CACHE_HOME": empty})
    t_cmd, _ = best_of(5, lambda: command_seconds(src))
    print(
        json.dumps(
            {
                "tensors": len(inv.tensors),
                "header_bytes_read": inv.header_bytes,
                "checkpoint_bytes": sum(inv.file_sizes.values()),
                "inventory_s": round(t_inv, 3),
                "table_s": round(t_table, 3),
                "plan_s": round(t_plan, 3),
                "total_s": round(t_inv + t_table + t_plan, 3),
                "command_s": round(t_cmd, 3),
                "command_empty_layout_cache_s": round(t_miss, 3),
                "bytes_to_read": plan.bytes_to_read,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
