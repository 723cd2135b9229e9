"""Benchmark: the overlay route of the real-size Flash slice (a draft to serve beside a
compressed-tensors target: FP8 linears keep their bytes beside an F32 weight_scale decoded from
E8M0, FP4 experts become MXFP4 byte copies), against `cp -r` + `sync` of the same source, one
round each from a cold page cache where the machine allows it; and the converter's peak memory
beyond what it imports.

    nice .venv/bin/python scripts/bench_overlay.py [--work DIR]

The slice is scripts/bench_convert.py's (embed, head and the MTP block of Flash, real data,
~5.7 GB, written once under DIR). The ServePlan is made here by hand (every FP8 or FP4 module of
the draft, as the overlay route's schemes give them), so this measures the executor's copies and
computed tensors, not a target's config.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_convert import IMPORT_ONLY, PEAK_KIB, drop_caches, report, source_checkpoints, timed

OVERLAY = f"""
import json, sys, time
from dsv4.convert.inmemory import bundled_plan
from dsv4.convert.pipeline import convert
from dsv4.convert.schemes.base import Decision, Output, Scheme, ServePlan, layer_map
from dsv4.model.native import standalone_draft_layout

def overlay(part, native):
    (wd, ws), (sd, ss) = native[part + ".weight"], native[part + ".scale"]
    w, s = part + ".weight", part + ".scale"
    if wd == "I8":
        return [Output(w + "_packed", "U8", ws, "copy", (w,)), Output(w + "_scale", "U8", ss, "copy", (s,))]
    return [Output(w, wd, ws, "copy", (w,)),
            Output(w + "_scale", "F32", ss, "e8m0_to_f32" if sd == "F8_E8M0" else "copy", (s,))]

src, dst = sys.argv[1], sys.argv[2]
layers = layer_map(bundled_plan(src))

def serve_with(source, plan):
    native = standalone_draft_layout(plan.model_config)
    scheme = Scheme("overlay", overlay)
    return ServePlan("overlay", [Decision(m, layers.kinds[m], parts, scheme, "bench")
                                 for m, parts in layers.parts.items()
                                 if native.get(parts[0] + ".weight", ("BF16",))[0] != "BF16"], None, None, "bench")

t = time.perf_counter()
result = convert(src, dst, target="draft", serve_with=serve_with)
computed = sum(1 for t_ in result.plan.tensors if t_.transform is not None)
print("REPORT", json.dumps({{"peak_kib": {PEAK_KIB}, "modules": sorted(sys.modules), "wall_s": time.perf_counter() - t,
      "computed_tensors": computed, **result.to_json()}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("out/bench"))
    args = ap.parse_args()
    src, _ = source_checkpoints(args.work, "instruct")
    dst = args.work / "overlay-out"
    cold = drop_caches()
    shutil.rmtree(dst, ignore_errors=True)
    t = time.perf_counter()
    run = report([sys.executable, "-c", OVERLAY, str(src), str(dst)])
    overlay_s = time.perf_counter() - t
    shutil.rmtree(dst, ignore_errors=True)
    base = report([sys.executable, "-c", IMPORT_ONLY], stdin=json.dumps(run.pop("modules")))
    drop_caches()
    cp_s, _, _, _ = timed(["sh", "-c", f"cp -r '{src}' '{dst}' && sync"])
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    print(
        json.dumps(
            {
                "cold_cache": cold,
                "overlay_command_s": round(overlay_s, 2),
                "overlay_convert_s": round(run["wall_s"], 2),
                "overlay_copy_s": round(run["seconds"], 2),
                "cp_sync_s": round(cp_s, 2),
                "overlay_vs_cp_sync": round(cp_s / overlay_s, 3),
                "bytes_read": run["bytes_read"],
                "bytes_planned": run["bytes_planned"],
                "bytes_written": run["bytes_written"],
                "tensors": run["tensors"],
                "computed_tensors": run["computed_tensors"],
                "peak_MiB": round(run["peak_kib"] / 1024),
                "import_baseline_MiB": round(base["peak_kib"] / 1024),
                "own_MiB": round((run["peak_kib"] - base["peak_kib"]) / 1024),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
