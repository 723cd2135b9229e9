"""A serving target's config.json as compressed-tensors itself saves it (ModelCompressor's
update_config, what llm-compressor calls): every field it writes is read, so the converter
serves the re-exports users actually have, not only hand-written configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from inprocess import run_main

from dsv4.convert.synth import write_checkpoint


def saved_by_compressed_tensors(src: Path, target: Path) -> dict:
    """The source's config.json with W4A16 on every Linear, saved by compressed-tensors."""
    target.mkdir()
    (target / "config.json").write_bytes((src / "config.json").read_bytes())
    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.format = "pack-quantized"
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=["lm_head"])
    ModelCompressor(quantization_config=qc).update_config(str(target))
    return json.loads((target / "config.json").read_text())


def test_a_target_saved_by_compressed_tensors_is_served_and_a_pruned_one_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fails before: compressed-tensors 0.20 writes moe_sparsity_config (null where no expert
    was pruned) and every such target was refused (82) as naming a field vLLM does not read."""
    src = write_checkpoint(tmp_path / "src", preset="tiny", seed=0)
    target = tmp_path / "w4a16"
    config = saved_by_compressed_tensors(src, target)
    assert config["quantization_config"]["moe_sparsity_config"] is None  # what the library writes
    code, out, err = run_main(monkeypatch, capsys, "plan", src, "--target", "draft", "--serve-with", target, "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["serve"]["route"] == "overlay"

    # experts pruned per layer: vLLM 0.33.0 builds every layer with the config's expert count
    config["quantization_config"]["moe_sparsity_config"] = {"method": "prune", "num_experts": [None, 4]}
    (target / "config.json").write_text(json.dumps(config))
    code, _, err = run_main(monkeypatch, capsys, "plan", src, "--target", "draft", "--serve-with", target, "-q")
    assert code == 82
    assert err == (
        f"error: {target / 'config.json'}: quantization_config.moe_sparsity_config prunes experts per layer: "
        "vLLM 0.33.0 does not read it\n"
    )
