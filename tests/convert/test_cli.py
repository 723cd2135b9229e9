"""The command line: the shared options (the same name, default and help on every command, JSON
output with rounded numbers); bad input refused with its documented exit code and one line on
stderr, never a Python traceback, whatever escapes included (the last-resort handler); a
newcomer's common mistakes (issue 19, item 5: the wrong kind of checkpoint for a command, a
mistyped subcommand) answered with one line naming the mistake and the command that fits; and
what an output is for made visible (issue 19, item 6: `convert-dsv4 targets` lists the installed
targets and their tables, `--version` and `plan` name the runtime a layout is that of, the
tables' [table] runtime and runtime_class, mapping/*.toml)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import pytest
from inprocess import one_error_line, raising, run_main

from dsv4.convert.cli import main as cli_module
from dsv4.convert.cli.main import cli, echo_json
from dsv4.mapping.errors import TableError


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


# --- the last-resort handler ---------------------------------------------------------------------
def test_an_unexpected_exception_is_one_line_asking_for_a_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("dsv4.convert.pipeline.convert", raising(RuntimeError("the unexpected\nsecond line")))
    monkeypatch.delenv(cli_module.TRACEBACK_ENV, raising=False)
    code, _, err = run_main(monkeypatch, capsys, str(tmp_path / "in"), str(tmp_path / "out"))
    line = one_error_line(err)
    assert code == 1
    assert line.startswith("internal error: RuntimeError: the unexpected (please report")
    assert "DSV4_TRACEBACK=1" in line


def test_the_traceback_env_var_lets_developers_see_the_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dsv4.convert.pipeline.convert", raising(RuntimeError("the unexpected")))
    monkeypatch.setenv(cli_module.TRACEBACK_ENV, "1")
    monkeypatch.setattr(sys, "argv", ["convert-dsv4", str(tmp_path / "in"), str(tmp_path / "out")])
    with pytest.raises(RuntimeError, match="the unexpected"):
        cli_module.main()


def test_an_unclassified_os_error_is_one_line_with_path_and_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        "dsv4.convert.pipeline.convert", raising(PermissionError(13, "Permission denied", "/data/out/.out.partial"))
    )
    monkeypatch.delenv(cli_module.TRACEBACK_ENV, raising=False)
    code, _, err = run_main(monkeypatch, capsys, str(tmp_path / "in"), str(tmp_path / "out"))
    assert (code, one_error_line(err)) == (1, "error: /data/out/.out.partial: Permission denied")


def test_ctrl_c_exits_130_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("dsv4.convert.pipeline.convert", raising(KeyboardInterrupt()))
    code, _, err = run_main(monkeypatch, capsys, str(tmp_path / "in"), str(tmp_path / "out"))
    assert (code, one_error_line(err)) == (130, "interrupted")


def test_an_error_message_quoting_a_newline_stays_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        "dsv4.convert.pipeline.convert", raising(TableError("x.toml: tensor 'a\nb' is odd", kind="malformed_table"))
    )
    code, _, err = run_main(monkeypatch, capsys, str(tmp_path / "in"), str(tmp_path / "out"))
    assert (code, one_error_line(err)) == (20, "error: x.toml: tensor 'a\\nb' is odd")


@pytest.mark.parametrize("command", ["smoke", "check"])
@pytest.mark.parametrize("device", ["nonsense", "cuda:99"])
def test_a_device_this_machine_lacks_is_a_usage_error(
    command: str, device: str, tiny_xpu: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["smoke", str(tiny_xpu)] if command == "smoke" else ["check", str(tiny_xpu), "--smoke"]
    code, out, err = run_main(monkeypatch, capsys, *args, "--device", device)
    line = one_error_line(err)
    assert code == 2 and "'--device'" in line and repr(device) in line
    assert out == ""  # refused before anything ran


def test_no_arguments_prints_the_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(monkeypatch, capsys)
    assert code in (0, 2)  # click 8.1 exits 0 after the help, 8.2+ 2
    assert "convert-dsv4 check OUT" in out + err and "\\n" not in out + err


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


# vLLM 0.33.0's classes for xpu (vllm/models/deepseek_v4/xpu/mtp.py:265, xpu/dspark.py:220); the draft
# tables' runtimes as their [table] sections give them
EXPECTED = [
    {
        "target": "draft",
        "table": "draft",
        "drafter": "mtp",
        "table_version": "1",
        "runtime": "vLLM 0.33.0, SGLang 0.5.23",
        "runtime_class": "vLLM DeepSeekV4MTP (xpu, nvidia, amd); SGLang DeepseekV4ForCausalLMNextN",
        "family": None,
        # the families of its kind the target converts, with the releases serving each one's draft
        "families": {
            "v4-mtp": "vLLM 0.20.0-0.34.0, SGLang 0.5.12-0.5.23",
            "base-mtp": "vLLM 0.20.1-0.34.0, SGLang 0.5.12-0.5.23",
        },
    },
    {
        "target": "draft",
        "table": "draft_dspark",
        "drafter": "dspark",
        "table_version": "1",
        "runtime": "vLLM 0.33.0, SGLang 0.5.23",
        "runtime_class": "vLLM DSparkDeepseekV4ForCausalLM; SGLang DeepseekV4ForCausalLMDSpark",
        "family": None,
        # the families of its kind that no table of their own maps (V4.1 has one)
        "families": {
            "dspark-0731": "vLLM 0.25.0-0.34.0, SGLang 0.5.16-0.5.23",
            "pro-0813": "vLLM 0.33.0, SGLang 0.5.23",
            "vision-exp": "vLLM 0.33.0, SGLang 0.5.23",
        },
    },
    {
        "target": "draft",
        "table": "draft_dspark_v41",
        "drafter": "dspark",
        "table_version": "1",
        "runtime": "vLLM 0.33.0, SGLang 0.5.23",
        "runtime_class": "vLLM DSparkDeepseekV4ForCausalLM (models/deepseek_v41); SGLang DeepseekV4ForCausalLMDSpark",
        "family": "v41-dspark",
        "families": {"v41-dspark": "vLLM 0.33.0, SGLang 0.5.23"},
    },
    {
        "target": "xpu",
        "table": "xpu",
        "drafter": "mtp",
        "table_version": "1",
        "runtime": "vLLM 0.33.0",
        "runtime_class": "DeepSeekV4MTP",
        "family": None,
    },
    {
        "target": "xpu",
        "table": "xpu_dspark",
        "drafter": "dspark",
        "table_version": "1",
        "runtime": "vLLM 0.33.0",
        "runtime_class": "DSparkDeepseekV4ForCausalLM",
        "family": None,
    },
    {
        "target": "xpu",
        "table": "xpu_dspark_v41",
        "drafter": "dspark",
        "table_version": "1",
        "runtime": "vLLM 0.33.0",
        "runtime_class": "the bundled model only: vLLM has no XPU DeepSeek V4.1 model",
        "family": "v41-dspark",
    },
]


def test_targets_lists_each_table_with_its_drafter_version_and_runtime(monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "targets", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == EXPECTED
    code, out, _ = run_main(monkeypatch, capsys, "targets")
    assert code == 0 and out.splitlines() == [
        "draft    draft            drafter mtp     v1    vLLM 0.33.0, SGLang 0.5.23 (vLLM DeepSeekV4MTP (xpu, nvidia, "
        "amd); SGLang DeepseekV4ForCausalLMNextN)",
        "                      v4-mtp          vLLM 0.20.0-0.34.0, SGLang 0.5.12-0.5.23",
        "                      base-mtp        vLLM 0.20.1-0.34.0, SGLang 0.5.12-0.5.23",
        "draft    draft_dspark     drafter dspark  v1    vLLM 0.33.0, SGLang 0.5.23 (vLLM DSparkDeepseekV4ForCausalLM; "
        "SGLang DeepseekV4ForCausalLMDSpark)",
        "                      dspark-0731     vLLM 0.25.0-0.34.0, SGLang 0.5.16-0.5.23",
        "                      pro-0813        vLLM 0.33.0, SGLang 0.5.23",
        "                      vision-exp      vLLM 0.33.0, SGLang 0.5.23",
        "draft    draft_dspark_v41 drafter dspark  v1    vLLM 0.33.0, SGLang 0.5.23 (vLLM DSparkDeepseekV4ForCausalLM "
        "(models/deepseek_v41); SGLang DeepseekV4ForCausalLMDSpark) (family v41-dspark)",
        "                      v41-dspark      vLLM 0.33.0, SGLang 0.5.23",
        "xpu      xpu              drafter mtp     v1    vLLM 0.33.0 (DeepSeekV4MTP)",
        "xpu      xpu_dspark       drafter dspark  v1    vLLM 0.33.0 (DSparkDeepseekV4ForCausalLM)",
        "xpu      xpu_dspark_v41   drafter dspark  v1    vLLM 0.33.0 (the bundled model only: vLLM has no XPU "
        "DeepSeek V4.1 model) (family v41-dspark)",
    ]


def test_version_names_the_runtime_of_each_target(monkeypatch, capsys):
    code, out, _ = run_main(monkeypatch, capsys, "--version")
    assert code == 0 and out.endswith("(target draft: vLLM 0.33.0, SGLang 0.5.23; target xpu: vLLM 0.33.0)\n")


def test_plan_names_the_runtime_and_its_class(tiny_native, monkeypatch, capsys):
    code, out, _ = run_main(monkeypatch, capsys, "plan", tiny_native)
    assert (
        code == 0
        and "  draft layout:         MTP (no dspark_* fields in config.json): vLLM 0.33.0 DeepSeekV4MTP\n" in out
    )
    code, out, _ = run_main(monkeypatch, capsys, "plan", tiny_native, "--json")
    plan = json.loads(out)
    assert (plan["runtime"], plan["runtime_class"]) == ("vLLM 0.33.0", "DeepSeekV4MTP")
