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
from inprocess import run_main as run_in_process

from dsv4.convert.pipeline import convert
from dsv4.convert.synth import write_checkpoint


@pytest.fixture(scope="module")
def converted(tiny_native: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "xpu"
    convert(tiny_native, out)
    return out


def run_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`convert-dsv4 ARGS` in this process: (exit code, the one line on stderr)."""
    code, _, err = run_in_process(monkeypatch, capsys, *args)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) <= 1, err
    return code, lines[0] if lines else ""


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --- synth never writes over what a directory already holds -------------------------------
def test_synth_refuses_a_directory_that_is_not_empty(
    tiny_native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`synth` into an existing checkpoint (a typo for a real download) replaced its config,
    index and shards and left the rest: a mix of two checkpoints, exit 0."""
    user = tmp_path / "download"
    shutil.copytree(tiny_native, user)
    before = tree_digest(user)
    code, line = run_main(monkeypatch, capsys, "synth", str(user), "--preset", "tiny")
    assert code == 41
    assert line.startswith(f"error: {user}: exists and is not empty")
    assert tree_digest(user) == before


def test_synth_into_an_empty_directory_is_fine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    code, line = run_main(monkeypatch, capsys, "synth", str(tmp_path / "empty"), "--preset", "tiny")
    assert (code, line) == (0, "")
    assert (tmp_path / "empty" / "config.json").is_file()


def test_synth_on_a_full_disk_names_the_path_and_exits_42(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
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
def test_a_source_file_that_is_not_a_regular_file_is_named_so(
    name: str,
    kind: str,
    tiny_native: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
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
def test_a_manifest_target_that_is_no_installed_table_is_a_bad_manifest(
    target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It failed with exit 20 and a line naming neither the manifest nor its field, or, with
    the default name template, as an output.name of 'b-../x'."""
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'target = "{target}"\nsources = ["org/b"]\n')
    code, line = run_main(monkeypatch, capsys, "batch", str(manifest))
    assert code == 64
    # two targets are installed since --target draft
    assert (
        line
        == f"error: {manifest}: target '{target}' is not an installed mapping table (installed: draft, xpu); a table is chosen by name, not path"
    )


# --- a record that is a FIFO or a device is refused, not read forever ----------------------
def _cli_in_subprocess(*args: str) -> tuple[int, str]:
    """The CLI in its own process, so that a read blocked on a FIFO fails this test instead of hanging the suite."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "dsv4", *args], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return done.returncode, lines[0]


def _replace(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")  # endless: read whole, it fills memory


@pytest.mark.skipif(not (hasattr(os, "mkfifo") and os.path.exists("/dev/zero")), reason="needs FIFOs and /dev/zero")
@pytest.mark.parametrize(("name", "code"), [("config.json", 75), ("conversion.json", 73)])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_check_refuses_a_record_that_is_not_a_regular_file(
    name: str, code: int, kind: str, converted: Path, tmp_path: Path
) -> None:
    """check blocked forever on a FIFO config.json or conversion.json, and read /dev/zero until memory ran out."""
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    _replace(out / name, kind)
    rc, line = _cli_in_subprocess("check", str(out), "--fast")
    assert rc == code
    assert str(out / name) in line and "not a regular file" in line, line


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_convert_over_an_out_whose_record_is_a_fifo_is_refused(
    tiny_native: Path, converted: Path, tmp_path: Path
) -> None:
    """The up-to-date test and --overwrite's recognition read OUT's conversion.json: a FIFO there blocked them."""
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    _replace(out / "conversion.json", "fifo")
    rc, line = _cli_in_subprocess(str(tiny_native), str(out), "--overwrite", "-q")
    assert rc == 48
    assert "conversion.json" in line, line
