"""The ground moving under a run: a source file rewritten or replaced mid-conversion is
refused (exit 36, the file named, nothing published, a rerun converts the settled source);
a lock file removed by hand stops the run that held it before it writes on or publishes
(exit 47); an OUT whose hidden siblings' names would pass the file system's limit is
refused before anything is created (exit 42); a temporary record file a kill left in the
partial directory is never published."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
from inprocess import run_main

from dsv4.convert import pipeline
from dsv4.convert.errors import OutputLockedError, SourceChangedError, WriteFailedError
from dsv4.convert.exit_codes import code_of
from dsv4.convert.location import open_source
from dsv4.convert.pipeline import convert


def files(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    return partial(run_main, monkeypatch, capsys)


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
    assert code == code_of(SourceChangedError) == 36
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


def test_a_run_whose_lock_file_was_removed_stops_before_it_writes_on_or_publishes(
    tiny_native: Path, tmp_path: Path, run, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    at_first_write(monkeypatch, lambda: lock.unlink())  # by hand, mid-run: a second run could now take OUT
    code, _, err = run(tiny_native, out, "-q", "--max-shard-size", "100KB")
    assert code == code_of(OutputLockedError) == 47
    assert (
        one_line(err)
        == f"error: {out}: its lock file {lock} was removed while this run held it, so another run may own OUT; this run stopped without publishing"
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
    assert code == code_of(WriteFailedError) == 42
    assert one_line(err).startswith(f"error: {out}: the name is too long: this run writes ")
    assert "nothing was changed" in err and list(tmp_path.iterdir()) == []


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
