#!/usr/bin/env bash
# The test command (README; CI runs exactly this): own virtualenv, the layers contract
# (import-linter, pyproject.toml), the formatter and linter (ruff), then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh test,quant
# the vLLM and SGLang wheels the runtime verification reads (tests/scripts/test_verify_runtimes.py):
# the pinned releases and the newest one a drafter family's range claims (mapping/targets/draft.toml),
# pip download --no-deps into the wheel cache, once, an install step like the one above
.venv/bin/python scripts/verify_runtimes.py --fetch-wheels >/dev/null
.venv/bin/lint-imports --no-logo  # the contracts and their verdicts, without the ASCII-art banner
.venv/bin/ruff format --check --quiet .  # the formatter (pyproject.toml [tool.ruff]): a diff fails
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest -q "$@"
