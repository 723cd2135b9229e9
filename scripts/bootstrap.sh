#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv in .venv and install dsv4-convert into it.
#   scripts/bootstrap.sh [EXTRAS]      e.g. "test,quant"
# What it installs:
#   - torch: a torch already importable by python3 (an XPU or CUDA build the user brought) is
#     reused through --system-site-packages. Only where there is none is torch==2.13.0
#     installed, from pip's index as configured (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL and pip's
#     config files are honoured, as by any pip). On PyPI the Linux x86_64 wheel of torch is
#     the CUDA build (with its nvidia-* packages, several GB); for the CPU build, set
#       TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/bootstrap.sh
#     (used for torch alone, as pip's --index-url).
#   - with the "test" extra on a torch without Triton (a CPU build): triton==3.9.0, the
#     version the tests run the kernels with in Triton's interpreter (TRITON_INTERPRET=1)
#     beside torch 2.13.0 on the CPU.
#   - dsv4-convert itself, editable, with EXTRAS.
# It prints one line naming the torch it uses.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
TORCH=torch==2.13.0
TRITON=triton==3.9.0
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c 'import torch' 2>/dev/null; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    echo "bootstrap: no torch found; installing $TORCH from $TORCH_INDEX_URL"
    "${pip[@]}" --index-url "$TORCH_INDEX_URL" "$TORCH"
  else
    echo "bootstrap: no torch found; installing $TORCH from pip's index (${PIP_INDEX_URL:-PyPI, or as pip is configured}; on PyPI the CUDA build: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for the CPU build)"
    "${pip[@]}" "$TORCH"
  fi
fi
.venv/bin/python -W ignore - <<'PY'
import sys, torch
if not hasattr(torch, "float8_e8m0fnu"):
    sys.exit(f"bootstrap: torch {torch.__version__} lacks float8_e8m0fnu; dsv4-convert needs torch >= 2.7")
build = "CUDA " + torch.version.cuda if torch.version.cuda else "XPU" if getattr(torch.version, "xpu", None) else "CPU"
print(f"bootstrap: torch {torch.__version__} ({build} build) from {torch.__file__.removesuffix('/__init__.py')}")
PY
# XPU and CUDA builds of torch bring their own triton; a CPU build gets it only for the
# tests, which run kernels in Triton's interpreter (TRITON_INTERPRET=1).
if [[ ",$extras," == *",test,"* ]] && ! .venv/bin/python -c 'import triton' 2>/dev/null; then
  "${pip[@]}" "$TRITON"
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
"${pip[@]}" -e "$spec"
