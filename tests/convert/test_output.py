"""The output directory's safety: nothing the user owns is destroyed, only a previous
output of this tool is replaced, one run owns OUT at a time, leftovers of killed runs are
removed by the next owner, and every OSError is exit 42 with the path and the reason.

The ground moving under a run: a source file rewritten or replaced mid-conversion is refused
(exit 36, the file named, nothing published, a rerun converts the settled source); a lock file
removed by hand stops the run that held it before it writes on or publishes (exit 47); an OUT
whose hidden siblings' names would pass the file system's limit is refused before anything is
created (exit 42); a temporary record file a kill left in the partial directory is never
published. Two converter processes on one OUT, over many rounds: each round ends with exactly one
complete OUT that passes `check` and holds only the converter's own files; the other waited or
was refused with exit 47 naming the winner. Outputs another account can read: every file and
directory written gets the mode the umask gives a new one, as `cp` does (0644/0755 under umask
022, 0600/0700 under 077), records and the batch report included."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
from edits import RECORD, replace_by_special_file
from filelock import FileLock
from hubserver import FakeHub, hub_env, run_cli
from inprocess import held_by_a_thread, one_error_line, raising, run_in_subprocess_one_line, run_main

from dsv4.convert import pipeline
from dsv4.convert.check.run import run_checks
from dsv4.convert.errors import HubError
from dsv4.convert.exit_codes import code_of
from dsv4.convert.output import OutputClaim, claim_output
from dsv4.convert.pipeline import convert
from dsv4.convert.sources.location import open_source
from dsv4.convert.synth import write_checkpoint
from dsv4.model.checkpoint import INDEX_NAME


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
    with held_by_a_thread(lambda: FileLock(out.parent / f".{out.name}.lock") if lock_only else claim_output(out)):
        yield


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


def test_a_temporary_owner_record_a_kill_left_beside_out_is_removed_by_the_next_owner(
    tiny_native: Path, tmp_path: Path, run
) -> None:
    # a signal burst can end a run between the owner record's temporary file and its rename
    # (seen in test_interrupts' random moments: SIGTERM x3 left ..out.lock.owner.<hex>.tmp)
    out = tmp_path / "out"
    (tmp_path / "..out.lock.owner.0123abcd.tmp").write_text("{}")
    (tmp_path / "..out.lock.owner.keep.tmp").write_text("{}")  # not a name this tool gives: never removed
    code, _, err = run(tiny_native, out, "-q")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [
        "..out.lock.owner.keep.tmp",
        ".out.lock",
    ]


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


# --- hostile file-system states reach one line, whatever code the owner of that path gives ----
def test_outputs_below_a_file_end_in_one_line(
    tiny_native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    manifest = tmp_path / "m.toml"
    manifest.write_text('sources = ["org/a"]\n')
    monkeypatch.setattr(
        "dsv4.convert.batch.run.resolve_commit", raising(HubError("org/a: no such repo", kind="repo_not_found"))
    )  # no network in tests
    for (
        args
    ) in (  # convert's and synth's output checks are other modules' (their codes may change): one line naming the path
        [str(tiny_native), str(blocker / "out"), "-q"],
        ["synth", str(blocker / "native"), "--preset", "tiny"],
    ):
        code, _, err = run_main(monkeypatch, capsys, *args)
        assert code != 0
        assert str(blocker) in one_error_line(err), args
    code, _, err = run_main(monkeypatch, capsys, "batch", str(manifest), "--report", str(blocker / "report.json"))
    assert (code, one_error_line(err)) == (
        42,
        f"error: {blocker / 'report.json'}: cannot write the batch report ({blocker} is not a directory)",
    )


@pytest.mark.parametrize("record", ["[]", "[" * 100_000, '{"fingerprint": 1, "fingerprint": 2}', "\xff"])
def test_an_out_whose_record_is_malformed_records_nothing(
    record: str, tiny_native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """read_record: not a strict JSON object means no record, so OUT is a foreign non-empty folder."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / RECORD).write_text(record, encoding="latin-1")
    code, _, err = run_main(monkeypatch, capsys, str(tiny_native), str(tmp_path / "out"), "-q")
    assert code == 41 and "exists and is not empty" in one_error_line(err)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_convert_over_an_out_whose_record_is_a_fifo_is_refused(
    tiny_native: Path, tiny_xpu: Path, tmp_path: Path
) -> None:
    """The up-to-date test and --overwrite's recognition read OUT's conversion.json: a FIFO there blocked them."""
    out = tmp_path / "out"
    shutil.copytree(tiny_xpu, out)
    replace_by_special_file(out / "conversion.json", "fifo")
    rc, line = run_in_subprocess_one_line(str(tiny_native), str(out), "--overwrite", "-q")
    assert rc == 48
    assert "conversion.json" in line, line


def files(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def at_first_write(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> None:
    """Run `action` once, when the first output bytes are written (the progress bar's first
    step, as tests/crashing_cli.py hooks it)."""
    make_bar = pipeline.progress_bar

    def hooked(total: int, done: int, quiet: bool):  # noqa: ANN202  (tqdm's type)
        bar = make_bar(total, done, quiet)
        update, pending = bar.update, [action]

        def first(n: int = 1) -> None:
            # the executor holds this function, not the attribute: fire once by a flag
            while pending:
                pending.pop()()
            update(n)

        bar.update = first
        return bar

    monkeypatch.setattr(pipeline, "progress_bar", hooked)


def flip_last_byte(path: Path) -> None:
    """Rewrite the file in place (same inode, same size): its last tensor byte changes."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def replace_by_a_copy(path: Path) -> None:
    """Replace the file by a rename over it (another inode), its bytes changed."""
    copy = path.with_name(path.name + ".new")
    shutil.copyfile(path, copy)
    flip_last_byte(copy)
    os.replace(copy, path)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (flip_last_byte, "was rewritten (its modification time changed)"),
        (replace_by_a_copy, "was replaced by another file"),
    ],
)
def test_a_source_file_changed_mid_run_is_refused_and_a_rerun_converts_the_settled_source(
    change: Callable[[Path], None], said: str, tiny_native: Path, tmp_path: Path, run, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, out = Path(shutil.copytree(tiny_native, tmp_path / "src")), tmp_path / "out"
    with open_source(src) as source:
        plan = pipeline.plan_source(source, "xpu")
    shard = src / plan.files_needed[-1]  # a file the conversion reads tensor bytes from
    os.utime(shard, ns=(10**18, 10**18))  # set long ago: any rewrite moves the time, however coarse the clock
    at_first_write(monkeypatch, lambda: change(shard))
    code, _, err = run(src, out, "-q")
    assert code == code_of("source_changed") == 36
    assert one_line(err).startswith(
        f"error: {shard}: the source file {said} during the conversion; nothing was published"
    )
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [
        ".out.lock"
    ]  # no partial work kept

    monkeypatch.undo()  # the source settles
    assert run(src, out, "-q")[0] == 0
    settled = tmp_path / "settled"
    convert(Path(shutil.copytree(src, tmp_path / "settled-src")), settled)
    assert files(out).keys() == files(settled).keys()
    assert {k: v for k, v in files(out).items() if k != "conversion.json"} == {
        k: v for k, v in files(settled).items() if k != "conversion.json"
    }


def test_a_source_directory_deleted_mid_run_is_36_and_the_partial_work_is_dropped(
    src: Path, tmp_path: Path, run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: the run re-read the source files' sizes for conversion.json and met the
    deleted directory first: exit 42, its partial directory left behind."""
    out, verify = tmp_path / "out", pipeline._verify

    def deleted_then_verified(*args: object) -> None:
        shutil.rmtree(src)  # every tensor is read and written: only the records and the publish are left
        verify(*args)

    monkeypatch.setattr(pipeline, "_verify", deleted_then_verified)
    code, _, err = run(src, out, "-q")
    assert code == code_of("source_changed") == 36
    assert one_line(err) == (
        f"error: {src / 'config.json'}: the source file was removed during the conversion; nothing was published: "
        "rerun once the source no longer changes"
    )
    assert not out.exists() and siblings(out) == [".out.lock"]  # the partial work dropped


def test_a_run_whose_lock_file_was_removed_stops_before_it_writes_on_or_publishes(
    tiny_native: Path, tmp_path: Path, run, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    at_first_write(monkeypatch, lambda: lock.unlink())  # by hand, mid-run: a second run could now take OUT
    code, _, err = run(tiny_native, out, "-q", "--max-shard-size", "100KB")
    assert code == code_of("output_locked") == 47
    assert (
        one_line(err)
        == f"error: {out}: its lock file {lock} was removed while this run held it, so another run may own OUT; this "
        f"run stopped without publishing"
    )
    assert not out.exists()
    monkeypatch.undo()
    assert run(tiny_native, out, "-q")[0] == 0  # the next owner converts (or resumes) as usual


@pytest.mark.parametrize(
    "shorter", [5, 25]
)  # than the limit: `.NAME.lock` is too long; only the lock owner's temporary file is
def test_an_out_name_its_siblings_cannot_carry_is_42_before_anything_is_created(
    shorter: int, tiny_native: Path, tmp_path: Path, run
) -> None:
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    out = tmp_path / ("o" * (limit - shorter))  # itself a legal name
    code, _, err = run(tiny_native, out, "-q")
    assert code == code_of("write_failed") == 42
    assert one_line(err).startswith(f"error: {out}: the name is too long: this run writes ")
    assert "nothing was changed" in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "shorter", [16, 30]
)  # bytes than the limit: the lock owner's temporary file passes it, or (30) the state's
def test_an_out_whose_siblings_paths_pass_the_path_limit_is_42_naming_out_before_anything_is_created(
    shorter: int, tiny_native: Path, tmp_path: Path, run
) -> None:
    """Issue 28: OUT's own path fits, a file the run writes beside or under it does not. Was:
    exit 1 naming `.OUT.partial/state.json` (the error handler failed on the long path a second
    time), or 42 with a partial directory left."""
    limit = os.pathconf(tmp_path, "PC_PATH_MAX")
    name = "o" * 100
    need = limit - shorter - len(os.fsencode(tmp_path / name))  # bytes of directories to put between
    parent = tmp_path
    while need > 250:  # nested directories: each name is legal, the whole path is not
        parent, need = parent / ("d" * 200), need - 201
    parent = parent / ("d" * (need - 1))
    parent.mkdir(parents=True)
    out = parent / name
    assert len(os.fsencode(out)) == limit - shorter  # itself a legal path
    code, _, err = run(tiny_native, out, "-q")
    assert code == code_of("write_failed") == 42
    assert one_line(err).startswith(f"error: {out}: the path is too long: this run writes '{out.parent}/.{out.name}.")
    assert "nothing was changed" in err and list(parent.iterdir()) == []


def test_the_exit_42_message_is_made_where_the_partial_directory_cannot_be_looked_at(tmp_path: Path) -> None:
    """Its state file's path too long to stat: the message still says what became of OUT."""
    out = tmp_path / ("o" * 200) / ("o" * 200)
    claim = OutputClaim(out, out)
    claim.partial = Path("/" + "p/" * os.pathconf(tmp_path, "PC_PATH_MAX"))  # stat: ENAMETOOLONG
    error = claim.write_failed(OSError(errno.ENOSPC, "No space left on device", str(out)))
    assert str(error) == f"{out}: No space left on device; {out} was not changed"


KILL_IN_A_RECORD = """
import os, signal, sys
from dsv4.convert import pipeline
real = pipeline.write_record
def write_record(path, obj):
    if path.name == "config.json":  # the index's temporary file is renamed; config.json's is left
        tmp = path.with_name(".config.json.0123abcd.tmp")
        tmp.write_text("{")
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, obj)
pipeline.write_record = write_record
pipeline.convert(sys.argv[1], sys.argv[2])
"""


def test_a_temporary_record_file_a_kill_left_is_never_published(tiny_native: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    killed = subprocess.run(
        [sys.executable, "-c", KILL_IN_A_RECORD, str(tiny_native), str(out)], capture_output=True, text=True
    )
    assert killed.returncode == -9, killed.stderr
    assert (tmp_path / ".out.partial" / ".config.json.0123abcd.tmp").exists()
    assert convert(tiny_native, out).status == "resumed"
    assert not any(p.name.startswith(".") for p in out.iterdir())


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


@pytest.mark.slow
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


# A test-only launcher: one Python that has imported the converter (and run it once, so
# every lazy import is done) forks both converter processes of a round; each runs
# `convert-dsv4 ARGS` as the command line would, with its own pid and its own lock, and
# twenty rounds do not pay forty interpreter start-ups. One torch thread keeps the fork
# safe. Each shard write sleeps a little, so a conversion lasts long enough to overlap.
LAUNCHER = """
import json, os, sys, time
import torch
torch.set_num_threads(1)
from dsv4.convert.cli.main import main
from dsv4.convert.pipeline import convert
from dsv4.convert.writer import ShardWriter
from dsv4.convert.exit_codes import code_of

spec = json.loads(sys.argv[1])
convert(*spec["warm_up"])
real_write = ShardWriter.write
def slow_write(self, name, data, at=0):
    time.sleep(spec["write_delay"])
    return real_write(self, name, data, at)
ShardWriter.write = slow_write

def converter(args, log):
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = ["convert-dsv4", *args]
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

rounds = []
for r in spec["rounds"]:
    pids = []
    for k, (delay, args) in enumerate(r["runs"]):
        time.sleep(delay)
        pid = os.fork()
        if pid == 0:
            converter(args, r["logs"][k])
        pids.append(pid)
    rounds.append({"pids": pids, "codes": [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]})
print(json.dumps(rounds))
"""


ROUNDS = 24


STAGGER = [0.0, 0.05, 0.1, 0.2, 0.3, 0.5]  # seconds between the two starts


OWN_FILES = {INDEX_NAME, "config.json", "conversion.json"}


def kinds(a: Path, b: Path) -> list[tuple[str, list[list[str]]]]:
    """What the two processes run, by kind of round."""
    return [
        ("same source, no --wait", [[str(a), "{out}", "-q"], [str(a), "{out}", "-q"]]),
        ("same source, the second waits", [[str(a), "{out}", "-q"], [str(a), "{out}", "-q", "--wait"]]),
        (
            "two sources, both wait and overwrite",
            [[str(a), "{out}", "-q", "--wait", "--overwrite"], [str(b), "{out}", "-q", "--wait", "--overwrite"]],
        ),
    ]


@pytest.mark.slow
def test_two_converters_on_one_out_leave_exactly_one_complete_output(tiny_native: Path, tmp_path: Path) -> None:
    other = write_checkpoint(tmp_path / "other", preset="tiny", main_layers="all", seed=5)
    plan = []
    for k in range(ROUNDS):
        kind, runs = kinds(tiny_native, other)[k % 3]
        out = tmp_path / f"round-{k:02d}" / "out"
        out.parent.mkdir()
        delay = STAGGER[(k // 3) % len(STAGGER)]  # every kind of round meets every stagger
        plan.append(
            {
                "kind": kind,
                "out": out,
                "delay": delay,
                "logs": [str(out.parent / "first.log"), str(out.parent / "second.log")],
                "runs": [[0.0, [a.format(out=out) for a in runs[0]]], [delay, [a.format(out=out) for a in runs[1]]]],
            }
        )
    spec = {
        "warm_up": [str(tiny_native), str(tmp_path / "warm-up")],
        "write_delay": 0.004,
        "rounds": [{"runs": p["runs"], "logs": p["logs"]} for p in plan],
    }
    launched = subprocess.run(
        [sys.executable, "-c", LAUNCHER, json.dumps(spec)], capture_output=True, text=True, timeout=300
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    results = json.loads(launched.stdout)
    host = socket.gethostname()
    refused = waited = 0
    for p, result in zip(plan, results, strict=True):
        out, codes, pids = p["out"], result["codes"], result["pids"]
        logs = [Path(log).read_text() for log in p["logs"]]
        where = (
            f"round {p['out'].parent.name} ({p['kind']}, second started {p['delay']} s later): "
            f"exit codes {codes}, output {logs}"
        )
        # exactly one complete OUT, only the converter's own files, checksums and all
        assert out.is_dir(), where
        shards = set(json.loads((out / INDEX_NAME).read_text())["weight_map"].values())
        assert {e.name for e in out.iterdir()} == OWN_FILES | shards, where
        report = run_checks(out)
        assert report.ok, (where, report.summary())
        assert report.result("checksums").status == "pass", where
        assert sorted(e.name for e in out.parent.iterdir() if e.name.startswith(".out.")) == [".out.lock"], where
        converted = [k for k, log in enumerate(logs) if log.startswith("converted")]
        assert converted, where
        for k in (0, 1):
            code, log, other_pid = codes[k], logs[k], pids[1 - k]
            if code == code_of("output_locked"):
                refused += 1
                assert "--wait" not in p["runs"][k][1], where
                # one line, naming the process that really held OUT
                assert log.count("\n") == 1 and f"locked by another run (pid {other_pid} on host {host}" in log, where
                assert converted == [1 - k], where
            else:
                assert code == 0, where
                assert log.startswith(("converted", f"{out}: already up to date")), where
                waited += "already up to date" in log or (k == 1 and "--wait" in p["runs"][k][1])
        if p["kind"].startswith("two sources"):
            # the later of the two replaced the earlier: OUT is one of them, whole
            record = json.loads((out / "conversion.json").read_text())
            # a local source is recorded by its directory's name, not its path (issue 19 item 8)
            assert record["source"]["location"] in {tiny_native.name, other.name}, where
    assert refused and waited  # both outcomes really happened in these rounds
