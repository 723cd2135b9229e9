"""The command line's shared options: the same name, default and help on every command, and
JSON output with rounded numbers."""

from __future__ import annotations

import json

import click
import pytest

from dsv4.convert.cli import cli, echo_json


def options(command: click.Command) -> dict[str, click.Option]:
    return {opt: p for p in command.params if isinstance(p, click.Option) for opt in p.opts}


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_every_command_takes_json_and_quiet(name: str) -> None:
    opts = options(cli.commands[name])
    assert {"--json", "-q", "--quiet"} <= set(opts), name


@pytest.mark.parametrize("flag", ["--native", "--device", "--quiet", "--target"])
def test_a_shared_option_means_the_same_everywhere(flag: str) -> None:
    having = {name: options(c)[flag] for name, c in cli.commands.items() if flag in options(c)}
    assert len(having) >= 2, having
    assert len({(o.help, o.default, o.name) for o in having.values()}) == 1, having


def test_device_defaults_to_auto_and_the_native_checkpoint_is_named_native() -> None:
    for name in ("check", "smoke"):
        opts = options(cli.commands[name])
        assert opts["--device"].default == "auto" and "--reference" not in opts


def test_json_output_rounds_floats_to_six_significant_digits(capsys: pytest.CaptureFixture[str]) -> None:
    echo_json({"ms": 12.345678912, "diffs": [0.000123456789, 3.0], "n": 7, "name": "x"})
    assert json.loads(capsys.readouterr().out) == {"ms": 12.3457, "diffs": [0.000123457, 3.0], "n": 7, "name": "x"}
