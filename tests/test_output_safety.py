"""The output directory's safety: nothing the user owns is destroyed, only a previous
output of this tool is replaced, one run owns OUT at a time, leftovers of killed runs are
removed by the next owner, and every OSError is exit 42 with the path and the reason."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
from filelock import FileLock
from inprocess import run_main

from dsv4.convert.check import run_checks
from dsv4.convert.exit_codes import code_of
from dsv4.convert.output import claim_output
from dsv4.convert.pipeline import convert
from dsv4.convert.synth import write_checkpoint


def tree(root: Path) -> dict[str, str]:
    """Every entry under root (root itself included): file bytes hashed, links by target."""
    out = {}
    for path in [root, *sorted(root.rglob("*"))]:
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


EMPTY = hashlib.sha256(b"").hexdigest()


def siblings(out: Path) -> list[str]:
    """OUT's hidden working entries beside it."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """`convert-dsv4 ARGS` in this process: (exit code, stdout, stderr)."""
    return partial(run_main, monkeypatch, capsys)


@pytest.fixture
def src(tiny_native: Path, tmp_path: Path) -> Path:
    """A copy of the tiny native checkpoint that a test may lose."""
    return Path(shutil.copytree(tiny_native, tmp_path / "src"))


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@contextmanager
def held(out: Path, *, lock_only: bool = False) -> Iterator[None]:
    """OUT owned by another run (a thread of this process, so the owner's pid is ours);
    with lock_only, just its lock file is held, as by a run that has only just taken it."""
    taken, done = threading.Event(), threading.Event()

    def holder() -> None:
        with FileLock(out.parent / f".{out.name}.lock") if lock_only else claim_output(out):
            taken.set()
            done.wait()

    thread = threading.Thread(target=holder)
    thread.start()
    assert taken.wait(30)
    try:
        yield
    finally:
        done.set()
        thread.join()


# --- the source is never touched ---------------------------------------------------------
def test_out_equal_to_the_source_is_refused_and_the_source_stays_byte_identical(src: Path, run) -> None:
    before = tree(src.parent)
    code, _, err = run(src, src, "--overwrite", "-q")
    assert code == code_of("output_is_source") == 43
    assert "is the source directory" in one_line(err)
    assert tree(src.parent) == before  # no shard deleted, no working directory created
    link = src.parent / "link"
    link.symlink_to(src)
    before = tree(src.parent)
    assert run(src, link, "--overwrite", "-q")[0] == 43  # the same directory through a symlink
    assert tree(src.parent) == before


def test_out_containing_the_source_is_refused_and_the_source_stays_byte_identical(
    tiny_native: Path, tmp_path: Path, run
) -> None:
    project = tmp_path / "P"
    shutil.copytree(tiny_native, project / "native")
    before = tree(tmp_path)
    code, _, err = run(project / "native", project, "--overwrite", "-q")
    assert code == code_of("source_in_output") == 45
    assert "the source is inside OUT" in one_line(err)
    assert tree(tmp_path) == before
    assert run(project / "native", project, "-q")[0] == 45  # refused before the non-empty check


def test_out_inside_the_source_is_refused_and_nothing_is_written_into_the_source(src: Path, run) -> None:
    before = tree(src.parent)
    code, _, err = run(src, src / "xpu", "-q")
    assert code == code_of("output_in_source") == 44
    assert "inside the source directory" in one_line(err)
    assert tree(src.parent) == before


def test_a_source_inside_a_working_directory_of_out_is_refused(tiny_native: Path, tmp_path: Path, run) -> None:
    # the next run on OUT removes .OUT.old-* directories: a source in one must be refused
    source = Path(shutil.copytree(tiny_native, tmp_path / ".out.old-12" / "native"))
    before = tree(tmp_path)
    assert run(source, tmp_path / "out", "-q")[0] == code_of("source_in_output")
    assert tree(tmp_path) == before


def test_out_whose_parent_is_a_file_is_refused_with_its_own_code(tiny_native: Path, tmp_path: Path, run) -> None:
    (tmp_path / "file").write_text("not a directory")
    for out in (tmp_path / "file" / "out", tmp_path / "file" / "a" / "b" / "out"):
        code, _, err = run(tiny_native, out, "-q")
        assert code == code_of("output_parent") == 46
        assert f"{tmp_path / 'file'}: is not a directory" in one_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


# --- --overwrite replaces only this tool's output ----------------------------------------
def test_overwrite_refuses_a_directory_that_is_not_an_output_of_this_tool(
    tiny_native: Path, tmp_path: Path, run
) -> None:
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "precious.txt").write_text("keep me")
    (out / "sub" / "data.bin").write_bytes(b"\0" * 100)
    before = tree(tmp_path)
    code, _, err = run(tiny_native, out, "--overwrite", "-q")
    assert code == code_of("overwrite_refused") == 48
    assert "--overwrite refused" in one_line(err)
    assert tree(tmp_path) == {**before, ".out.lock": EMPTY}  # only the (empty) lock file was added beside OUT


def test_overwrite_refuses_a_previous_output_holding_a_file_it_did_not_write(
    tiny_native: Path, tmp_path: Path, run
) -> None:
    out = tmp_path / "out"
    convert(tiny_native, out)
    (out / "notes.md").write_text("my notes about this checkpoint")
    before = tree(out)
    code, _, err = run(tiny_native, out, "--overwrite", "-q")
    assert code == 48 and "notes.md" in one_line(err)
    assert tree(out) == before


def test_overwrite_replaces_a_previous_output(tiny_native: Path, tmp_path: Path, run) -> None:
    other = write_checkpoint(tmp_path / "other", preset="tiny", main_layers="all", seed=7)
    out = tmp_path / "out"
    convert(tiny_native, out)
    assert run(other, out, "-q")[0] == code_of("output_exists")  # without --overwrite
    code, stdout, _ = run(other, out, "--overwrite", "-q")
    assert code == 0 and stdout.startswith("converted")
    assert run_checks(out).ok
    assert "already up to date" in run(other, out, "-q")[1]
    assert siblings(out) == [".out.lock"]


# --- a symlinked OUT is followed -----------------------------------------------------------
def test_a_symlinked_out_is_followed_and_the_link_is_kept(tiny_native: Path, tmp_path: Path, run) -> None:
    target = tmp_path / "big-disk" / "draft"
    target.mkdir(parents=True)
    link = tmp_path / "out"
    link.symlink_to(target)
    code, stdout, err = run(tiny_native, link, "-q")
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json",
        "conversion.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    assert run_checks(link).ok
    # replacing it keeps the link too, and leaves nothing beside the link or the target
    assert run(tiny_native, link, "--overwrite", "-q")[0] == 0
    assert link.is_symlink() and os.readlink(link) == str(target) and run_checks(link).ok
    assert siblings(link) == [] and siblings(target) == [".draft.lock"]


# --- leftovers of a killed run --------------------------------------------------------------
KILL_BETWEEN_THE_RENAMES = """
import os, signal, sys
from pathlib import Path
real_rename = Path.rename
def rename(self, target):
    if self.name.endswith(".partial") and any(p.name.startswith(".out.old-") for p in self.parent.iterdir()):
        os.kill(os.getpid(), signal.SIGKILL)  # OUT is aside, the new output not yet in place
    return real_rename(self, target)
Path.rename = rename
from dsv4.convert.pipeline import convert
convert(sys.argv[1], sys.argv[2], overwrite=True)
"""


def test_a_kill_between_the_two_renames_leaves_nothing_the_next_owner_does_not_remove(
    tiny_native: Path, tmp_path: Path, run
) -> None:
    out = tmp_path / "out"
    convert(tiny_native, out)
    killed = subprocess.run(
        [sys.executable, "-c", KILL_BETWEEN_THE_RENAMES, str(tiny_native), str(out)], capture_output=True, text=True
    )
    assert killed.returncode == -9, killed.stderr
    assert not out.exists() and any(name.startswith(".out.old-") for name in siblings(out))
    (tmp_path / ".out.old-keep").mkdir()  # not a name this tool gives: never removed
    (tmp_path / ".other.old-1").mkdir()
    with held(out, lock_only=True):  # a run that does not own OUT removes nothing
        code, _, err = run(tiny_native, out, "-q")
        assert code == code_of("output_locked") and "owner record .out.lock.owner is missing" in err
        assert any(name.startswith(".out.old-") and name != ".out.old-keep" for name in siblings(out))
    code, _, err = run(tiny_native, out, "-q")
    assert code == 0, err
    assert run_checks(out).ok
    assert siblings(out) == [".out.lock", ".out.old-keep"] and (tmp_path / ".other.old-1").is_dir()


# --- one run per OUT -------------------------------------------------------------------------
def test_a_run_finding_out_locked_exits_47_naming_the_owner_and_changes_nothing(
    tiny_native: Path, tmp_path: Path, run
) -> None:
    out = tmp_path / "out"
    with held(out):
        before = tree(tmp_path)
        code, _, err = run(tiny_native, out, "-q")
        assert code == code_of("output_locked") == 47
        assert f"locked by another run (pid {os.getpid()} on host {socket.gethostname()}" in one_line(err)
        assert tree(tmp_path) == before and not out.exists()


def test_with_wait_a_run_waits_for_the_owner_then_converts(tiny_native: Path, tmp_path: Path, run) -> None:
    out = tmp_path / "out"
    with held(out):
        result: dict[str, object] = {}
        waiter = threading.Thread(target=lambda: result.update(r=convert(tiny_native, out, wait=True)))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not out.exists()  # still waiting while OUT is held
    waiter.join(60)
    assert result["r"].status == "converted" and run_checks(out).ok


# --- every OSError of output handling is exit 42, with the path and the reason ----------------
def test_a_read_only_output_file_system_is_exit_42(
    tiny_native: Path, tmp_path: Path, run, monkeypatch: pytest.MonkeyPatch
) -> None:
    # running as root, chmod cannot make a directory read-only: the file system calls that
    # create entries in it fail instead, as on a read-only mount
    parent = tmp_path / "ro"
    parent.mkdir()
    real_open, real_mkdir = os.open, os.mkdir

    def read_only(path: object) -> None:
        if Path(os.fsdecode(path)).parent == parent:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    def guarded_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            read_only(path)
        return real_open(path, flags, *args, **kwargs)

    def guarded_mkdir(path, *args, **kwargs):
        read_only(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded_open)
    monkeypatch.setattr(os, "mkdir", guarded_mkdir)
    code, _, err = run(tiny_native, parent / "out", "-q")
    assert code == code_of("write_failed") == 42
    line = one_line(err)
    assert str(parent) in line and "Read-only file system" in line and "was not changed" in line
    # OUT's parent itself missing and not creatable there: the parent's own code
    code, _, err = run(tiny_native, parent / "new" / "out", "-q")
    assert code == code_of("output_parent")
    assert f"{parent / 'new'}: OUT's parent directory cannot be created (Read-only file system)" in one_line(err)
    assert list(parent.iterdir()) == []


def test_a_disk_full_at_the_start_is_exit_42_and_a_later_run_converts(
    tiny_native: Path, tmp_path: Path, run, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    real_mkdir = os.mkdir

    def full(path, *args, **kwargs):
        if os.fsdecode(path).endswith(".partial"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fsdecode(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", full)
    code, _, err = run(tiny_native, out, "-q")
    assert code == 42
    line = one_line(err)
    assert f"{tmp_path / '.out.partial'}: No space left on device" in line and "was not changed" in line
    monkeypatch.undo()
    assert convert(tiny_native, out).status == "converted" and run_checks(out).ok


def test_a_failed_publish_puts_the_previous_output_back(
    tiny_native: Path, tmp_path: Path, run, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = write_checkpoint(tmp_path / "other", preset="tiny", main_layers="all", seed=7)
    out = tmp_path / "out"
    convert(tiny_native, out)
    before = tree(out)
    real_rename = os.rename

    def refuse(src, dst, *args, **kwargs):
        if os.fsdecode(src).endswith(".partial"):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(src))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", refuse)
    code, _, err = run(other, out, "--overwrite", "-q")
    assert code == 42
    line = one_line(err)
    assert "Permission denied" in line and f"{out} was not changed" in line
    assert tree(out) == before  # the previous output is back in place, whole
    monkeypatch.undo()
    assert run(other, out, "--overwrite", "-q")[0] == 0 and run_checks(out).ok


def test_a_failure_after_publishing_says_that_out_was_published(
    tiny_native: Path, tmp_path: Path, run, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = write_checkpoint(tmp_path / "other", preset="tiny", main_layers="all", seed=7)
    out = tmp_path / "out"
    convert(tiny_native, out)
    real_rmtree = shutil.rmtree

    def failing_rmtree(path, *args, **kwargs):
        if Path(path).name.startswith(".out.old-"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fsdecode(path))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", failing_rmtree)
    code, _, err = run(other, out, "--overwrite", "-q")
    assert code == 42
    line = one_line(err)
    assert (
        "Input/output error" in line
        and f"{out} was published complete" in line
        and "no output directory was created" not in line
    )
    assert run_checks(out).ok
    monkeypatch.undo()
    assert run(other, out, "-q")[0] == 0  # up to date; and as OUT's next owner it removed the leftover
    assert siblings(out) == [".out.lock"]


def test_a_source_that_does_not_exist_touches_nothing(tmp_path: Path, run) -> None:
    code, _, err = run(tmp_path / "no-such-dir", tmp_path / "a" / "out", "-q")
    assert code == code_of("source_not_found") and "no-such-dir" in one_line(err)
    assert list(tmp_path.iterdir()) == []  # neither OUT's parent nor its lock was created
