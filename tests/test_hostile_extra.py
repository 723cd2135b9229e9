"""Hostile situations found by trying the merged tool as a demanding user (issue 10's
verification): each reaches one line on stderr naming the path and a documented code,
and nothing the user owns is changed."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import pytest

from dsv4.convert import cli as cli_module
from dsv4.convert.synth import write_checkpoint


def run_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`convert-dsv4 ARGS` in this process: (exit code, the one line on stderr)."""
    monkeypatch.setattr(sys, "argv", ["convert-dsv4", *args])
    try:
        cli_module.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) <= 1, err
    return code, lines[0] if lines else ""


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


# --- synth never writes over what a directory already holds -------------------------------
def test_synth_refuses_a_directory_that_is_not_empty(tiny_native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`synth` into an existing checkpoint (a typo for a real download) replaced its config,
    index and shards and left the rest: a mix of two checkpoints, exit 0."""
    user = tmp_path / "download"
    shutil.copytree(tiny_native, user)
    before = tree_digest(user)
    code, line = run_main(monkeypatch, capsys, "synth", str(user), "--preset", "tiny")
    assert code == 41
    assert line.startswith(f"error: {user}: exists and is not empty")
    assert tree_digest(user) == before


def test_synth_into_an_empty_directory_is_fine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    code, line = run_main(monkeypatch, capsys, "synth", str(tmp_path / "empty"), "--preset", "tiny")
    assert (code, line) == (0, "")
    assert (tmp_path / "empty" / "config.json").is_file()


def test_synth_on_a_full_disk_names_the_path_and_exits_42(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A write's ENOSPC carries no file name: the line said only `error: No space left on device`, exit 1."""

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("dsv4.convert.synth.ShardWriter", full_disk)
    out = tmp_path / "synthetic"
    code, line = run_main(monkeypatch, capsys, "synth", str(out), "--preset", "tiny")
    assert code == 42
    assert line.startswith(f"error: {out}: No space left on device")


# --- a path that exists but is not a regular file is named as such, not as missing --------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "model-00001-of-00005.safetensors"])
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_source_file_that_is_not_a_regular_file_is_named_so(name: str, kind: str, tiny_native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A FIFO or directory in place of config.json, the index or a shard was reported as
    missing ("does not exist", "no config.json", "neither ... found")."""
    src = tmp_path / "src"
    shutil.copytree(tiny_native, src)
    (src / name).unlink()
    (src / name).mkdir() if kind == "directory" else os.mkfifo(src / name)
    code, line = run_main(monkeypatch, capsys, "plan", str(src))
    assert code == {"config.json": 18}.get(name, 11)
    assert line == f"error: {src / name}: is a {kind}, not a regular file"


def test_synth_library_still_writes_into_an_existing_directory(tmp_path: Path) -> None:
    """The library function keeps its contract (tests and benchmarks write into tmp dirs)."""
    (tmp_path / "note.txt").write_text("x")
    assert (write_checkpoint(tmp_path) / "config.json").is_file()


# --- a manifest's target is checked with the rest of the manifest -------------------------
@pytest.mark.parametrize("target", ["../x", "nosuch"])
def test_a_manifest_target_that_is_no_installed_table_is_a_bad_manifest(target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """It failed with exit 20 and a line naming neither the manifest nor its field, or, with
    the default name template, as an output.name of 'b-../x'."""
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'target = "{target}"\nsources = ["org/b"]\n')
    code, line = run_main(monkeypatch, capsys, "batch", str(manifest))
    assert code == 64
    assert line == f"error: {manifest}: target '{target}' is not an installed mapping table (installed: xpu); a table is chosen by name, not path"
