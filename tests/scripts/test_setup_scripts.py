"""The scripts a newcomer runs first (issue 19, item 8): scripts/bootstrap.sh says what it
installs and lets the user choose the torch build; scripts/test.sh's output is the tests'."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUB_PYTHON = """#!/usr/bin/env bash
# a stand-in for .venv/bin/python: no torch is importable; pip records what it was asked
echo "$*" >> "$(dirname "$0")/calls"
case "$*" in
  "-c import torch"|"-c import triton") exit 1 ;;
  "-W ignore -") cat > /dev/null; echo "bootstrap: torch (stub)" ;;
esac
exit 0
"""


def run_bootstrap(
    tmp_path: Path, env: dict[str, str], extras: str = ""
) -> tuple[subprocess.CompletedProcess, list[str]]:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "scripts" / "bootstrap.sh")
    stub = tmp_path / ".venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX_URL", "PIP_INDEX_URL")}
    proc = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "bootstrap.sh"), *([extras] if extras else [])],
        capture_output=True,
        text=True,
        env=base | env,
    )
    return proc, (stub.parent / "calls").read_text().splitlines()


def test_bootstrap_installs_torch_from_the_index_the_user_chose(tmp_path: Path) -> None:
    proc, calls = run_bootstrap(tmp_path, {"TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"})
    assert proc.returncode == 0, proc.stderr
    assert (
        "-m pip install -q --disable-pip-version-check --index-url https://download.pytorch.org/whl/cpu torch==2.13.0"
        in calls
    )
    assert proc.stdout.splitlines() == [
        "bootstrap: no torch found; installing torch==2.13.0 from https://download.pytorch.org/whl/cpu",
        "bootstrap: torch (stub)",
    ]


def test_without_a_choice_bootstrap_says_pypi_gives_the_cuda_build_and_how_to_get_the_cpu_one(tmp_path: Path) -> None:
    proc, calls = run_bootstrap(tmp_path, {})
    assert proc.returncode == 0, proc.stderr
    assert "-m pip install -q --disable-pip-version-check torch==2.13.0" in calls  # pip's own index settings apply
    first = proc.stdout.splitlines()[0]
    assert "CUDA build" in first and "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in first


def test_bootstrap_pins_the_triton_the_tests_run_with(tmp_path: Path) -> None:
    _, calls = run_bootstrap(tmp_path, {}, "test")
    pinned = [c for c in calls if "triton" in c and "install" in c]
    assert pinned == ["-m pip install -q --disable-pip-version-check triton==3.9.0"]
    import torch

    # A CUDA or XPU build of torch brings its own triton (bootstrap installs none beside it), so
    # only beside a CPU build is the triton the tests run with the one bootstrap pinned.
    if torch.version.cuda is None and getattr(torch.version, "xpu", None) is None:
        triton = pytest.importorskip("triton")
        assert triton.__version__ == "3.9.0"  # the version the suite passes with beside torch 2.13.0 on the CPU


def test_the_test_command_prints_no_import_linter_banner() -> None:
    line = next(
        l for l in (ROOT / "scripts" / "test.sh").read_text().splitlines() if l.startswith(".venv/bin/lint-imports")
    )
    command = line.split("#")[0].split()
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), *command[1:]], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout
    assert not re.search(r"[╔╗╚╝═║]", proc.stdout) and "Contracts: 2 kept, 0 broken." in proc.stdout


def test_the_test_command_fetches_the_runtime_wheels_before_the_suite() -> None:
    """Issue 26 item 6: the runtime verification ran nowhere the wheels were not cached by hand
    (its tests skipped on every clean machine); the test command now fetches them first."""
    lines = [line.split("#")[0].strip() for line in (ROOT / "scripts" / "test.sh").read_text().splitlines()]
    fetch = lines.index(".venv/bin/python scripts/verify_runtimes.py --fetch-wheels >/dev/null")
    suite = next(k for k, line in enumerate(lines) if "-m pytest" in line)
    assert lines.index("scripts/bootstrap.sh test,quant") < fetch < suite
