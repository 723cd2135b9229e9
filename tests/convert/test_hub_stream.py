"""Tensor reads from a hub stream each answer's body into the executor's buffer as it comes
(convert/hf_backend.py's `_stream_into`): no read holds a body whole, which cost an
allocation, a join and a copy per read, twice the CPU per byte of the stream."""

from __future__ import annotations

from pathlib import Path

import pytest
from hubserver import QUICK_RETRIES, FakeHub, Fault, hub_env, on, run_cli

from dsv4.convert.synth import write_checkpoint
from dsv4.model.checkpoint import INDEX_NAME

REPO = "org/tiny"

# httpx's Response.content (a body held whole) refused for every ranged answer but a shard
# header's speculative read, which starts at byte 0 and is small: tensor reads must stream
NO_HELD_TENSOR_BODY = """import httpx2
_content = httpx2.Response.content
def _refuse_held(self):
    if self.status_code == 206 and not self.request.headers.get("Range", "").startswith("bytes=0-"):
        raise RuntimeError("a tensor read held its body whole")
    return _content.fget(self)
httpx2.Response.content = property(_refuse_held)
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny checkpoint and its conversion from disk."""
    root = tmp_path_factory.mktemp("tiny")
    write_checkpoint(root / "src", preset="tiny", main_layers="all", seed=0)
    with FakeHub() as hub:
        r = run_cli(str(root / "src"), str(root / "local"), env=hub_env(hub, root / "hf"))
    assert r.returncode == 0, r.stderr
    return root / "src", root / "local"


def _same_output(out: Path, local: Path) -> None:
    shards = sorted(p.name for p in local.glob("*.safetensors"))
    assert shards
    for name in ("config.json", INDEX_NAME, *shards):
        assert (out / name).read_bytes() == (local / name).read_bytes(), name


def _tensor_read(method: str, repo: str | None, route: str, path: str | None, rng: tuple[int, int] | None) -> bool:
    return on("resolve", ranged=True)(method, repo, route, path, rng) and rng is not None and rng[0] > 0


def test_tensor_reads_stream_into_the_buffer_and_convert_byte_identical(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """Fails before: each tensor read took response.content."""
    src, local = tiny
    with FakeHub() as hub:
        hub.commit_dir(REPO, src)
        r = run_cli(REPO, str(tmp_path / "out"), env=hub_env(hub, tmp_path / "hf"), prelude=NO_HELD_TENSOR_BODY)
        assert r.returncode == 0, r.stderr
        assert any(q.range is not None and q.range[0] > 0 for q in hub.requests)  # tensor reads were made
    _same_output(tmp_path / "out", local)


def test_a_streamed_body_cut_short_is_retried_and_the_output_is_whole(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """A tensor read whose body comes short (Content-Range saying so) is retried, and the
    buffer it half filled is filled whole by the next attempt."""
    src, local = tiny
    with FakeHub() as hub:
        hub.commit_dir(REPO, src)
        hub.faults.append(Fault(_tensor_read, status=None, truncate_to=7, times=2))
        r = run_cli(
            REPO, str(tmp_path / "out"), env=hub_env(hub, tmp_path / "hf"), prelude=QUICK_RETRIES + NO_HELD_TENSOR_BODY
        )
        assert r.returncode == 0, r.stderr
        assert r.stderr.count("warning:") == 2, r.stderr
    _same_output(tmp_path / "out", local)
