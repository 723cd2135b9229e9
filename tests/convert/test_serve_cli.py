"""`convert-dsv4 SRC OUT --target draft --serve-with TARGET`: the draft for a serving target,
its config.json, conversion.json's record of the target, OUT/serve/ (launch commands from
mapping/targets/draft.toml, the --hf-overrides file where the route has one), reruns and
--overwrite; `plan --serve-with` (the decision table, headers only) and `check --serve-with`
(the overrides applied to the target first)."""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from edits import tree_digest
from inprocess import run_main
from quant_configs import serving_target

from dsv4.convert import serving
from dsv4.convert.check import serve as check_serve
from dsv4.convert.cli.common import DRAFT_FORMATS
from dsv4.convert.schemes.base import ROUTES, ServePlan
from dsv4.convert.serving import COMMANDS_FILE, OVERRIDES_FILE
from dsv4.convert.sources.local import LocalReader
from dsv4.convert.synth import write_checkpoint

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("serve-cli") / "native", preset="tiny", seed=0)


def target_like(native: Path, where: Path, **fields: Any) -> Path:
    """A re-export of the source model: its config.json with `fields` changed."""
    where.mkdir()
    (where / "config.json").write_text(json.dumps({**json.loads((native / "config.json").read_text()), **fields}))
    return where


def convert_beside(monkeypatch, capsys, native: Path, out: Path, target: Path, *extra: str) -> tuple[int, str, str]:
    return run_main(monkeypatch, capsys, native, out, "--target", "draft", "--serve-with", target, *extra)


def test_draft_formats_are_auto_and_the_routes() -> None:
    assert DRAFT_FORMATS == ("auto", *ROUTES)


def test_a_draft_for_a_deepseek_fp8_target_is_the_native_draft_with_its_launch_commands(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "draft"
    code, stdout, err = convert_beside(monkeypatch, capsys, native, out, native, "-q")
    assert (code, err) == (0, "")
    assert (out / "config.json").read_bytes() == (native / "config.json").read_bytes()  # what it says already
    commands = (out / COMMANDS_FILE).read_text()
    vllm = f'vllm serve {native} --speculative-config \'{{"method":"mtp","model":"{out}","num_speculative_tokens":1}}\''
    sglang = (
        f"python -m sglang.launch_server --model-path {native} --speculative-algorithm NEXTN "
        f"--speculative-draft-model-path {out}"
    )
    # the native draft's commands name its drafter's releases (mapping/targets/draft.toml's
    # [[drafter]] entries), as `plan` does
    assert commands.splitlines()[2:] == [
        "# vLLM 0.20.0-0.34.0 (XPU from 0.23.0, CUDA, ROCm)",
        vllm,
        "",
        "# SGLang 0.5.12-0.5.23",
        sglang,
        "# where the target is launched with an explicit --quantization, add "
        "--speculative-draft-model-quantization fp8",
    ]
    assert stdout.endswith(commands)  # printed at the end of convert
    assert not (out / OVERRIDES_FILE).exists()  # the native route changes no launch
    record = json.loads((out / "conversion.json").read_text())["serve"]
    assert record["target"] == {
        "path": str(native),
        "config_sha256": hashlib.sha256((native / "config.json").read_bytes()).hexdigest(),
    }
    assert (record["route"], record["why"]) == ("native", "auto: a DeepSeek fp8 target serves the native draft")
    assert list(record["files"]) == [COMMANDS_FILE]


def test_a_rerun_is_byte_identical_and_another_target_is_another_output(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "draft"
    assert convert_beside(monkeypatch, capsys, native, out, native, "-q")[0] == 0
    first = tree_digest(out)
    code, stdout, _ = convert_beside(monkeypatch, capsys, native, out, native, "-q")
    assert code == 0 and "already up to date" in stdout and tree_digest(out) == first
    assert convert_beside(monkeypatch, capsys, native, out, native, "--overwrite", "-q")[0] == 0
    assert tree_digest(out) == first  # redone: the same bytes
    other = target_like(native, tmp_path / "requantised", torch_dtype="bfloat16")
    code, _, err = convert_beside(monkeypatch, capsys, native, out, other, "-q")
    assert code == 41 and "pass --overwrite" in err  # not "up to date": the target is part of the output
    assert convert_beside(monkeypatch, capsys, native, out, other, "--overwrite", "-q")[0] == 0
    assert json.loads((out / "conversion.json").read_text())["serve"]["target"]["path"] == str(other)
    assert f"vllm serve {other} " in (out / COMMANDS_FILE).read_text()


def test_without_serve_with_the_draft_has_no_serve_record_and_overwrite_takes_a_served_one(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plain, served = tmp_path / "plain", tmp_path / "served"
    assert run_main(monkeypatch, capsys, native, plain, "--target", "draft", "-q")[0] == 0
    assert not (plain / "serve").exists() and "serve" not in json.loads((plain / "conversion.json").read_text())
    assert convert_beside(monkeypatch, capsys, native, served, native, "-q")[0] == 0
    # the plain draft's files are the served one's but for OUT/serve/ and conversion.json
    assert {k: v for k, v in tree_digest(served).items() if not k.startswith("serve/") and k != "conversion.json"} == {
        k: v for k, v in tree_digest(plain).items() if k != "conversion.json"
    }
    (served / "serve" / "notes.txt").write_text("mine")
    code, _, err = run_main(monkeypatch, capsys, native, served, "--target", "draft", "--overwrite", "-q")
    assert code == 48 and "serve/notes.txt is not a file dsv4-convert wrote" in err
    (served / "serve" / "notes.txt").unlink()
    assert run_main(monkeypatch, capsys, native, served, "--target", "draft", "--overwrite", "-q")[0] == 0
    assert tree_digest(served) == tree_digest(plain) | {"conversion.json": tree_digest(served)["conversion.json"]}


def test_the_serve_files_are_written_before_publish(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An interrupted run leaves nothing that looks complete: OUT/serve/ is written into the
    partial directory with the records, and OUT appears only by the publishing rename."""
    from dsv4.convert.output import OutputClaim

    seen: list[tuple[bool, bool]] = []
    publish = OutputClaim.publish

    def watched(claim: OutputClaim) -> None:
        seen.append(((claim.partial / COMMANDS_FILE).is_file(), claim.path.exists()))
        publish(claim)

    monkeypatch.setattr(OutputClaim, "publish", watched)
    assert convert_beside(monkeypatch, capsys, native, tmp_path / "draft", native, "-q")[0] == 0
    assert seen == [(True, False)]


def test_serve_with_is_refused_for_another_target_and_its_options_without_it(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(monkeypatch, capsys, native, tmp_path / "x", "--target", "xpu", "--serve-with", native)
    assert code == 2 and err.startswith(
        "error: --serve-with makes a draft directory to serve beside a target: it takes"
    )
    code, _, err = run_main(monkeypatch, capsys, "plan", native, "--target", "draft", "--allow-lossy")
    assert code == 2 and err.startswith("error: --draft-format and --allow-lossy choose how a draft serves: they need")
    code, _, err = run_main(
        monkeypatch, capsys, "plan", native, "--target", "draft", "--serve-with", native, "--draft-format", "overlay"
    )
    assert code == 82 and "--draft-format overlay is not a route for a target of quant_method 'fp8'" in err
    assert not (tmp_path / "x").exists()


def test_plan_prints_each_modules_decision_from_the_headers_alone(
    native: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    reads: list[str] = []
    monkeypatch.setattr(LocalReader, "read_into", lambda self, file, offset, buf: reads.append(file))
    code, out, err = run_main(monkeypatch, capsys, "plan", native, "--target", "draft", "--serve-with", native)
    assert (code, err, reads) == (0, "", [])  # no tensor byte read
    lines = out.splitlines()
    assert "  route:                native (auto: a DeepSeek fp8 target serves the native draft)" in lines
    assert "  launch overrides:     none" in lines
    table = {line.split()[0]: line.split()[1:3] for line in lines if line.startswith("  model.")}
    # the tiny model's draft layer is model.layers.2 (num_hidden_layers 2); FP4 experts: 8 x w1, w2, w3 x weight, scale
    assert table["model.layers.2.ffn.experts"] == ["fp4-experts", "48"]
    assert table["model.layers.2.attn.fused_wqa_wkv"] == ["fp8-block", "4"]
    assert table["model.layers.2.ffn.gate"] == ["unquantised", "2"]
    code, out, _ = run_main(monkeypatch, capsys, "plan", native, "--target", "draft", "--serve-with", native, "--json")
    decisions = {d["module"]: d for d in json.loads(out)["serve"]["decisions"]}
    wq_a = next(
        t for t in decisions["model.layers.2.attn.fused_wqa_wkv"]["tensors"] if t["name"].endswith("wq_a.weight")
    )
    assert (wq_a["dtype"], wq_a["transform"], wq_a["exact"]) == ("F8_E4M3", "copy", True)
    assert reads == []


def test_a_dspark_draft_is_served_by_the_dspark_method(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spark = write_checkpoint(tmp_path / "spark", preset="tiny", variant="dspark", seed=0)
    out = tmp_path / "spark-draft"
    assert convert_beside(monkeypatch, capsys, spark, out, spark, "-q")[0] == 0
    commands = (out / COMMANDS_FILE).read_text()
    assert f'vllm serve {spark} --speculative-config \'{{"method":"dspark","model":"{out}"}}\'' in commands
    assert "--speculative-algorithm DSPARK" in commands


def test_the_commands_quote_paths_for_the_shell_and_json(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / 'it\'s a "draft"'
    assert convert_beside(monkeypatch, capsys, native, out, native, "-q")[0] == 0
    vllm = (out / COMMANDS_FILE).read_text().splitlines()[3]
    words = shlex.split(vllm)
    assert words[:4] == ["vllm", "serve", str(native), "--speculative-config"]
    assert json.loads(words[4])["model"] == str(out)


@pytest.fixture
def overlay(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A route that changes the target's launch, as the compressed-tensors entries do: the
    registry's native decisions, with overrides that give the target the draft's own config."""
    decided = serving.serve_plan

    def with_overrides(target_config: dict[str, Any], *args: Any, **kwargs: Any) -> ServePlan:
        kwargs.pop("route", None)  # the stand-in is the overlay whatever route is asked
        native = decided({**target_config, "quantization_config": FP8}, *args, **kwargs)
        return ServePlan("overlay", native.decisions, {"quantization_config": FP8}, FP8, "overlay: a test's route")

    monkeypatch.setattr(serving, "serve_plan", with_overrides)
    monkeypatch.setattr(check_serve, "serve_plan", with_overrides)  # the check re-derives the overrides
    return {"quantization_config": FP8}


def test_a_route_with_overrides_writes_the_hf_overrides_value_and_launches_with_it(
    overlay: dict[str, Any],
    native: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = target_like(native, tmp_path / "ct-target", quantization_config=CT)
    out = tmp_path / "draft"
    assert convert_beside(monkeypatch, capsys, native, out, target, "-q")[0] == 0
    assert json.loads((out / OVERRIDES_FILE).read_text()) == overlay
    commands = (out / COMMANDS_FILE).read_text()
    vllm = commands.splitlines()[3]
    assert vllm.startswith(f'vllm serve {target} --hf-overrides "$(cat {out / OVERRIDES_FILE})" --speculative-config')
    assert "sglang" not in commands  # SGLang's command is the native route's
    assert sorted(json.loads((out / "conversion.json").read_text())["serve"]["files"]) == [
        COMMANDS_FILE,
        OVERRIDES_FILE,
    ]

    # check: the overrides applied to the target's config first, so the draft passes beside it ...
    code, stdout, err = run_main(monkeypatch, capsys, "check", out, "--serve-with", target, "-q", "--json")
    serve = next(r for r in json.loads(stdout)["checks"] if r["name"] == "serve")
    assert (code, serve["status"]) == (0, "pass"), serve
    assert f"(with {out / OVERRIDES_FILE} applied)" in serve["reason"]
    # ... and without them the target builds the draft otherwise
    (out / OVERRIDES_FILE).unlink()
    code, _, err = run_main(monkeypatch, capsys, "check", out, "--serve-with", target, "-q")
    assert code == 86
    assert (
        f"{target / 'config.json'}: quantization_config.activation_scheme is '(absent)', the draft's is 'dynamic'"
        in err
    )


def test_check_refuses_a_native_draft_beside_a_target_that_builds_it_otherwise(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "draft"
    assert convert_beside(monkeypatch, capsys, native, out, native, "-q")[0] == 0
    assert run_main(monkeypatch, capsys, "check", out, "--serve-with", native, "-q")[0] == 0
    unquantised = target_like(native, tmp_path / "bf16-target")
    config = json.loads((unquantised / "config.json").read_text())
    del config["quantization_config"]
    (unquantised / "config.json").write_text(json.dumps(config))
    code, _, err = run_main(monkeypatch, capsys, "check", out, "--serve-with", unquantised, "-q")
    assert code == 86 and err.count("\n") == 1
    assert f"{unquantised / 'config.json'}: quantization_config is '(absent)', the draft's is {{" in err


def test_dry_run_shows_the_decisions_and_writes_nothing(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "draft"
    code, stdout, _ = convert_beside(monkeypatch, capsys, native, out, native, "--dry-run", "--json")
    assert code == 0 and json.loads(stdout)["would"] == "create"
    assert json.loads(stdout)["serve"]["route"] == "native"
    assert list(tmp_path.iterdir()) == []
    assert convert_beside(monkeypatch, capsys, native, out, native, "-q")[0] == 0
    code, stdout, _ = convert_beside(monkeypatch, capsys, native, out, native, "--dry-run", "--json")
    assert json.loads(stdout)["would"] == "up-to-date"


def test_the_drafts_config_says_the_quantisation_the_route_builds_it_with(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A route whose draft has no quantisation config of its own (an unquantised target's):
    config.json is the source's without the field; every other field as the source has it."""
    decided = serving.serve_plan

    def unquantised(*args: Any, **kwargs: Any) -> ServePlan:
        return ServePlan("match-target", decided(*args, **kwargs).decisions, None, None, "match-target: a test's")

    monkeypatch.setattr(serving, "serve_plan", unquantised)
    out = tmp_path / "draft"
    assert convert_beside(monkeypatch, capsys, native, out, native, "-q")[0] == 0
    source = json.loads((native / "config.json").read_text())
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" in source and written == {
        k: v for k, v in source.items() if k != "quantization_config"
    }
    assert "quantization_config" not in json.loads((out / "conversion.json").read_text())["config_fields"]


def test_check_refuses_overrides_made_for_another_target(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM replaces the target's whole quantization_config by the overrides' (config/model.py
    # 555-568): an overlay made for a W4A16 target, launched beside an NVFP4 one, would rebuild
    # the NVFP4 target's own layers as W4A16
    w4a16 = target_like(native, tmp_path / "w4a16", quantization_config=serving_target("W4A16", ["lm_head"]))
    nvfp4 = target_like(native, tmp_path / "nvfp4", quantization_config=serving_target("NVFP4", ["lm_head"]))
    out = tmp_path / "out"
    assert convert_beside(monkeypatch, capsys, native, out, w4a16, "-q")[0] == 0
    assert run_main(monkeypatch, capsys, "check", out, "--serve-with", w4a16)[0] == 0
    code, _, err = run_main(monkeypatch, capsys, "check", out, "--serve-with", nvfp4)
    assert code == 86
    assert f"{out / OVERRIDES_FILE}: quantization_config.config_groups is not what {nvfp4 / 'config.json'}" in err


def test_a_dspark_draft_beside_a_compressed_tensors_target_carries_its_own_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM builds a DSpark draft from the draft's own quantization_config under the target's
    # method (dspark/utils.py:115-117): no launch change, and the native FP8 dict would load
    # FP8 bytes unscaled into bf16 parameters, so check refuses the native draft there
    dspark = write_checkpoint(tmp_path / "dspark", preset="tiny", variant="dspark", seed=0)
    target = target_like(dspark, tmp_path / "w4a16", quantization_config=serving_target("W4A16", ["lm_head"]))
    out, plain = tmp_path / "out", tmp_path / "plain"
    assert convert_beside(monkeypatch, capsys, dspark, out, target, "-q")[0] == 0
    assert not (out / OVERRIDES_FILE).exists()
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    assert run_main(monkeypatch, capsys, "check", out, "--serve-with", target)[0] == 0
    assert run_main(monkeypatch, capsys, dspark, plain, "--target", "draft", "-q")[0] == 0
    code, _, err = run_main(monkeypatch, capsys, "check", plain, "--serve-with", target)
    assert code == 86
    assert "quantization_config.quant_method is 'compressed-tensors', the DSpark draft's is 'fp8'" in err


def test_a_route_that_rewrites_the_draft_names_only_the_runtime_versions_it_was_run_against(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the drafter's release range (vLLM 0.20.0-0.34.0) is its native draft's; the overlay was
    # verified with vLLM 0.33.0's own loaders only
    target = target_like(native, tmp_path / "w4a16", quantization_config=serving_target("W4A16", ["lm_head"]))
    code, stdout, _ = run_main(monkeypatch, capsys, "plan", native, "--target", "draft", "--serve-with", target)
    assert code == 0
    assert "    # vLLM 0.33.0 (XPU from 0.23.0, CUDA, ROCm)" in stdout.splitlines() and "0.20.0" not in stdout
    assert convert_beside(monkeypatch, capsys, native, tmp_path / "out", target, "-q")[0] == 0
    assert "# vLLM 0.33.0 (XPU from 0.23.0, CUDA, ROCm)" in (tmp_path / "out" / COMMANDS_FILE).read_text().splitlines()
    code, stdout, _ = run_main(monkeypatch, capsys, "plan", native, "--target", "draft")
    assert "    # vLLM 0.20.0-0.34.0 (XPU from 0.23.0, CUDA, ROCm)" in stdout.splitlines()
