#!/usr/bin/env bash
# The bundled model on the H200 machine at real size: writes the real-data Flash MTP slice (the one
# scripts/bench_h200.sh benchmarks, same path and seed) where missing, converts it with --target draft
# and --target xpu, then scripts/bench_smoke_cuda.py: `smoke OUT --native SLICE` and `check OUT --native
# SLICE` on cuda for both outputs (seconds, peak GPU memory, verdicts, Triton launches). The outputs
# are deleted afterwards; the slice is kept for the benchmark.
#
#   scripts/smoke_h200.sh [DEVICE]      (default: cuda)
#
# Runs from the repository root with the machine's own python3, the tree imported as `dsv4`
# through a link, as scripts/bench_h200.sh does. Results go to $OUT or $BENCH_WORK/results:
# smoke-cuda.jsonl (one JSON line per command) and smoke-cuda.log (its table, the conversions).
set -euo pipefail
cd "$(dirname "$0")/.."
device=${1:-cuda}
work=${BENCH_WORK:-/tmp/bench}
results=${OUT:-$work/results}
slice=$work/flash-mtp-slice
mkdir -p /tmp/pk "$work" "$results"
ln -sfn "$PWD" /tmp/pk/dsv4
export PYTHONPATH=/tmp/pk XDG_CACHE_HOME=/tmp/xdg PYTHONUNBUFFERED=1
{
  python3 -c 'import torch, triton; print(torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
  if [ ! -f "$slice/config.json" ]; then
    rm -rf "$slice"  # a synth cut short: synth writes only into a new or empty directory
    /usr/bin/time -f "synth %e s, peak RSS %M KB" python3 -m dsv4 synth "$slice" --preset flash --main-layers 0 --seed 0 --json
  fi
  for target in draft xpu; do
    rm -rf "$work/out-$target"
    /usr/bin/time -f "convert --target $target %e s, peak RSS %M KB" \
      python3 -m dsv4 "$slice" "$work/out-$target" --target "$target" --json -q
  done
} 2>&1 | tee "$results/smoke-cuda.log"
python3 scripts/bench_smoke_cuda.py --native "$slice" --device "$device" "$work/out-draft" "$work/out-xpu" \
  >"$results/smoke-cuda.jsonl" 2> >(tee -a "$results/smoke-cuda.log" >&2)
rm -rf "$work/out-draft" "$work/out-xpu"
