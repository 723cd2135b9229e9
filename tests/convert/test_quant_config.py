"""Carrying a compressed-tensors quantization_config through the conversion
(mapping/README.md#quantisation-layer-names): the draft's layers get exactly the schemes their
native parts had, judged layer by layer with compressed-tensors' own matching; what cannot be
carried is refused; and `check` reports a linear that would fail like vLLM issue #44817."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from quant_configs import FP8_BLOCK, FP8_DYNAMIC, INT4_GROUP, REGEX, ct_config, native_with
from torch import nn

from dsv4.convert import quant_config as quant
from dsv4.convert.check.run import run_checks
from dsv4.convert.errors import CheckError, PlanError
from dsv4.convert.exit_codes import code_of, exit_code
from dsv4.convert.pipeline import convert
from dsv4.model.config import ModelConfig
from dsv4.model.mtp import DeepSeekV4MTP, quant_layer_names
from dsv4.model.presets import preset_config

match = pytest.importorskip("compressed_tensors.utils.match")
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402

L, I, E = 2, 0, 8  # tiny: MTP block 0 is decoder layer 2; 8 routed experts
ISSUE_44817 = "Unable to find matching target for  in the compressed-tensors config"


# The same intent through a class target: "Linear" is FP8, the experts' regex (a name match)
# takes precedence over it.
CLASS = ct_config(
    {
        "group_0": (["Linear"], FP8_BLOCK, FP8_DYNAMIC, "float-quantized"),
        "group_1": ([r"re:.*ffn\.experts\.\d+\.w[123]$"], INT4_GROUP, None, "pack-quantized"),
    },
    ["head", r"re:.*ffn\.gate$"],
)


def spec_parts() -> dict[str, list[str]]:
    """Draft quantisation layer -> the native modules it is made of, written out from
    mapping/README.md#mtp-parameters and mapping/README.md#quantisation-layer-names (not derived
    from the table, so the test checks the derivation)."""
    m, d = f"mtp.{I}.", f"model.layers.{L}."
    return {
        "model.embed_tokens": ["embed"],
        f"{d}shared_head.head": ["head"],
        f"{d}e_proj": [f"{m}e_proj"],
        f"{d}h_proj": [f"{m}h_proj"],
        f"{d}attn.fused_wqa_wkv": [f"{m}attn.wq_a", f"{m}attn.wkv"],
        f"{d}attn.wq_b": [f"{m}attn.wq_b"],
        f"{d}attn.wo_a": [f"{m}attn.wo_a"],
        f"{d}attn.wo_b": [f"{m}attn.wo_b"],
        f"{d}ffn.gate": [f"{m}ffn.gate"],
        f"{d}ffn.shared_experts.gate_up_proj": [f"{m}ffn.shared_experts.w1", f"{m}ffn.shared_experts.w3"],
        f"{d}ffn.shared_experts.down_proj": [f"{m}ffn.shared_experts.w2"],
        f"{d}ffn.experts": [f"{m}ffn.experts.{e}.w{k}" for e in range(E) for k in (1, 2, 3)],
    }


def module_for(name: str) -> nn.Module:
    return nn.Embedding(1, 1) if name in ("embed", "model.embed_tokens") else nn.Linear(1, 1)


def assignment(qc: dict[str, Any], names: list[str]) -> dict[str, str | None]:
    """name -> scheme (JSON, targets left out) or None, as compressed-tensors' apply decides:
    ignored when an ignore entry matches, else the first of `match_targets`."""
    parsed = QuantizationConfig.model_validate(qc)
    target_to_scheme = {t: s for s in parsed.config_groups.values() for t in s.targets}
    out: dict[str, str | None] = {}
    for name in names:
        module = module_for(name)
        matched = match.match_targets(name, module, target_to_scheme)
        if match.is_match(name, module, parsed.ignore or []) or not matched:
            out[name] = None
        else:
            out[name] = json.dumps(
                target_to_scheme[matched[0]].model_dump(mode="json", exclude={"targets"}), sort_keys=True
            )
    return out


def config_of(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def regex_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("regex")
    return convert(native_with(tmp, REGEX), tmp / "out").out


@pytest.mark.parametrize("qc", [REGEX, CLASS], ids=["regexes", "class-target"])
def test_rewritten_config_gives_every_layer_the_scheme_its_native_parts_had(tmp_path: Path, qc: dict[str, Any]) -> None:
    out = convert(native_with(tmp_path, qc), tmp_path / "out").out
    draft_qc = config_of(out)["quantization_config"]
    parts = spec_parts()
    native = assignment(qc, [n for ns in parts.values() for n in ns])
    draft = assignment(draft_qc, list(parts))
    for layer, natives in parts.items():
        schemes = {native[n] for n in natives}
        assert len(schemes) == 1, f"{layer}: the source config itself splits its parts"
        assert draft[layer] == schemes.pop(), layer
    # and what that means, spelled out
    d = f"model.layers.{L}."

    def weights(layer: str) -> tuple[str, int]:
        scheme = draft[layer]
        assert scheme is not None, f"{layer} has no scheme"
        w = json.loads(scheme)["weights"]
        return w["type"], w["num_bits"]

    assert weights(f"{d}ffn.experts") == ("int", 4)
    assert (
        weights(f"{d}e_proj")
        == weights(f"{d}attn.fused_wqa_wkv")
        == weights(f"{d}ffn.shared_experts.gate_up_proj")
        == ("float", 8)
    )
    assert draft[f"{d}ffn.gate"] is draft[f"{d}shared_head.head"] is draft["model.embed_tokens"] is None
    assert set(draft_qc["ignore"]) == {f"{d}ffn.gate", f"{d}shared_head.head"}
    assert {k: v for k, v in draft_qc.items() if k not in ("config_groups", "ignore")} == {
        k: v for k, v in qc.items() if k not in ("config_groups", "ignore")
    }


def test_the_layers_compared_are_exactly_the_draft_models_quantisation_layers(draft: DeepSeekV4MTP) -> None:
    assert set(quant_layer_names(draft).values()) == set(spec_parts())


def test_check_resolves_every_linear_of_the_rewritten_config(regex_out: Path) -> None:
    report = run_checks(regex_out, fast=True)
    assert report.ok, report.summary()
    assert report.result("quant").status == "pass"
    assert report.result("quant").details["schemes_checked"] is True


def test_reverse_conversion_restores_the_source_config(regex_out: Path, tmp_path: Path) -> None:
    back = convert(regex_out, tmp_path / "back", reverse=True).out
    assert config_of(back)["quantization_config"] == REGEX


def test_an_fp8_block_config_is_carried_unchanged(tmp_path: Path) -> None:
    native = native_with(tmp_path, None)
    out = convert(native, tmp_path / "out").out
    assert config_of(out)["quantization_config"] == config_of(native)["quantization_config"]
    assert "quantization_config" not in config_of(out)["dsv4_convert"]


def test_a_linear_no_entry_matches_is_ignored_and_recorded(tmp_path: Path) -> None:
    qc = copy.deepcopy(REGEX)
    qc["config_groups"]["group_1"]["targets"].remove(r"re:^mtp\.\d+\.[eh]_proj$")
    out = convert(native_with(tmp_path, qc), tmp_path / "out").out
    config = config_of(out)
    projections = [f"model.layers.{L}.e_proj", f"model.layers.{L}.h_proj"]
    assert set(projections) <= set(config["quantization_config"]["ignore"])
    assert config["dsv4_convert"]["quantization_config"]["added_to_ignore"] == projections
    assert run_checks(out, fast=True).ok


# --- what cannot be carried is refused -------------------------------------------------------
def refuse(tmp_path: Path, qc: dict[str, Any]) -> str:
    out = tmp_path / "out"
    with pytest.raises(PlanError) as err:
        convert(native_with(tmp_path, qc), out)
    assert err.value.kind == "quant_carry"
    assert exit_code(err.value) == 82
    assert not out.exists()
    return str(err.value)


def test_fused_parts_with_different_schemes_are_refused(tmp_path: Path) -> None:
    qc = copy.deepcopy(REGEX)
    qc["ignore"].append(r"re:.*attn\.wkv$")
    said = refuse(tmp_path, qc)
    assert f"model.layers.{L}.attn.fused_wqa_wkv" in said
    assert f"mtp.{I}.attn.wq_a -> group_1" in said and rf"mtp.{I}.attn.wkv -> ignored (via 're:.*attn\\.wkv$')" in said


def test_a_regex_over_some_fused_experts_is_refused(tmp_path: Path) -> None:
    qc = copy.deepcopy(REGEX)
    qc["config_groups"]["group_0"]["targets"] = [r"re:^mtp\.\d+\.ffn\.experts\.[0-3]\.w[123]$"]
    said = refuse(tmp_path, qc)
    assert f"into model.layers.{L}.ffn.experts" in said and r"[0-3]" in said and "no scheme" in said


def test_names_in_a_sparsity_config_are_refused(tmp_path: Path) -> None:
    qc = copy.deepcopy(REGEX)
    qc["sparsity_config"] = {"format": "sparse-24-bitmask", "targets": ["Linear"], "ignore": ["head"]}
    assert "sparsity_config" in refuse(tmp_path, qc)


@pytest.mark.parametrize(
    ("qc", "said"),
    [
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["head"]},
            "modules_to_not_convert lists native module names",
        ),
        (
            {"quant_method": "awq", "bits": 4, "modules_to_not_convert": ["head"]},
            "quant_method 'awq' is not one this converter carries",
        ),
    ],
    ids=["fp8-with-names", "other-method"],
)
def test_configs_whose_names_cannot_be_carried_are_refused(tmp_path: Path, qc: dict[str, Any], said: str) -> None:
    assert said in refuse(tmp_path, qc)


def test_without_the_library_convert_refuses_and_check_skips(
    regex_out: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quant, "compressed_tensors", lambda: None)
    assert "pip install 'dsv4-convert[quant]'" in refuse(tmp_path, REGEX)
    report = run_checks(regex_out, fast=True)
    assert report.ok
    assert (
        report.result("quant").status == "skip" and "compressed-tensors not installed" in report.result("quant").reason
    )


# --- check: what would fail in vLLM ----------------------------------------------------------
@pytest.fixture
def draft() -> DeepSeekV4MTP:
    """The bundled draft for the tiny config, on the meta device (names and classes only)."""
    with torch.device("meta"):
        return DeepSeekV4MTP(ModelConfig.from_dict(preset_config("tiny")))


@pytest.mark.parametrize("unnamed", ["empty prefix", "plain torch Linear"])
def test_an_e_proj_without_a_quantisation_name_is_reported_as_issue_44817(
    regex_out: Path, draft: DeepSeekV4MTP, unnamed: str
) -> None:
    layer = draft.model.layers[str(L)]
    if unnamed == "empty prefix":
        layer.e_proj.quant_name = ""
    else:
        layer.e_proj = nn.Linear(1, 1, device="meta")
    with pytest.raises(CheckError) as err:
        quant.check_draft_quantization(draft, config_of(regex_out), "out/config.json")
    assert err.value.kind == "empty_quant_name"
    assert exit_code(err.value) == 81
    assert f"module model.layers.{L}.e_proj has an empty quantisation layer name: {ISSUE_44817}" in str(err.value)


def test_an_unnamed_linear_that_only_a_class_target_reaches_is_still_reported(draft: DeepSeekV4MTP) -> None:
    draft.model.layers[str(L)].h_proj.quant_name = ""
    with pytest.raises(
        CheckError,
        match=r"h_proj has an empty quantisation layer name: only group_0 \(via 'Linear'\) reaches it",
    ) as raised:
        quant.check_draft_quantization(draft, {"quantization_config": CLASS}, "out/config.json")
    assert raised.value.kind == "empty_quant_name"


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (
            "unmatched",
            f"model.layers.{L}.e_proj: Unable to find matching target for model.layers.{L}.e_proj in the "
            f"compressed-tensors config",
        ),
        ("ambiguous", f"model.layers.{L}.e_proj: matched by targets"),
        ("native names", "matches no layer of the draft"),
    ],
)
def test_check_reports_linears_without_exactly_one_scheme(
    regex_out: Path, tmp_path: Path, edit: str, said: str
) -> None:
    out = Path(shutil.copytree(regex_out, tmp_path / "out"))
    config = config_of(out)
    groups = config["quantization_config"]["config_groups"]
    if edit == "unmatched":
        groups["group_1"]["targets"].remove(f"model.layers.{L}.e_proj")
    elif edit == "ambiguous":
        # compressed-tensors prefers the exact name (group_1), vLLM the first match in config order (group_0)
        groups["group_0"]["targets"].append(rf"re:model\.layers\.{L}\.e_proj$")
    else:
        config["quantization_config"] = REGEX
    (out / "config.json").write_text(json.dumps(config))
    report = run_checks(out, fast=True)
    assert (report.failures[0].name, report.exit_code) == ("quant", code_of("quant_scheme"))
    assert said in report.failures[0].reason


def test_carrying_a_config_builds_no_model_once_the_layers_are_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft's quantisation layers come from the cache beside the layout (model/layout.py
    quant_layers_of), not from a second build of the model on the meta device."""
    native = native_with(tmp_path, REGEX)
    convert(native, tmp_path / "warm")  # fills the cache if this session has not yet

    def no_build(*_: object) -> None:
        raise AssertionError("the draft model was built")

    monkeypatch.setattr(DeepSeekV4MTP, "__init__", no_build)
    out = convert(native, tmp_path / "out").out
    assert config_of(out)["quantization_config"] == config_of(tmp_path / "warm")["quantization_config"]
