"""A match-target draft with lossy tensors records how it agrees with the native draft: the
bundled model run on the written draft and on its local source before publish (top-1 agreement,
logits error) in conversion.json's "serve" -> "agreement", printed by convert, and by smoke
--native and check --native instead of their parity verdict; a hub source records that they
were not measured and why; an exact draft records none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from dirhub import DirHub
from inprocess import run_main
from quant_configs import serving_target

from dsv4.convert.check.run import run_checks
from dsv4.convert.inmemory import match_target_figures
from dsv4.convert.pipeline import plan_served, plan_source, run_plan
from dsv4.convert.serving import Serving
from dsv4.convert.serving_target import read_serving_target
from dsv4.convert.sources.location import open_source
from dsv4.convert.sources.source import HubSpec
from dsv4.convert.synth import write_checkpoint
from dsv4.model.record import CONVERSION_RECORD

REPO = "org/tiny"


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("agreement")
    write_checkpoint(root / REPO, preset="tiny", variant="instruct", seed=0)
    return root


def target(native: Path, where: Path, preset: str) -> Path:
    """A re-export of the source model under a `preset` compressed-tensors config."""
    where.mkdir()
    config = json.loads((native / "config.json").read_text())
    (where / "config.json").write_text(
        json.dumps({**config, "quantization_config": serving_target(preset, ["lm_head"])})
    )
    return where


def serve_record(out: Path) -> dict[str, Any]:
    return json.loads((out / CONVERSION_RECORD).read_text())["serve"]


def test_a_lossy_draft_records_and_prints_its_agreement_with_the_native_source(
    hub_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    native, out = hub_root / REPO, tmp_path / "out"
    w4a16 = target(native, tmp_path / "w4a16", "W4A16")
    args = ("--target", "draft", "--serve-with", w4a16, "--draft-format", "match-target", "--allow-lossy")
    code, stdout, _ = run_main(monkeypatch, capsys, native, out, *args)
    assert code == 0
    recorded = serve_record(out)["agreement"]
    # the published draft's own figures against the native source, measured as `smoke` measures them
    assert recorded == {"measured": True, **match_target_figures(out, native)}
    assert recorded["device"] == "cpu" and recorded["rows"] == 8 and 0 < recorded["logits_rel_rms"] < 0.2
    line = next(line for line in stdout.splitlines() if line.startswith("agreement with the native draft"))
    assert f"top-1 {recorded['top1_agreement']:.3f} over {recorded['rows_compared']} decisive rows of 8" in line
    assert f"rel RMS {recorded['logits_rel_rms']:.4g}" in line
    # smoke --native on it reports the same figures, and does not hold a lossy draft to parity
    code, smoked, _ = run_main(monkeypatch, capsys, "smoke", out, "--native", native, "--device", "cpu")
    assert code == 0 and f"  {line}; a lossy match-target draft, not held to parity" in smoked.splitlines()
    status = {r.name: (r.status, r.reason) for r in run_checks(out, native=native, device="cpu", quiet=True).results}
    assert status["native"] == ("pass", f"{line}; a lossy match-target draft, not held to parity")
    code, stdout, _ = run_main(monkeypatch, capsys, native, out, *args, "--json")  # up to date: as recorded
    printed = json.loads(stdout)["agreement"]  # --json rounds floats
    assert code == 0 and printed.keys() == recorded.keys()
    assert all(printed[k] == (pytest.approx(v, rel=1e-5) if isinstance(v, float) else v) for k, v in recorded.items())


def test_an_exact_draft_records_no_agreement(hub_root: Path, tmp_path: Path) -> None:
    native, out = hub_root / REPO, tmp_path / "out"
    # FP8 block linears keep their bytes, FP4 experts re-blocked into FP8 exactly: nothing lossy
    serving = Serving(read_serving_target(target(native, tmp_path / "fp8", "FP8_BLOCK")), route="match-target")
    with open_source(native) as source:
        plan, served = plan_served(source, plan_source(source, "draft"), serving)
        run_plan(plan, source, out, served=served)
    record = serve_record(out)
    assert record["tensors"] and all(e["exact"] for e in record["tensors"].values())
    assert "agreement" not in record


def test_a_hub_source_records_that_the_agreement_was_not_measured(hub_root: Path, tmp_path: Path) -> None:
    serving = Serving(read_serving_target(target(hub_root / REPO, tmp_path / "w4a16", "W4A16")), "match-target", True)
    with open_source(HubSpec(REPO, None), backend=DirHub(hub_root)) as source:
        plan, served = plan_served(source, plan_source(source, "draft"), serving)
        run_plan(plan, source, tmp_path / "out", served=served)
    agreement = serve_record(tmp_path / "out")["agreement"]
    assert agreement["measured"] is False and "smoke OUT --native SRC" in agreement["why"]


@pytest.mark.parametrize(
    ("figure", "whose"), [("logits_rel_rms", "lossy draft's"), ("logits_max_abs", "native draft's")]
)
def test_a_lossy_draft_whose_logits_are_not_finite_is_refused_and_not_published(
    hub_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    figure: str,
    whose: str,
) -> None:
    """A NaN in the agreement run (here put there by the measurement, which a broken requantisation
    would do) is exit 38's one line naming whose logits, and OUT is not published."""
    import dsv4.convert.inmemory as inmemory

    measured = inmemory.match_target_figures
    monkeypatch.setattr(inmemory, "match_target_figures", lambda *a, **k: {**measured(*a, **k), figure: float("nan")})
    native, out = hub_root / REPO, tmp_path / "out"
    w4a16 = target(native, tmp_path / "w4a16", "W4A16")
    args = ("--target", "draft", "--serve-with", w4a16, "--draft-format", "match-target", "--allow-lossy")
    code, _, stderr = run_main(monkeypatch, capsys, native, out, *args)
    assert code == 38
    (line,) = [x for x in stderr.splitlines() if x.strip()]
    assert f"{whose} logits on smoke's seeded inputs are not finite ({figure} nan)" in line
    assert "Traceback" not in stderr
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".out.lock", "w4a16"]  # no OUT, no partial directory to resume: only the lock file
