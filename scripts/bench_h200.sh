#!/usr/bin/env bash
# The converter benchmark on a bare device machine (the H200 machine): writes the real-size
# slice (real data) to that machine's disk, then scripts/bench_convert.py's alternating
# cold-cache rounds: `cp -r` + `sync`, the converter, the disk's own read + write, load
# average beside each round; the converter's memory on tiny and on the slice.
#
#   scripts/bench_h200.sh [instruct|dspark] [TARGET] [ROUNDS] [BENCH_OPTIONS...]   (defaults: instruct xpu 5)
#
# BENCH_OPTIONS go to scripts/bench_convert.py as they are (e.g. --io-profile --skip-memory).
# Runs from the repository root with the machine's own python3 (torch, safetensors,
# huggingface_hub, click and tqdm are there; nothing is installed): the tree is imported as
# the package `dsv4` through a link. Results go to $OUT (the device tool's folder) or
# $BENCH_WORK/results: bench-VARIANT-TARGET.json (stdout of the bench) and .log (its rounds).
# Time there: the Flash MTP slice (5.7 GB) about 4 minutes, the DSpark drafter (13 GB) about
# 8; one variant per call keeps each call inside the device tool's 10-minute limit.
set -euo pipefail
cd "$(dirname "$0")/.."
variant=${1:-instruct}
target=${2:-xpu}
rounds=${3:-5}
shift $(($# < 3 ? $# : 3))
work=${BENCH_WORK:-/tmp/bench}
results=${OUT:-$work/results}
mkdir -p /tmp/pk "$work" "$results"
ln -sfn "$PWD" /tmp/pk/dsv4
export PYTHONPATH=/tmp/pk XDG_CACHE_HOME=/tmp/xdg PYTHONUNBUFFERED=1
{
  date -u
  git rev-parse HEAD 2>/dev/null || true
  echo "cpus $(nproc)"
  free -g | head -2
  df -h "$work" | tail -1
  findmnt -no SOURCE,FSTYPE,OPTIONS -T "$work" || true
  uname -r
  ls /proc/pressure 2>/dev/null || echo "no /proc/pressure"
  cat /proc/sys/vm/dirty_background_ratio /proc/sys/vm/dirty_ratio
  python3 -c 'import sys, torch, safetensors; print(sys.version.split()[0], torch.__version__, safetensors.__version__)'
} 2>&1 | tee "$results/machine-$variant-$target.txt"
name="bench-$variant-$target"
python3 scripts/bench_convert.py --work "$work" --variant "$variant" --target "$target" --rounds "$rounds" "$@" \
  >"$results/$name.json" 2> >(tee "$results/$name.log" >&2)
cat "$results/$name.json"
