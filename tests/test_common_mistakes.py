"""A newcomer's common mistakes get an answer that names the mistake and the command that
fits (issue 19, item 5): the wrong kind of checkpoint for a command, a mistyped subcommand,
a local directory in a batch manifest. Each is one line on stderr and a documented code."""

from __future__ import annotations

from pathlib import Path

import pytest
from inprocess import run_main


def test_a_converted_checkpoint_given_to_convert_is_named_and_reverse_or_check_suggested(
    tiny_pair, tmp_path, monkeypatch, capsys
):
    converted = tiny_pair[1]
    code, out, err = run_main(monkeypatch, capsys, converted, tmp_path / "again", "--target", "xpu")
    assert code == 35 and err.count("\n") == 1, err  # was 31, "no rule covers it"
    assert (
        err.startswith(f"error: {converted}: is a converted checkpoint")
        and "--reverse" in err
        and f"convert-dsv4 check {converted}" in err
    )
    assert not (tmp_path / "again").exists()


def test_a_native_checkpoint_given_to_reverse_is_named(tiny_native, tmp_path, monkeypatch, capsys):
    code, _, err = run_main(monkeypatch, capsys, tiny_native, tmp_path / "back", "--reverse")
    assert code == 35 and err.count("\n") == 1, err
    assert err.startswith(f"error: {tiny_native}: is a native DeepSeek V4 checkpoint") and "without --reverse" in err


@pytest.mark.parametrize("command", ["smoke", "check"])
def test_a_native_checkpoint_given_to_smoke_or_check_is_named_with_the_command_that_takes_it(
    tiny_native, monkeypatch, capsys, command
):
    code, _, err = run_main(monkeypatch, capsys, command, tiny_native, "--device", "cpu")
    assert code == 35 and err.count("\n") == 1, err  # was 35 "0 draft block(s)" (smoke) and 73 (check)
    assert err.startswith(f"error: {tiny_native}: is a native DeepSeek V4 checkpoint")
    assert (
        f"convert-dsv4 {tiny_native} OUT --target xpu" in err
        and f"convert-dsv4 {command} OUT --native {tiny_native}" in err
    )


def test_a_mistyped_subcommand_is_a_usage_error_with_a_suggestion(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(monkeypatch, capsys, "chekc", "DIR")
    assert code == 2 and out == ""  # was exit 19: a conversion of a directory named chekc
    assert err.startswith("error: No such command 'chekc'. Did you mean 'check'?") and err.count("\n") == 1


def test_a_first_argument_that_exists_is_a_source_even_when_it_looks_like_a_command(tmp_path, monkeypatch, capsys):
    # `convert-dsv4 in out --target xpu` keeps working: an existing path is a source
    monkeypatch.chdir(tmp_path)
    Path("chekc").mkdir()
    code, _, err = run_main(monkeypatch, capsys, "chekc", "out", "--target", "xpu")
    assert code != 2 and "No such command" not in err


def test_batch_says_it_takes_hub_repositories_only(tiny_native, tmp_path, monkeypatch, capsys):
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(f'target = "xpu"\nsources = ["{tiny_native}"]\n\n[output]\ndir = "out"\n')
    code, _, err = run_main(monkeypatch, capsys, "batch", manifest)
    assert code == 64 and err.count("\n") == 1, err
    assert "is a local directory; batch takes hub repositories only" in err
