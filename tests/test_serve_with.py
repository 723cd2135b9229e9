"""`check DRAFT --serve-with TARGET`: a draft directory loads in vLLM 0.33.0 only beside a
target whose config builds the same layers, since vLLM builds the draft's layers from the
TARGET's config and quantisation (NOTES.md, "Serving a draft")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4.convert.check import run_checks
from dsv4.convert.pipeline import convert
from dsv4.convert.synth import write_checkpoint
from tests.inprocess import run_main


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve")
    native = write_checkpoint(root / "native", preset="tiny", seed=0)
    convert(native, root / "draft", target="draft")
    return native, root / "draft"


def target_config(tmp_path: Path, native: Path, **changes: object) -> Path:
    config = {**json.loads((native / "config.json").read_text()), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def serve_result(draft: Path, target: Path | None):
    return next(r for r in run_checks(draft, serve_with=target).results if r.name == "serve")


def test_a_draft_serves_beside_the_checkpoint_it_came_from(pair: tuple[Path, Path]) -> None:
    native, draft = pair
    for target in (native, native / "config.json"):
        result = serve_result(draft, target)
        assert result.status == "pass", result.reason


def test_a_differently_quantised_target_fails_naming_the_field(pair: tuple[Path, Path], tmp_path: Path) -> None:
    # a compressed-tensors re-export of the same model: vLLM would build W4A16 layers for FP8 tensors
    native, draft = pair
    target = target_config(
        tmp_path, native, quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized"}
    )
    result = serve_result(draft, target)
    assert (result.status, result.exit_code) == ("fail", 86)
    assert result.error is not None and result.error.fields() == {
        "path": str(target),
        "field": "quantization_config.activation_scheme",
    }
    assert result.reason.startswith(
        f"{target}: quantization_config.activation_scheme is '(absent)', the draft's is 'dynamic'"
    )


def test_another_architecture_fails_naming_the_field(pair: tuple[Path, Path], tmp_path: Path) -> None:
    native, draft = pair
    target = target_config(tmp_path, native, num_hidden_layers=3)
    result = serve_result(draft, target)
    assert (result.status, result.exit_code) == ("fail", 86)
    assert "num_hidden_layers is 3, the draft's is 2" in result.reason


def test_a_target_config_that_is_not_a_json_object_is_named_once(pair: tuple[Path, Path], tmp_path: Path) -> None:
    # config errors carry their file (model/config.py): the reason must not say the path twice
    _, draft = pair
    target = tmp_path / "config.json"
    target.write_text("[]")
    result = serve_result(draft, target)
    assert (result.status, result.exit_code) == ("fail", 86)
    assert result.reason == (
        f"{target}: cannot read the target's config: the top level is [] (a list); expected a JSON object"
    )


def test_not_asked_or_not_a_draft_directory_skips(pair: tuple[Path, Path], tmp_path: Path) -> None:
    native, draft = pair
    assert serve_result(draft, None).status == "skip"
    xpu = tmp_path / "xpu"
    convert(native, xpu)
    result = serve_result(xpu, native)
    assert result.status == "skip" and "only a --target draft output" in result.reason


def test_the_command_exits_86_with_one_line(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    native, draft = pair
    target = target_config(tmp_path, native, expert_dtype="fp8")
    code, _out, err = run_main(monkeypatch, capsys, "check", draft, "--serve-with", target, "-q")
    assert code == 86
    assert err.count("\n") == 1 and "expert_dtype is 'fp8', the draft's is 'fp4'" in err
