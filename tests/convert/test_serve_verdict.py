"""The overlays' plan read without compressed-tensors (ct_config.provisional), the library's
own reading run beside the conversion (convert/verdict.py): wherever the provisional reading
decides, it decides what the library does; a target the library refuses is refused after the
copy as before it, leaving nothing; a library plan that differs is the one written; and the
converting process never imports the library on those routes."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from inprocess import run_main
from quant_configs import serving_target
from test_schemes_ct import TARGETS
from test_schemes_ct_hostile import HOSTILE

from dsv4.convert import serving
from dsv4.convert.errors import PlanError
from dsv4.convert.inmemory import bundled_plan
from dsv4.convert.plan import Plan
from dsv4.convert.schemes import compressed_tensors, registry
from dsv4.convert.schemes.base import layer_map
from dsv4.convert.serving import OVERRIDES_FILE
from dsv4.convert.synth import write_checkpoint
from dsv4.convert.verdict import summary
from dsv4.model.native import standalone_draft_layout

ERROR = partial(PlanError, kind="quant_carry")
ROUTES = ("auto", "overlay", "bf16", "native", "match-target")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verdict")
    return {v: write_checkpoint(root / v, preset="tiny", variant=v, seed=0) for v in ("instruct", "base", "dspark")}


def both(plan: Plan, qc: Any, route: str) -> tuple[dict[str, Any] | None, dict[str, Any] | str]:
    """(the provisional plan's summary or None, the library's summary or its refusal)."""
    config = {**plan.config, "num_hidden_layers": 43, "quantization_config": qc}
    args = (config, layer_map(plan), standalone_draft_layout(plan.model_config), "t/config.json", ERROR)
    early = registry.provisional_serve_plan(*args, route=route)
    try:
        return (summary(early) if early else None), summary(registry.serve_plan(*args, route=route))
    except PlanError as exc:
        return (summary(early) if early else None), str(exc)


def test_wherever_the_provisional_reading_decides_it_decides_as_the_library(
    sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compressed_tensors, "library_imported", lambda: False)  # as in a fresh `convert-dsv4`
    plans = {variant: bundled_plan(src) for variant, src in sources.items()}
    cases = [(v, name, qc, route) for v in plans for name, qc in TARGETS.items() for route in ROUTES]
    cases += [("instruct", f"hostile-{name}", qc, "overlay") for name, (qc, _, _) in HOSTILE.items()]
    decided, wrong = set(), []
    for variant, name, qc, route in cases:
        early, library = both(plans[variant], qc, route)
        if early is not None:
            decided.add((variant, name, route))
            # a refusal is the library's to make (after the copy); a plan must be the same
            if not isinstance(library, str) and early != library:
                wrong.append((variant, name, route))
    assert not wrong
    assert ("instruct", "hostile-weights-wrong-type", "overlay") in decided  # refused by the library alone
    # the fast path is taken where the routes only rename, widen scales or dequantise ...
    for variant in ("instruct", "base"):
        assert {(variant, "w4a16", r) for r in ("auto", "overlay", "bf16")} <= decided
    assert {("dspark", "w4a16", r) for r in ("auto", "overlay")} <= decided
    # ... and never where the library's arguments decide the tensors, or for another method
    assert not {k for k in decided if k[2] in ("native", "match-target") or k[1] == "modelopt-nvfp4"}


def test_a_target_the_library_refuses_is_refused_after_the_copy_as_before_it_leaving_nothing(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    qc = HOSTILE["weights-wrong-type"][0]  # its groups' targets are plain: the provisional reading decides
    target = tmp_path / "target"
    target.mkdir()
    config = json.loads((sources["instruct"] / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    serve = ("--target", "draft", "--serve-with", target, "--draft-format", "overlay")
    planned = run_main(monkeypatch, capsys, "plan", sources["instruct"], *serve)
    out = tmp_path / "out"
    monkeypatch.setattr(compressed_tensors, "library_imported", lambda: False)  # as in a fresh `convert-dsv4`
    converted = run_main(monkeypatch, capsys, sources["instruct"], out, *serve)
    assert planned[0] == converted[0] != 0 and planned[2] == converted[2]
    assert "weights.num_bits is not valid" in converted[2] and len(converted[2].splitlines()) == 1
    # no OUT, no partial directory: OUT's lock file alone, as a refusal before writing leaves it
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "target"]


def test_a_library_plan_other_than_the_provisional_one_is_the_one_written(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "target"
    target.mkdir()
    config = json.loads((sources["instruct"] / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": serving_target("W4A16", [])}))
    serve = ("--target", "draft", "--serve-with", target, "--draft-format", "overlay", "-q")
    assert run_main(monkeypatch, capsys, sources["instruct"], tmp_path / "want", *serve)[0] == 0
    provisional = serving.provisional_serve_plan

    def wrong(*args: Any, **kwargs: Any) -> Any:  # the bf16 overlay's decisions where overlay is asked
        return provisional(*args, **{**kwargs, "route": "bf16"})

    monkeypatch.setattr(serving, "provisional_serve_plan", wrong)
    monkeypatch.setattr(compressed_tensors, "library_imported", lambda: False)  # as in a fresh `convert-dsv4`
    assert run_main(monkeypatch, capsys, sources["instruct"], tmp_path / "got", *serve)[0] == 0
    files = [p.relative_to(tmp_path / "want") for p in (tmp_path / "want").rglob("*") if p.is_file()]
    for name in files:  # all but those naming OUT's path: conversion.json, serve/commands.sh
        if name.name not in ("conversion.json", "commands.sh"):
            assert (tmp_path / "got" / name).read_bytes() == (tmp_path / "want" / name).read_bytes(), name
    assert OVERRIDES_FILE in map(str, files)


CHILD = """
import sys
from dsv4.convert.cli.main import main
sys.argv = ["convert-dsv4", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
print("\\nIMPORTED", sorted(m for m in ("compressed_tensors", "transformers") if m in sys.modules))
"""


def test_the_converting_process_never_imports_the_library_on_an_overlay_route(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    target = tmp_path / "target"
    target.mkdir()
    config = json.loads((sources["instruct"] / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": serving_target("W4A16", [])}))
    out = tmp_path / "out"
    args = [sources["instruct"], out, "--target", "draft", "--serve-with", target, "--draft-format", "overlay", "-q"]
    done = subprocess.run([sys.executable, "-c", CHILD, *map(str, args)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rsplit("IMPORTED", 1)[1].split() == ["[]"]
    # the library's configs, its presets' arguments in full, are the ones written
    groups = json.loads((out / OVERRIDES_FILE).read_text())["quantization_config"]["config_groups"]
    assert groups["dsv4_draft_linears"]["weights"]["block_structure"] == [128, 128]


def overlay_target(sources: dict[str, Path], where: Path, preset: str = "W4A16") -> Path:
    where.mkdir()
    config = json.loads((sources["instruct"] / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**config, "quantization_config": serving_target(preset, [])}))
    return where


def outputs(out: Path) -> dict[str, bytes]:
    """OUT's files but those naming OUT's own path (conversion.json, serve/commands.sh)."""
    files = (p for p in out.rglob("*") if p.is_file() and p.name not in ("conversion.json", "commands.sh"))
    return {str(p.relative_to(out)): p.read_bytes() for p in files}


def test_a_reply_the_library_gave_is_kept_and_a_later_run_against_the_target_asks_it_no_more(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dsv4.convert import verdict, verdict_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    target = overlay_target(sources, tmp_path / "target")
    serve = ("--target", "draft", "--serve-with", target, "--draft-format", "overlay", "-q")
    monkeypatch.setattr(compressed_tensors, "library_imported", lambda: False)  # as in a fresh `convert-dsv4`
    assert run_main(monkeypatch, capsys, sources["instruct"], tmp_path / "first", *serve)[0] == 0
    (entry,) = (tmp_path / "cache" / "dsv4-convert").glob("verdict-*.json")

    children: list[object] = []
    popen = verdict.subprocess.Popen

    def counted(*args: Any, **kwargs: Any) -> Any:
        children.append(args)
        return popen(*args, **kwargs)

    monkeypatch.setattr(verdict.subprocess, "Popen", counted)
    assert run_main(monkeypatch, capsys, sources["instruct"], tmp_path / "again", *serve)[0] == 0
    assert children == []  # the kept reply was the library's answer
    assert outputs(tmp_path / "again") == outputs(tmp_path / "first")

    # another release of the library is another question: asked again, and kept beside the first
    monkeypatch.setattr(verdict_cache.metadata, "version", lambda name: "0.0.0-other")
    assert run_main(monkeypatch, capsys, sources["instruct"], tmp_path / "other", *serve)[0] == 0
    assert len(children) == 1
    assert entry.exists() and len(list(entry.parent.glob("verdict-*.json"))) == 2


def test_an_edited_kept_reply_is_not_trusted(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    target = overlay_target(sources, tmp_path / "target")
    serve = ("--target", "draft", "--serve-with", target, "--draft-format", "overlay", "-q")
    monkeypatch.setattr(compressed_tensors, "library_imported", lambda: False)
    assert run_main(monkeypatch, capsys, sources["instruct"], tmp_path / "first", *serve)[0] == 0
    (entry,) = (tmp_path / "cache" / "dsv4-convert").glob("verdict-*.json")
    kept = json.loads(entry.read_text())
    groups = kept["reply"]["quantization_config"]["config_groups"]
    groups["dsv4_draft_linears"]["weights"]["block_structure"] = [64, 64]  # edited, its digest not
    entry.write_text(json.dumps(kept))
    assert run_main(monkeypatch, capsys, sources["instruct"], tmp_path / "again", *serve)[0] == 0
    assert outputs(tmp_path / "again") == outputs(tmp_path / "first")  # the library's reply, asked again
    assert json.loads(entry.read_text())["sha256"] == json.loads(json.dumps(kept))["sha256"]  # rewritten whole
    written = json.loads((tmp_path / "again" / OVERRIDES_FILE).read_text())["quantization_config"]
    assert written["config_groups"]["dsv4_draft_linears"]["weights"]["block_structure"] == [128, 128]
