#!/usr/bin/env bash
# The main job on its embedded default: write a small native DeepSeek V4 checkpoint,
# convert it to the XPU MTP layout, check it, and smoke-test it on the best device present
# (xpu > cuda > cpu) against the independent reference on the native checkpoint; then
# write the standalone draft directory the runtimes serve, check it (also that it would
# load beside its target in vLLM), smoke-test it, and print the two serve commands.
set -euo pipefail
# DIR is relative to where the user ran this; the default out/demo to the repository
work="$(realpath -m "${1:-$(dirname "$0")/../out/demo}")"
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
run=(.venv/bin/convert-dsv4)
# synth refuses a directory that is not empty: a rerun keeps the checkpoint the first run wrote
[ -e "$work/native/config.json" ] || "${run[@]}" synth "$work/native" --preset tiny --main-layers all --seed 0
"${run[@]}" plan "$work/native" --target xpu
"${run[@]}" "$work/native" "$work/xpu" --target xpu --overwrite
"${run[@]}" check "$work/xpu" --native "$work/native"
"${run[@]}" smoke "$work/xpu" --native "$work/native"
"${run[@]}" "$work/native" "$work/draft" --target draft --overwrite
"${run[@]}" check "$work/draft" --native "$work/native" --serve-with "$work/native"
"${run[@]}" smoke "$work/draft" --native "$work/native"
cat <<SERVE
Serve the draft beside its target (docs/serving.md):
  vllm serve $work/native --speculative-config '{"method":"mtp","model":"$work/draft","num_speculative_tokens":1}'
  python -m sglang.launch_server --model-path $work/native --speculative-algorithm NEXTN --speculative-draft-model-path $work/draft
SERVE
