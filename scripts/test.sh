#!/usr/bin/env bash
# The test command (README; CI runs exactly this): own virtualenv, the layers contract
# (import-linter, pyproject.toml), then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh test,quant
.venv/bin/lint-imports --no-logo  # the contracts and their verdicts, without the ASCII-art banner
exec .venv/bin/python -m pytest -q "$@"
