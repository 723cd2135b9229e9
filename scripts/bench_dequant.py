"""Benchmark: one `dequant_bf16` computation (the bf16 route's; convert/transform_ops.py) of a
Flash-sized weight, in a fresh process per tree: its seconds and the memory it takes beyond
its inputs (VmHWM after it minus VmRSS before it).

    .venv/bin/python scripts/bench_dequant.py [--other DIR] [--repeat 3]

Weights: attn.wq_b's FP8 [32768, 1024] with its 128x128 E8M0 grid (the largest computed
weight of the Flash MTP slice, 32 M values) and one routed expert's packed FP4 [2048, 4096]
with its E8M0 per 32. `--other DIR`: the same in the tree unpacked as DIR/dsv4.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

RUN = """
import json, sys, time
import torch
from dsv4.convert import transform_ops
from dsv4.convert.planned import Transform
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) // 1024
g = torch.Generator().manual_seed(0)
shapes = {"fp8 [32768, 1024]": ((32768, 1024), (256, 8)), "fp4 [2048, 4096]": ((2048, 2048), (2048, 128))}
kind, repeat = sys.argv[1], int(sys.argv[2])
(w, s) = shapes[kind]
if kind.startswith("fp8"):
    weight = torch.randint(0, 256, w, generator=g, dtype=torch.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0  # no NaN codes: an error of 0 either way
    weight = weight.view(torch.float8_e4m3fn)
else:
    weight = torch.randint(-128, 128, w, generator=g, dtype=torch.int8)
scale = torch.randint(120, 135, s, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
transform = Transform("dequant_bf16", (), (), True, (128, 128))
transform_ops.OPS["dequant_bf16"]([weight[:128], scale[:1] if kind.startswith("fp8") else scale[:128]], transform, "w")
before = status("VmRSS")
times = []
for _ in range(repeat):
    t = time.perf_counter()
    out = transform_ops.OPS["dequant_bf16"]([weight, scale], transform, "w")
    times.append(round(time.perf_counter() - t, 3))
    del out
print(json.dumps({"weight": kind, "seconds": times, "beyond_inputs_MiB": status("VmHWM") - before}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", help="the directory holding the other tree as dsv4/")
    parser.add_argument("--repeat", type=int, default=3)
    ns = parser.parse_args()
    for kind in ("fp8 [32768, 1024]", "fp4 [2048, 4096]"):
        for name, tree in [("this", None), *([("other", ns.other)] if ns.other else [])]:
            env = {**os.environ, "PYTHONPATH": tree} if tree else dict(os.environ)
            done = subprocess.run(
                [sys.executable, "-c", RUN, kind, str(ns.repeat)], capture_output=True, text=True, env=env, check=True
            )
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps({"tree": name, "load_1m": round(os.getloadavg()[0], 2), **row}), flush=True)


if __name__ == "__main__":
    main()
