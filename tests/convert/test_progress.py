"""Long work is not silent (issue 19, item 4): on a terminal `check`, `smoke`, `synth` and
`batch` show a bar or a per-step line on stderr; `-q`, HF_HUB_DISABLE_PROGRESS_BARS and a
non-terminal hide it. Bytes are decimal in bars as in summaries (convert/progress.py)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest


def on_a_terminal(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """`convert-dsv4 ARGS` with stderr on a pseudo-terminal: (exit code, what it drew there)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # bars take the terminal's width
    base = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsv4", *args], stdout=subprocess.DEVNULL, stderr=follower, env=base | (env or {})
    )
    os.close(follower)
    drawn = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the command has exited
            break
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    return proc.wait(), drawn.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (lambda pair, tmp: ["check", str(pair[1]), "--fast"], "check: 100%"),
        (lambda pair, tmp: ["smoke", str(pair[1]), "--device", "cpu", "--tokens", "2"], "smoke: loading"),
        (lambda pair, tmp: ["synth", str(tmp / "synth"), "--preset", "tiny"], "synth: 100%"),
    ],
    ids=["check", "smoke", "synth"],
)
def test_long_commands_show_progress_on_a_terminal_unless_hidden(tiny_pair, tmp_path: Path, argv, shown) -> None:
    code, drawn = on_a_terminal(*argv(tiny_pair, tmp_path / "a"))
    assert code == 0 and shown in drawn, drawn
    for hidden, env in ((["-q"], {}), ([], {"HF_HUB_DISABLE_PROGRESS_BARS": "1"})):
        code, drawn = on_a_terminal(*argv(tiny_pair, tmp_path / f"b{len(hidden)}{len(env)}"), *hidden, env=env)
        assert code == 0 and shown not in drawn, drawn


def test_a_bar_counts_bytes_in_decimal_units_like_the_summaries() -> None:
    from tqdm import tqdm

    from dsv4.convert.progress import BYTES

    meter = tqdm.format_meter(5_712_000_000, 5_712_000_000, 1, **BYTES)
    assert "5.71G/5.71G" in meter  # the summary says 5.712 GB; binary units would say 5.32G


@pytest.mark.slow
def test_plan_of_a_hub_repository_counts_its_shard_headers_on_a_terminal_unless_hidden(
    tiny_pair, tmp_path: Path
) -> None:
    # a request per shard, each a round trip to the hub: seconds for Flash's 46 shards
    from hubserver import FakeHub, hub_env

    with FakeHub() as hub:
        hub.commit_dir("org/tiny", tiny_pair[0])
        env = hub_env(hub, tmp_path / "hf")
        code, drawn = on_a_terminal("plan", "org/tiny", env=env)
        assert code == 0 and "shard headers: 100%" in drawn, drawn
        for hidden, extra in ((["-q"], {}), (["--json"], {}), ([], {"HF_HUB_DISABLE_PROGRESS_BARS": "1"})):
            code, drawn = on_a_terminal("plan", "org/tiny", *hidden, env=env | extra)
            assert code == 0 and "shard headers" not in drawn, drawn
        code, drawn = on_a_terminal(
            "plan", str(tiny_pair[0]), env=env
        )  # a local plan reads its headers in well under a second
        assert code == 0 and "shard headers" not in drawn, drawn
