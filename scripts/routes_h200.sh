#!/usr/bin/env bash
# The draft routes for a quantised serving target, at real Flash size, on a bare device machine (the H200
# machine): the real-data Flash MTP slice (scripts/bench_h200.sh's, same path and seed) written where missing,
# a compressed-tensors target beside it (the slice's config.json with tests/quant_configs.py's
# serving_target("W4A16", ["lm_head"]): W4A16 on every Linear but the head, FP8 blocks for wo_a), then each STEP:
#
#   scripts/routes_h200.sh STEP...
#     ROUTE:ROUNDS   overlay, bf16 or match-target (with --allow-lossy): scripts/bench_convert.py's alternating
#                    cold rounds against cp -r + sync and the disk, --io-profile, the converter's own memory
#     smoke[:ROUTES] the native draft and the drafts of ROUTES (comma-separated; default overlay,bf16;
#                    match-target with --allow-lossy) converted, each conversion timed, then
#                    scripts/bench_smoke_cuda.py: smoke and check --native (--serve-with TARGET) of each on cuda,
#                    and their logits against the native draft's
#
# Needs compressed-tensors (the target's config is read through it): on the device machine carry its wheels
# and install them first (/work/.library/device/README.md). Runs from the repository root with the machine's
# own python3, the tree imported as `dsv4` through a link, as scripts/bench_h200.sh does. Results go to $OUT
# or $BENCH_WORK/results: routes-ROUTE.json / .log, smoke-routes.jsonl / .log. Outputs are deleted afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${BENCH_WORK:-/tmp/bench}
results=${OUT:-$work/results}
slice=$work/flash-mtp-slice
target=$work/target-w4a16
mkdir -p /tmp/pk "$work" "$results"
ln -sfn "$PWD" /tmp/pk/dsv4
export PYTHONPATH=/tmp/pk${PYTHONPATH:+:$PYTHONPATH} XDG_CACHE_HOME=/tmp/xdg PYTHONUNBUFFERED=1
if [ ! -f "$slice/config.json" ]; then
  rm -rf "$slice" # a synth cut short: synth writes only into a new or empty directory
  /usr/bin/time -f "synth %e s, peak RSS %M KB" python3 -m dsv4 synth "$slice" --preset flash --main-layers 0 --seed 0 --json >/dev/null
fi
python3 - "$slice/config.json" "$target" <<'EOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "tests")
from quant_configs import serving_target
config = json.loads(Path(sys.argv[1]).read_text())
config["quantization_config"] = serving_target("W4A16", ["lm_head"])
Path(sys.argv[2]).mkdir(exist_ok=True)
Path(sys.argv[2], "config.json").write_text(json.dumps(config, indent=2))
EOF
for step in "$@"; do
  if [ "${step%%:*}" = smoke ]; then
    routes=overlay,bf16
    [ "$step" = smoke ] || routes=${step#*:}
    outs=()
    for route in ${routes//,/ }; do outs+=("$work/out-$route"); done
    {  # a pipeline's subshell: what it sets stays inside
      for route in native ${routes//,/ }; do
        rm -rf "$work/out-$route"
        serve=()
        [ "$route" = native ] || serve=(--serve-with "$target" --draft-format "$route")
        [ "$route" = match-target ] && serve+=(--allow-lossy)
        /usr/bin/time -f "convert --target draft $route %e s, peak RSS %M KB" \
          python3 -m dsv4 "$slice" "$work/out-$route" --target draft "${serve[@]}" --json -q
      done
    } 2>&1 | tee "$results/smoke-routes.log"
    python3 scripts/bench_smoke_cuda.py --native "$slice" --device cuda --serve-with "$target" \
      --same-logits-as "$work/out-native" "${outs[@]}" \
      >"$results/smoke-routes.jsonl" 2> >(tee -a "$results/smoke-routes.log" >&2)
    rm -rf "$work/out-native" "${outs[@]}"
  else
    route=${step%%:*}
    lossy=()
    [ "$route" = match-target ] && lossy=(--allow-lossy)
    python3 scripts/bench_convert.py --work "$work" --target draft --serve-with "$target" --draft-format "$route" \
      "${lossy[@]}" --rounds "${step#*:}" --io-profile \
      >"$results/routes-$route.json" 2> >(tee "$results/routes-$route.log" >&2)
  fi
done
