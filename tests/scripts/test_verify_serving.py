"""verify_runtimes.py --serve-with: vLLM 0.33.0's own compressed-tensors parsing, scheme
choice, create_weights and V4 draft loaders (cut out of the cached wheel, run on CPU) take
a draft beside a compressed-tensors target.

The drafts are tiny `--target draft` outputs rewritten by the routes' tensor-name contract
(tests/scripts/serve_fixtures.py) until the converter writes the routes; the wheels come
from the cache the test command fills (never downloaded here, never skipped).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

# beside this file (pytest puts a test file's directory on sys.path)
import serve_fixtures as sf
import torch
from safetensors.torch import load_file, save_file
from test_verify_runtimes import vr

from dsv4.convert.pipeline import convert
from dsv4.convert.route_load import held_forms
from dsv4.convert.serving import Serving
from dsv4.convert.serving_target import read_serving_target
from dsv4.convert.synth import write_checkpoint
from dsv4.model.checkpoint import Checkpoint
from dsv4.model.errors import LoadError
from tests.quant_configs import serving_target

MTP_LOADERS = ["vllm-nvidia-mtp", "vllm-amd-mtp", "vllm-xpu-mtp"]
DSPARK_LOADERS = ["vllm-nvidia-dspark", "vllm-amd-dspark", "vllm-xpu-dspark"]
LAYER = 2  # the tiny preset's num_hidden_layers: the draft is vLLM's model.layers.2


@pytest.fixture(scope="module")
def wheels() -> Path:
    cache = vr.wheel_cache()
    if not vr.wheels_cached(cache):
        pytest.fail(f"wheels not in {cache}: scripts/test.sh fetches them (verify_runtimes.py --fetch-wheels)")
    return cache


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serving")
    out = {}
    for variant in ("instruct", "base", "dspark"):
        native = write_checkpoint(root / variant / "native", preset="tiny", variant=variant, seed=0)
        convert(native, root / variant / "draft", target="draft")
        out[f"{variant}/native"], out[f"{variant}/draft"] = native, root / variant / "draft"
    out["overlay"] = sf.overlay_draft(out["instruct/draft"], root / "overlay")
    out["bf16"] = sf.bf16_draft(out["instruct/draft"], root / "bf16")
    out["base/overlay"] = sf.overlay_draft(out["base/draft"], root / "base-overlay")
    out["dspark/overlay"] = sf.dspark_overlay_draft(out["dspark/draft"], root / "dspark-overlay")
    return out


def write_json(path: Path, value: dict) -> Path:
    path.write_text(json.dumps(value))
    return path


def serve(
    wheels: Path, draft: Path, native: Path, target: dict, overrides: dict | None, tmp_path: Path, loaders=MTP_LOADERS
):
    target_file = write_json(tmp_path / "target.json", target)
    overrides_file = write_json(tmp_path / "overrides.json", overrides) if overrides else None
    return vr.verify_serving(wheels, draft, target_file, overrides_file, native, loaders)[1]


@pytest.mark.parametrize("preset", list(sf.TARGETS))
def test_the_overlay_draft_loads_exactly_beside_each_target(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path, preset: str
) -> None:
    target = sf.target_config(preset)
    reports = serve(
        wheels, dirs["overlay"], dirs["instruct/native"], target, sf.overlay_overrides(target, LAYER), tmp_path
    )
    assert [r.loader for r in reports] == MTP_LOADERS
    for r in reports:
        assert r.passed, r.summary()
        # 39: the draft layer's parameters less the embedding and head (the target's)
        assert r.filled == r.params == 39
        assert set(r.methods.values()) == {"CompressedTensorsW8A8Fp8", "CompressedTensorsW4A4Mxfp4MoEMethod"}


def test_base_fp8_experts_load_exactly_as_fp8_block_experts(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    target = sf.target_config("W4A16")
    overrides = sf.overlay_overrides(target, LAYER, experts="FP8_BLOCK")
    for r in serve(wheels, dirs["base/overlay"], dirs["base/native"], target, overrides, tmp_path):
        assert r.passed, r.summary()
        assert r.methods[f"model.layers.{LAYER}.ffn.experts"] == "CompressedTensorsW8A8Fp8MoEMethod"


def test_the_bf16_draft_loads_exactly_with_the_draft_layers_ignored(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    target = sf.target_config("NVFP4A16")
    reports = serve(wheels, dirs["bf16"], dirs["instruct/native"], target, sf.bf16_overrides(target, LAYER), tmp_path)
    for r in reports:
        assert r.passed, r.summary()
        assert r.methods[f"model.layers.{LAYER}.attn.wo_a"] == "CompressedTensorsW8A8Fp8"  # XPU reads wo_a as FP8
        assert r.methods[f"model.layers.{LAYER}.ffn.experts"] == "UnquantizedFusedMoEMethod"
        assert r.methods[f"model.layers.{LAYER}.e_proj"] == "UnquantizedLinearMethod"


def test_the_native_draft_beside_a_w4a16_target_fails_in_vllms_loader(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    reports = serve(wheels, dirs["instruct/draft"], dirs["instruct/native"], sf.target_config("W4A16"), None, tmp_path)
    for r in reports:
        assert not r.passed
        assert set(r.methods.values()) == {"CompressedTensorsWNA16", "CompressedTensorsWNA16MoEMethod"}
        # the loader indexes params_dict without a check (nvidia/mtp.py:496, xpu/mtp.py:444)
        assert f"mtp.0.e_proj.weight: KeyError: 'model.layers.{LAYER}.e_proj.weight'" in r.errors
        assert f"model.layers.{LAYER}.e_proj.weight_packed (1 of 1 parts)" in r.unfilled


def test_native_fp4_experts_beside_an_fp8_block_target_load_without_error_but_wrong(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    # RoutedExperts narrows the FP8 parameter to the packed FP4 tensor's half width
    # (_narrow_expert_data_for_padding, routed_experts.py:495-527) and copies the int8
    # codes as numbers: only the value check sees it
    reports = serve(
        wheels, dirs["instruct/draft"], dirs["instruct/native"], sf.target_config("FP8_BLOCK"), None, tmp_path
    )
    experts = f"model.layers.{LAYER}.mtp_block.ffn.experts.routed_experts"
    for r in reports:
        assert not any(e.startswith("mtp.0.ffn.experts.0.w1.weight:") for e in r.errors)
        assert {f"{experts}.w13_weight", f"{experts}.w2_weight"} <= set(r.inexact)


def edited(source: Path, draft: Path) -> tuple[Path, dict]:
    draft.mkdir()
    for f in source.iterdir():
        if f.is_file():  # not a conversion's serve/ folder
            (draft / f.name).write_bytes(f.read_bytes())
    return draft / "model-00001-of-00001.safetensors", load_file(draft / "model-00001-of-00001.safetensors")


def rewrite(shard: Path, tensors: dict) -> None:
    save_file(tensors, shard)
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, shard.name)}
    write_json(shard.parent / "model.safetensors.index.json", index)


def test_a_missing_or_misnamed_unquantised_tensor_fails(dirs: dict[str, Path], wheels: Path, tmp_path: Path) -> None:
    shard, tensors = edited(dirs["overlay"], tmp_path / "edited")
    del tensors["mtp.0.enorm.weight"]
    tensors["mtp.0.hnorm2.weight"] = tensors.pop("mtp.0.hnorm.weight")
    rewrite(shard, tensors)
    target = sf.target_config("W4A16")
    overrides = sf.overlay_overrides(target, LAYER)
    (r,) = serve(wheels, shard.parent, dirs["instruct/native"], target, overrides, tmp_path, ["vllm-nvidia-mtp"])
    assert f"model.layers.{LAYER}.enorm.weight (1 of 1 parts)" in r.unfilled
    assert f"mtp.0.hnorm2.weight: KeyError: 'model.layers.{LAYER}.hnorm2.weight'" in r.errors


def test_a_changed_value_is_reported_not_exact(dirs: dict[str, Path], wheels: Path, tmp_path: Path) -> None:
    shard, tensors = edited(dirs["overlay"], tmp_path / "changed")
    tensors["mtp.0.e_proj.weight_scale"] = tensors["mtp.0.e_proj.weight_scale"] * 2
    packed = tensors["mtp.0.ffn.experts.3.w3.weight_packed"].clone()
    packed[0, 0] ^= 1
    tensors["mtp.0.ffn.experts.3.w3.weight_packed"] = packed
    rewrite(shard, tensors)
    target = sf.target_config("FP8_BLOCK")
    overrides = sf.overlay_overrides(target, LAYER)
    (r,) = serve(wheels, shard.parent, dirs["instruct/native"], target, overrides, tmp_path, ["vllm-nvidia-mtp"])
    assert not r.passed and not r.errors
    assert r.inexact == [
        f"model.layers.{LAYER}.e_proj.weight_scale",
        f"model.layers.{LAYER}.mtp_block.ffn.experts.routed_experts.w13_weight_packed",
    ]


def test_an_expert_group_naming_only_w123_misses_the_xpu_and_amd_experts(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    # XPU and AMD build the routed experts with FusedMoEFactory's default checkpoint names,
    # so compressed-tensors probes experts.0.gate_proj/up_proj/down_proj there
    target = sf.target_config("W4A16")
    overrides = sf.overlay_overrides(target, LAYER)
    overrides["quantization_config"]["config_groups"]["dsv4_mtp_experts"]["targets"] = [
        rf"re:^model\.layers\.{LAYER}\.ffn\.experts\.\d+\.w[123]$"
    ]
    reports = {
        r.loader: r for r in serve(wheels, dirs["overlay"], dirs["instruct/native"], target, overrides, tmp_path)
    }
    experts = f"model.layers.{LAYER}.ffn.experts"
    assert reports["vllm-nvidia-mtp"].passed
    for loader in ("vllm-amd-mtp", "vllm-xpu-mtp"):
        assert reports[loader].methods[experts] == "CompressedTensorsWNA16MoEMethod"
        assert not reports[loader].passed


def test_the_targets_mtp_ignore_entries_reach_the_draft_on_amd_only(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    # compressed-tensors' own MTP carry-over writes re:^mtp.* (it matches no vLLM name);
    # exact mtp.0.* names become model.mtp.0.* (the V4 mapper), re-keyed onto the draft
    # layer by AMD's MTP only (amd/mtp.py:301, quant_config.py:33-57)
    target = sf.target_config("W4A16")
    target["quantization_config"]["ignore"] += ["re:^mtp.*", "mtp.0.e_proj"]
    reports = {
        r.loader: r for r in serve(wheels, dirs["instruct/draft"], dirs["instruct/native"], target, None, tmp_path)
    }
    e_proj, wq_b = f"model.layers.{LAYER}.e_proj", f"model.layers.{LAYER}.attn.wq_b"
    assert reports["vllm-amd-mtp"].methods[e_proj] == "UnquantizedLinearMethod"
    for loader in ("vllm-nvidia-mtp", "vllm-xpu-mtp"):
        assert reports[loader].methods[e_proj] == "CompressedTensorsWNA16"
    assert all(r.methods[wq_b] == "CompressedTensorsWNA16" for r in reports.values())


def test_a_target_transform_must_ignore_the_draft_layer(dirs: dict[str, Path], wheels: Path, tmp_path: Path) -> None:
    target = sf.target_config("W4A16")
    hadamard = {"type": "hadamard", "apply": [{"targets": [r"re:.*\.(wo_b|down_proj)$"], "location": "input"}]}
    target["quantization_config"]["transform_config"] = {"config_groups": {"u": hadamard}}
    overrides = sf.overlay_overrides(target, LAYER)
    (r,) = serve(wheels, dirs["overlay"], dirs["instruct/native"], target, overrides, tmp_path, ["vllm-nvidia-mtp"])
    assert r.passed, r.summary()
    overrides["quantization_config"]["transform_config"] = target["quantization_config"]["transform_config"]
    (r,) = serve(wheels, dirs["overlay"], dirs["instruct/native"], target, overrides, tmp_path, ["vllm-nvidia-mtp"])
    # the draft's weights would have to be rotated: reported as the layer's error (the
    # transform method itself is not built here)
    assert not r.passed
    assert r.methods[f"model.layers.{LAYER}.attn.wo_b"].startswith("TransformOnDraft")
    assert r.methods[f"model.layers.{LAYER}.ffn.shared_experts.down_proj"].startswith("TransformOnDraft")


def test_a_dspark_draft_loads_by_its_own_compressed_tensors_config(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    target = sf.target_config("W4A16")
    (r,) = serve(wheels, dirs["dspark/overlay"], dirs["dspark/native"], target, None, tmp_path, ["vllm-xpu-dspark"])
    assert r.loader == "vllm-xpu-dspark"
    assert r.passed, r.summary()
    assert r.filled == r.params == 96  # 98 less the embedding and head


def test_a_dspark_drafts_config_must_name_vllms_fused_modules(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    # the DSpark class has no packed_modules_mapping (nor a mapper): a group naming the
    # checkpoint's shards (wq_a/wkv, shared_experts.w1/w3/w2) misses fused_wqa_wkv,
    # gate_up_proj and down_proj, which then load unquantised with their scales dropped
    draft = tmp_path / "shards"
    draft.mkdir()
    for f in dirs["dspark/overlay"].iterdir():
        (draft / f.name).write_bytes(f.read_bytes())
    config = json.loads((draft / "config.json").read_text())
    shards = r"re:^model\.(main_proj|layers\.\d+\.(attn\.(wq_a|wkv|wq_b|wo_a|wo_b)|ffn\.shared_experts\.w[123]))$"
    config["quantization_config"]["config_groups"]["dsv4_draft_linear"]["targets"] = [shards]
    write_json(draft / "config.json", config)
    (r,) = serve(wheels, draft, dirs["dspark/native"], sf.target_config("W4A16"), None, tmp_path, ["vllm-xpu-dspark"])
    layer = config["num_hidden_layers"]
    assert r.methods[f"model.layers.{layer}.attn.fused_wqa_wkv"] == "UnquantizedLinearMethod"
    assert r.methods[f"model.layers.{layer}.attn.wq_b"] == "CompressedTensorsW8A8Fp8"
    assert not r.errors and "mtp.0.attn.wq_a.weight_scale" in r.skipped
    assert "model.layers.0.attn.fused_wqa_wkv.weight" in r.inexact


def test_a_native_dspark_draft_beside_a_compressed_tensors_target_loses_its_scales(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    # the draft's fp8 dict parsed as compressed-tensors yields no scheme: bf16 parameters,
    # and the loader drops every scale it has no parameter for without a word (xpu/dspark.py:384-385)
    (r,) = serve(
        wheels,
        dirs["dspark/draft"],
        dirs["dspark/native"],
        sf.target_config("W4A16"),
        None,
        tmp_path,
        ["vllm-xpu-dspark"],
    )
    assert not r.errors and not r.passed
    assert set(r.methods.values()) == {"UnquantizedLinearMethod", "UnquantizedFusedMoEMethod"}
    assert all(t.endswith(".scale") for t in r.skipped) and "mtp.0.attn.wq_a.scale" in r.skipped
    assert "model.layers.0.attn.wq_b.weight" in r.inexact  # FP8 codes copied into bf16, unscaled


def test_sglang_builds_the_draft_by_its_own_config_so_it_takes_the_native_draft_only(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    target = sf.target_config("W4A16")
    (native,) = serve(wheels, dirs["instruct/draft"], dirs["instruct/native"], target, None, tmp_path, ["sglang-nextn"])
    assert native.passed, native.summary()
    assert native.methods == {"draft": "quantization fp8"}  # the draft's config.json, whatever the target
    (overlay,) = serve(wheels, dirs["overlay"], dirs["instruct/native"], target, None, tmp_path, ["sglang-nextn"])
    assert not overlay.passed
    assert "warning: model.decoder.self_attn.wkv.weight_scale not found in params_dict." in overlay.errors


def test_sglang_detects_the_drafts_quantisation_over_the_targets_flag(wheels: Path, dirs: dict[str, Path]) -> None:
    sglang = vr.Wheel(vr.wheel_path(wheels, "sglang"))
    draft = dirs["instruct/draft"]
    # unset, the draft flag takes the target's --quantization (serving_hook.py:684-689); a
    # draft model then keeps its config's method where the two differ (model_config.py:2122-2136),
    # and "unquant" only empties the flag, so the config's fp8 is detected again (:2106-2107)
    for target_flag, draft_flag in ((None, None), ("compressed-tensors", None), ("w8a8_fp8", None), (None, "unquant")):
        assert vr.sglang_draft_quantization(sglang, draft, target_flag, draft_flag) == ("fp8", [])
    assert vr.sglang_draft_quantization(sglang, dirs["dspark/overlay"]) == ("compressed-tensors", [])


def test_the_command_prints_the_table_and_exits_by_the_result(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = write_json(tmp_path / "config.json", sf.target_config("MXFP4A16"))
    overrides = write_json(tmp_path / "overrides.json", sf.overlay_overrides(sf.target_config("MXFP4A16"), LAYER))
    common = ["--serve-with", str(target), "--native", str(dirs["instruct/native"]), "--wheels", str(wheels)]
    assert vr.main([str(dirs["overlay"]), *common, "--overrides", str(overrides), "--loader", "vllm-xpu-mtp"]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row.startswith("| mxfp4-pack-quantized | overrides.json | vllm-xpu-mtp |") and row.endswith(
        "| 0 | 0 | 39/39 | - | yes |"
    )
    assert vr.main([str(dirs["instruct/draft"]), *common, "--loader", "vllm-xpu-mtp"]) == 1
    assert "KeyError" in capsys.readouterr().out
    fp8_target = write_json(tmp_path / "fp8.json", {"quantization_config": {"quant_method": "fp8"}})
    assert (
        vr.main(
            [str(dirs["instruct/draft"]), "--serve-with", str(fp8_target), "--native", str(dirs["instruct/native"])]
        )
        == 2
    )
    assert "--serve-with takes a compressed-tensors or modelopt target" in capsys.readouterr().err


def match_target(root: Path, preset: str) -> dict[str, Path]:
    """The converter's match-target --allow-lossy draft of the tiny instruct checkpoint beside a
    `preset` target (its wo_a in an FP8 block group, as a V4 target's must be): lossy linears and experts."""
    native = write_checkpoint(root / "native", preset="tiny", variant="instruct", seed=0)
    config = json.loads((native / "config.json").read_text())
    target = write_json(root / "target.json", {**config, "quantization_config": serving_target(preset, ["lm_head"])})
    serving = Serving(read_serving_target(target), route="match-target", allow_lossy=True)
    convert(native, root / "draft", target="draft", serving=serving)
    return {"native": native, "draft": root / "draft", "target": target}


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return match_target(tmp_path_factory.mktemp("w4a16"), "W4A16")


def copied(draft: Path, to: Path) -> tuple[Path, dict]:
    shutil.copytree(draft, to)
    return to / "model-00001-of-00001.safetensors", load_file(to / "model-00001-of-00001.safetensors")


def test_a_lossy_match_target_draft_passes_where_its_errors_are_the_recorded_ones(w4a16: dict[str, Path], wheels: Path):
    reports = vr.verify_serving(wheels, w4a16["draft"], w4a16["target"], None, w4a16["native"], MTP_LOADERS)[1]
    record = json.loads((w4a16["draft"] / "conversion.json").read_text())["serve"]["tensors"]
    worst = max(e["max_abs_error"] for e in record.values() if not e["exact"])
    for r in reports:
        assert r.passed, r.summary()
        assert r.filled == r.params == 48 and not r.inexact
        # wo_a (FP8 block) and the norms, hc_*, sink and router are held to the native values; every
        # WNA16 leaf to its record (weight_shape written whole by each shard, the last one kept)
        lossy = {p.rsplit(".", 1)[1] for p in r.lossy}
        assert len(r.lossy) == 27 and lossy == {"weight_packed", "weight_scale", "weight_shape"} | {
            f"w{n}_weight_{leaf}" for n in (13, 2) for leaf in ("packed", "scale", "shape")
        }
        assert f"model.layers.{LAYER}.mtp_block.attn.wo_a.weight_scale" not in {*r.lossy, *r.inexact}
        assert max(e[0] for e in r.lossy.values()) == pytest.approx(worst, rel=1e-6)
    lines = vr.serve_table("pack-quantized", "no overrides", reports)
    assert lines[2].endswith(
        f"| 21/48 | 27/27 ({worst:.4g}, {max(e[1] for e in reports[0].lossy.values()):.4g}) | yes |"
    )


def test_a_lossy_tensor_whose_bytes_or_dtype_changed_fails(w4a16: dict[str, Path], wheels: Path, tmp_path: Path):
    shard, tensors = copied(w4a16["draft"], tmp_path / "changed")
    packed = tensors["mtp.0.e_proj.weight_packed"].clone()
    packed[0, 0] ^= 0x7
    tensors["mtp.0.e_proj.weight_packed"] = packed  # a changed code: loads, but is not the recorded requantisation
    tensors["mtp.0.attn.wq_b.weight_scale"] = tensors["mtp.0.attn.wq_b.weight_scale"].float()  # the loader would cast
    rewrite(shard, tensors)
    (r,) = vr.verify_serving(wheels, shard.parent, w4a16["target"], None, w4a16["native"], ["vllm-nvidia-mtp"])[1]
    assert not r.passed and not r.errors and not r.unfilled
    assert any(o.startswith("mtp.0.e_proj.weight_packed: max_abs_error measured") for o in r.off_record)
    assert r.inexact == [f"model.layers.{LAYER}.mtp_block.attn.wq_b.weight_scale"]


def test_without_the_record_a_lossy_draft_is_held_to_the_native_values(
    w4a16: dict[str, Path], wheels: Path, tmp_path: Path
):
    shard, _ = copied(w4a16["draft"], tmp_path / "unrecorded")
    (shard.parent / "conversion.json").unlink()
    (r,) = vr.verify_serving(wheels, shard.parent, w4a16["target"], None, w4a16["native"], ["vllm-nvidia-mtp"])[1]
    assert not r.passed and not r.lossy
    assert f"model.layers.{LAYER}.e_proj.weight_packed" in r.inexact


@pytest.fixture(scope="module")
def nvfp4a16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return match_target(tmp_path_factory.mktemp("nvfp4a16"), "NVFP4A16")


def test_nvfp4a16_experts_fill_the_input_global_scale_vllm_registers_in_a16_mode(
    nvfp4a16: dict[str, Path], wheels: Path
) -> None:
    # compressed_tensors_moe_w4a4_nvfp4.py:167-185 registers w13/w2_input_global_scale whatever
    # use_a16 says; no A16 backend reads it (oracle/nvfp4.py: Marlin and Humming drop a13_scale,
    # B12X in w4a16 mode takes unit scales), so the converter writes 1.0, exactly
    made = nvfp4a16
    record = json.loads((made["draft"] / "conversion.json").read_text())["serve"]["tensors"]
    unit = record["mtp.0.ffn.experts.0.w1.input_global_scale"]
    assert unit["transform"] == "unit_scale" and unit["exact"] is True
    assert load_file(made["draft"] / "model-00001-of-00001.safetensors")[
        "mtp.0.ffn.experts.5.w2.input_global_scale"
    ].tolist() == [1.0]
    reports = vr.verify_serving(wheels, made["draft"], made["target"], None, made["native"], MTP_LOADERS)[1]
    experts = f"model.layers.{LAYER}.mtp_block.ffn.experts.routed_experts"
    for r in reports:
        assert r.passed, r.summary()
        assert r.filled == r.params == 50 and not r.unfilled
        assert r.methods[f"model.layers.{LAYER}.ffn.experts"] == "CompressedTensorsW4A4Nvfp4MoEMethod"
        # held to the unit value like an exact tensor, not to a record
        for scale in (f"{experts}.w13_input_global_scale", f"{experts}.w2_input_global_scale"):
            assert scale not in r.lossy and scale not in r.inexact
        assert f"{experts}.w13_weight_packed" in r.lossy


def test_only_a_routed_experts_linear_is_held_with_an_input_global_scale(nvfp4a16: dict[str, Path]) -> None:
    checkpoint = Checkpoint(nvfp4a16["draft"])
    found = {n: (t.dtype, t.shape) for n, t in checkpoint.headers.tensors.items()}
    forms = held_forms(checkpoint.model_config, found, "draft")
    assert forms["mtp.0.ffn.experts.0.w1"].name == "nvfp4a16-experts"
    assert forms["mtp.0.ffn.shared_experts.w1"].name == forms["mtp.0.attn.wq_b"].name == "nvfp4a16"
    found["mtp.0.attn.wq_b.input_global_scale"] = ("F32", (1,))
    with pytest.raises(LoadError, match=r"unexpected tensor mtp\.0\.attn\.wq_b\.input_global_scale"):
        held_forms(checkpoint.model_config, found, "draft")


def test_fp4_experts_reblocked_into_fp8_are_held_to_decoding_to_the_native_values(tmp_path: Path, wheels: Path):
    # match-target beside an FP8 block target: the FP4 experts become FP8 blocks (exact, recorded
    # 0.0), bytes no native tensor has: held to their record, so a changed code fails
    made = match_target(tmp_path / "made", "FP8_BLOCK")
    (r,) = vr.verify_serving(wheels, made["draft"], made["target"], None, made["native"], ["vllm-nvidia-mtp"])[1]
    assert r.passed, r.summary()
    assert r.filled == r.params == 39 and not r.lossy and not r.inexact
    shard, tensors = copied(made["draft"], tmp_path / "changed")
    weight = tensors["mtp.0.ffn.experts.2.w2.weight"].view(torch.uint8).clone()
    weight[0, 0] ^= 0x08
    tensors["mtp.0.ffn.experts.2.w2.weight"] = weight.view(torch.float8_e4m3fn)
    rewrite(shard, tensors)
    (r,) = vr.verify_serving(wheels, shard.parent, made["target"], None, made["native"], ["vllm-nvidia-mtp"])[1]
    # caught twice: by value (weight x its per-128x128 scale is no longer the FP4 weight decoded,
    # the two judged together) and against the record (exact, 0.0)
    experts = f"model.layers.{LAYER}.mtp_block.ffn.experts.routed_experts"
    assert not r.passed and r.inexact == [f"{experts}.w2_weight", f"{experts}.w2_weight_scale"]
    assert {o.split(":")[0] for o in r.off_record} == {
        f"mtp.0.ffn.experts.2.w2.{leaf}" for leaf in ("weight", "weight_scale")
    }


def served_conversion(native: Path, qc: dict, out: Path, route: str = "auto") -> tuple[Path, dict]:
    """`convert-dsv4 NATIVE OUT --target draft --serve-with TARGET`, TARGET the native config
    with `qc`: the draft directory and the target's config."""
    target = {**json.loads((native / "config.json").read_text()), "quantization_config": qc}
    target_dir = out.parent / f"{out.name}-target"
    target_dir.mkdir()
    write_json(target_dir / "config.json", target)
    convert(native, out, target="draft", serving=Serving(read_serving_target(target_dir), route))
    return out, target


def test_the_converted_dspark_draft_loads_exactly_in_every_vllm_dspark_class(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    native = dirs["dspark/native"]
    draft, target = served_conversion(native, serving_target("W4A16", ["lm_head"]), tmp_path / "draft")
    reports = {r.loader: r for r in serve(wheels, draft, native, target, None, tmp_path, DSPARK_LOADERS)}
    for r in reports.values():
        assert r.passed, r.summary()
    # 96 in XPU's class; NVIDIA's and AMD's add the confidence head, NVIDIA's context_wkv_proj
    assert {k: r.filled for k, r in reports.items()} == dict(zip(DSPARK_LOADERS, (99, 97, 96), strict=True))
    assert reports["vllm-nvidia-dspark"].methods["model.context_wkv_proj"] == "CompressedTensorsW8A8Fp8"

    # the draft's config as the converter wrote it before it named context_wkv_proj: NVIDIA
    # builds that layer bf16 and its loader indexes params_dict without a check (nvidia/dspark.py:514-518)
    config = json.loads((draft / "config.json").read_text())
    (targets,) = config["quantization_config"]["config_groups"]["dsv4_draft_linears"]["targets"]
    config["quantization_config"]["config_groups"]["dsv4_draft_linears"]["targets"] = [
        targets.replace("|context_wkv_proj", "")
    ]
    write_json(draft / "config.json", config)
    nvidia, xpu = serve(wheels, draft, native, target, None, tmp_path, ["vllm-nvidia-dspark", "vllm-xpu-dspark"])
    assert xpu.passed, xpu.summary()
    assert nvidia.methods["model.context_wkv_proj"] == "UnquantizedLinearMethod"
    assert nvidia.errors == [
        f"mtp.{i}.attn.wkv.weight_scale: KeyError: 'model.context_wkv_proj.weight_scale'" for i in range(3)
    ]
    assert nvidia.inexact == ["model.context_wkv_proj.weight"]  # FP8 codes copied into bf16 as numbers


# a ModelOpt NVFP4 target as its config.json states it (modelopt.py:324-410 reads it)
MODELOPT_NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}


def test_the_converted_draft_loads_exactly_beside_a_modelopt_nvfp4_target(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    native = dirs["instruct/native"]
    draft, target = served_conversion(native, MODELOPT_NVFP4, tmp_path / "draft")
    overrides = json.loads((draft / "serve" / "vllm-hf-overrides.json").read_text())
    reports = serve(wheels, draft, native, target, overrides, tmp_path)
    for r in reports:
        assert r.passed, r.summary()
        # every draft layer excluded: vLLM's unquantised methods, bf16 weights (modelopt.py:243-247;
        # routed_experts.py:236-240 for the experts, whose excluded config returns no method)
        assert set(r.methods.values()) == {"UnquantizedLinearMethod", "UnquantizedFusedMoEMethod"}, r.loader
        assert r.methods[f"model.layers.{LAYER}.attn.wo_a"] == "UnquantizedLinearMethod"
    xpu = reports[-1]
    assert xpu.filled == xpu.params and xpu.params > 0


def test_the_native_draft_beside_a_modelopt_nvfp4_target_without_overrides_fails(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    target = {
        **json.loads((dirs["instruct/native"] / "config.json").read_text()),
        "quantization_config": MODELOPT_NVFP4,
    }
    reports = serve(wheels, dirs["instruct/draft"], dirs["instruct/native"], target, None, tmp_path)
    for r in reports:
        assert not r.passed
        # no draft layer excluded: NVFP4 W4A4 parameters (modelopt.py:2018-2066, 2100-2112, 914-1020)
        assert set(r.methods.values()) == {"ModelOptLinearMethod", "ModelOptNvFp4FusedMoE"}, r.loader
        # the loader renames .scale to .weight_scale_inv (nvidia/mtp.py:419-425), which NVFP4 has not;
        # the FP8 weight meets a packed uint8 one half as wide (linear.py:408-411)
        assert f"mtp.0.e_proj.scale: KeyError: 'model.layers.{LAYER}.e_proj.weight_scale_inv'" in r.errors
        shapes = "of size torch.Size([256, 256])to a parameter of size torch.Size([256, 128])"
        assert f"mtp.0.e_proj.weight: AssertionError: Tried to load weights {shapes}" in r.errors
        assert f"model.layers.{LAYER}.e_proj.input_scale (1 of 1 parts)" in r.unfilled


def test_the_converted_dspark_draft_loads_exactly_beside_a_modelopt_nvfp4_target(
    dirs: dict[str, Path], wheels: Path, tmp_path: Path
) -> None:
    native = dirs["dspark/native"]
    draft, target = served_conversion(native, MODELOPT_NVFP4, tmp_path / "draft")
    # the DSpark draft is built by its own config (dspark/utils.py:115-117): no overrides file
    assert not (draft / "serve" / "vllm-hf-overrides.json").exists()
    for r in serve(wheels, draft, native, target, None, tmp_path, DSPARK_LOADERS):
        assert r.passed, r.summary()
        assert set(r.methods.values()) == {"UnquantizedLinearMethod", "UnquantizedFusedMoEMethod"}, r.loader
