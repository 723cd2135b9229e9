#!/usr/bin/env bash
# The test command (README; CI runs exactly this): own virtualenv, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh test,quant
exec .venv/bin/python -m pytest -q "$@"
