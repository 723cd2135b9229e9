"""Outputs another account can read: every file and directory this tool writes gets the
mode the umask gives a new one, as `cp` does (0644 files and 0755 directories under umask
022; 0600 and 0700 under 077), records (config.json, conversion.json, the index, the
batch report) included: a vLLM server running as a service account loads the output."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
from hubserver import FakeHub, hub_env, run_cli
from inprocess import run_main


@contextmanager
def umask(mask: int) -> Iterator[None]:
    """The process's umask (child processes inherit it)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, str]:
    """Every entry under root (root included) -> its permission bits, in octal."""
    return {str(p.relative_to(root.parent)): oct(stat.S_IMODE(p.stat().st_mode)) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize(("mask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_every_file_written_has_the_mode_the_umask_gives(
    mask: int,
    file_mode: int,
    dir_mode: int,
    tiny_native: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = partial(run_main, monkeypatch, capsys)
    out, junit, batch_out = tmp_path / "out", tmp_path / "reports" / "check.xml", tmp_path / "batch"
    manifest = tmp_path / "batch.toml"
    manifest.write_text(
        f'target = "xpu"\nsources = ["org/alpha"]\n\n[output]\ndir = "{batch_out}"\n\n[options]\ncheck = false\n'
    )
    with umask(mask), FakeHub() as hub:
        hub.commit_dir("org/alpha", tiny_native)
        assert run(tiny_native, out, "-q", "--max-shard-size", "1MB")[0] == 0
        assert run("check", out, "-q", "--fast", "--junit", junit)[0] == 0
        done = run_cli("batch", str(manifest), "-q", env=hub_env(hub, tmp_path / "hf"))
        assert done.returncode == 0, done.stderr
    written = {**modes(out), **modes(junit.parent), **modes(batch_out)}
    assert {
        "out/config.json",
        "out/conversion.json",
        "out/model.safetensors.index.json",
        "reports/check.xml",
        "batch/batch-report.json",
        "batch/alpha-xpu/conversion.json",
    } <= set(written)
    want = {name: oct(dir_mode if (tmp_path / name).is_dir() else file_mode) for name in written}
    assert written == want
