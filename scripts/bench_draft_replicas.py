"""Benchmark: `--target draft` of the full-size sparse replicas (Flash MTP, the 0731 DSpark
drafter, V4-Pro-0813's and V4.1-Flash's), from disk and from the test suite's fake hub, bytes
read against the plan's.

    .venv/bin/python scripts/bench_draft_replicas.py [--work DIR] [--replica NAME ...]

Each replica is `synth --sparse --main-layers all` (headers real, tensor data file holes
that read as zeros: 160 GB logical for Flash, written once into DIR). The conversion reads
the planned ranges whatever they hold, so the bytes read and the request pattern are those
of the real checkpoint; the seconds are not a disk's (holes cost no I/O). The disk-speed
comparison with `cp -r` + `sync` on real data is scripts/bench_convert.py --target draft.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hubserver import FakeHub, hub_env, run_cli  # noqa: E402

from dsv4.convert.synth import write_checkpoint  # noqa: E402

REPLICAS = {
    "flash": {"preset": "flash", "variant": "instruct"},
    "flash-0731": {"preset": "flash", "variant": "dspark"},
    "pro-0813": {"preset": "pro", "variant": "dspark"},
    "flash-v41": {"preset": "flash", "variant": "v41"},  # DeepSeek V4.1-Flash (model/presets_v41.py)
}


def convert(source: str, out: Path, env: dict[str, str]) -> dict[str, object]:
    t0 = time.monotonic()
    r = run_cli(source, str(out), "--target", "draft", "--json", env=env, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"convert {source} failed ({r.returncode}): {r.stderr.strip()}")
    result = json.loads(r.stdout)
    result["command_wall_s"] = round(time.monotonic() - t0, 2)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("out/bench"))
    ap.add_argument("--replica", choices=REPLICAS, action="append", help="only this replica (repeatable; default all)")
    args = ap.parse_args()
    for name in args.replica or REPLICAS:
        how = REPLICAS[name]
        src = args.work / f"{name}-sparse-all"
        if not (src / "config.json").exists():
            write_checkpoint(src, preset=how["preset"], variant=how["variant"], main_layers="all", sparse=True)
        with FakeHub() as hub, tempfile.TemporaryDirectory() as tmp:
            hub.commit_sparse_dir(f"org/{name}", src)
            env = hub_env(hub, Path(tmp) / "hf")
            for where, source in (("disk", str(src)), ("hub", f"org/{name}")):
                out = Path(tmp) / f"out-{where}"
                r = convert(source, out, env)
                print(
                    json.dumps(
                        {
                            "replica": name,
                            "from": where,
                            **{
                                k: r.get(k)
                                for k in (
                                    "tensors",
                                    "bytes_read",
                                    "bytes_planned",
                                    "bytes_written",
                                    "seconds",
                                    "command_wall_s",
                                )
                            },
                        }
                    ),
                    flush=True,
                )
                shutil.rmtree(out)


if __name__ == "__main__":
    main()
