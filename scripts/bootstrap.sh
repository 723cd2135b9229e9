#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv in .venv and install dsv4-convert into it.
#   scripts/bootstrap.sh [EXTRAS]      e.g. "test,quant"
# torch: a torch already importable by python3 (an XPU or CUDA build the user brought) is
# reused through --system-site-packages; only where there is none is torch==2.13.0
# installed (a CPU build on the project's machines; never pulls a CUDA wheel by accident).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c 'import torch' 2>/dev/null; then
    echo "bootstrap: reusing the torch of $PY ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  echo "bootstrap: no torch found; installing torch==2.13.0"
  "${pip[@]}" torch==2.13.0
fi
.venv/bin/python -W ignore - <<'PY'
import sys, torch
if not hasattr(torch, "float8_e8m0fnu"):
    sys.exit(f"bootstrap: torch {torch.__version__} lacks float8_e8m0fnu; dsv4-convert needs torch >= 2.7")
PY
# XPU and CUDA builds of torch bring their own triton; a CPU build gets it only for the
# tests, which run kernels in Triton's interpreter (TRITON_INTERPRET=1).
if [[ ",$extras," == *",test,"* ]] && ! .venv/bin/python -c 'import triton' 2>/dev/null; then
  "${pip[@]}" triton
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
"${pip[@]}" -e "$spec"
