"""`plan` and `check` name the drafter family a checkpoint holds (mapping/drafters.py), how each
runtime serves it and which releases do (mapping/targets/draft.toml [[drafter]]); a family no
target converts yet, and a checkpoint without draft layers, are refused in one line before any
tensor byte is read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from inprocess import run_main
from safetensors.torch import load_file, save_file

from dsv4.convert.sources.local import LocalReader
from dsv4.convert.synth import write_checkpoint
from dsv4.mapping.drafters import NO_DRAFTER, identify_drafter
from dsv4.mapping.errors import TableError
from dsv4.mapping.targets import LAYOUT_KINDS, _target_file, drafter_families
from dsv4.model.checkpoint import INDEX_NAME
from dsv4.model.presets import preset_config

NATIVE_BLOCK = LAYOUT_KINDS["native"].block


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _write_config(path: Path, config: dict) -> Path:
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def _sibling(source: Path, out: Path, config: dict) -> Path:
    """`source`'s shards (hard links: nothing is copied) under another config.json."""
    out.mkdir()
    for f in source.iterdir():
        if f.name != "config.json":
            (out / f.name).hardlink_to(f)
    return _write_config(out, config)


def _reexport(native: Path, out: Path) -> Path:
    """What llm-compressor or mlx writes: the main model re-quantised, the drafter (mtp.*) dropped."""
    out.mkdir()
    tensors = {}
    for shard in sorted(native.glob("*.safetensors")):
        tensors |= {k: v for k, v in load_file(shard).items() if not k.startswith("mtp.")}
    save_file(tensors, out / "model.safetensors")
    config = _config(native)
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    return _write_config(out, config)


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per family (Vision-Exp's and V4.1's differ from tiny DSpark in config.json
    alone: identification reads nothing else; Pro-0813's is the tiny-pro preset's)."""
    root = tmp_path_factory.mktemp("families")
    out = {v: write_checkpoint(root / v, preset="tiny", variant=v) for v in ("instruct", "base", "dspark")}
    dspark = _config(out["dspark"])
    out["vision"] = _sibling(out["dspark"], root / "vision", {**dspark, "vision_n_layers": 2})
    out["v41"] = write_checkpoint(root / "v41", preset="tiny", variant="v41")
    out["pro"] = write_checkpoint(root / "pro", preset="tiny-pro", variant="dspark")
    out["reexport"] = _reexport(out["instruct"], root / "reexport")
    return out


@pytest.fixture(scope="module")
def dspark_draft(families: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DSpark checkpoint converted --target draft."""
    from dsv4.convert.pipeline import convert

    return convert(families["dspark"], tmp_path_factory.mktemp("draft") / "out", target="draft").out


SERVED = [
    # (checkpoint, family, its title, vLLM releases and platforms, vLLM's method, SGLang releases, its algorithm)
    (
        "instruct",
        "v4-mtp",
        "DeepSeek V4 MTP (FP4 experts)",
        "vLLM 0.20.0-0.34.0 (XPU from 0.23.0, CUDA, ROCm)",
        '"method":"mtp"',
        "SGLang 0.5.12-0.5.23",
        "NEXTN",
    ),
    (
        "base",
        "base-mtp",
        "DeepSeek V4 Base MTP (FP8 experts)",
        "vLLM 0.20.1-0.34.0 (XPU from 0.23.0, CUDA, ROCm)",
        '"method":"mtp"',
        "SGLang 0.5.12-0.5.23",
        "NEXTN",
    ),
    (
        "dspark",
        "dspark-0731",
        "DeepSeek V4-Flash-0731-style DSpark",
        "vLLM 0.25.0-0.34.0 (XPU from 0.26.0, CUDA, ROCm from 0.26.0)",
        '"method":"dspark"',
        "SGLang 0.5.16-0.5.23",
        "DSPARK",
    ),
    # no release range: only the versions this tool's loaders ran against (mapping/targets/draft.toml)
    (
        "pro",
        "pro-0813",
        "DeepSeek V4-Pro-0813 DSpark (on V4-Pro's main model)",
        "vLLM 0.33.0 (XPU, CUDA, ROCm)",
        '"method":"dspark"',
        "SGLang 0.5.23",
        "DSPARK",
    ),
]


@pytest.mark.parametrize(("name", "family", "title", "vllm", "method", "sglang", "algorithm"), SERVED)
def test_plan_names_the_drafter_and_how_each_runtime_serves_it(
    families, name, family, title, vllm, method, sglang, algorithm, monkeypatch, capsys
) -> None:
    code, out, err = run_main(monkeypatch, capsys, "plan", families[name], "--target", "draft")
    assert code == 0, err
    lines = out.splitlines()
    at = lines.index(f"  drafter:              {title}")
    assert lines[at + 1 : at + 6] == [
        "  serve OUT beside TARGET, the model it drafts for:",
        f"    # {vllm}",
        lines[at + 3],
        f"    # {sglang}",
        f"    python -m sglang.launch_server --model-path TARGET --speculative-algorithm {algorithm} "
        "--speculative-draft-model-path OUT",
    ]
    assert lines[at + 3].startswith("    vllm serve TARGET --speculative-config '{" + method + ',"model":"OUT"')
    # the default target, a layout no runtime loads from disk, names the drafter alone
    code, out, _ = run_main(monkeypatch, capsys, "plan", families[name])
    assert code == 0 and f"  drafter:              {title}\n" in out and "serve OUT" not in out
    code, out, _ = run_main(monkeypatch, capsys, "plan", families[name], "--json")
    assert code == 0 and json.loads(out)["drafter_family"] == family


REFUSED = [
    # (checkpoint, target, the family's title, what the line says is missing)
    (
        "vision",
        "xpu",
        "DeepSeek V4-Flash-Vision-Exp DSpark",
        "its XPU DSpark router has no bias_vl; --target draft serves it",
    ),
    (
        "v41",
        "xpu",
        "DeepSeek V4.1 DSpark",
        "vLLM 0.33.0 has no XPU model for DeepSeek V4.1 (models/deepseek_v41/ has nvidia/ and amd/ only); --target "
        "draft serves it",
    ),
]


@pytest.mark.parametrize(("name", "target", "title", "missing"), REFUSED)
def test_a_recognised_drafter_no_table_converts_yet_is_named_and_refused_in_one_line(
    families, name, target, title, missing, monkeypatch, capsys
) -> None:
    code, out, err = run_main(monkeypatch, capsys, "plan", families[name], "--target", target)
    assert (code, out) == (35, "")
    assert err.count("\n") == 1 and f"holds a {title}" in err and f"--target {target} does not convert: " in err
    assert missing in err


def test_a_reexport_without_mtp_is_refused_before_any_tensor_byte_is_read(families, tmp_path, monkeypatch, capsys):
    reexport = families["reexport"]

    def no_tensor_bytes(*args: object) -> None:
        raise AssertionError("a tensor byte was read")

    monkeypatch.setattr(LocalReader, "read_into", no_tensor_bytes)
    monkeypatch.setattr(LocalReader, "read_view", no_tensor_bytes)
    code, out, err = run_main(monkeypatch, capsys, "convert", reexport, tmp_path / "out", "--target", "draft")
    assert (code, out) == (35, "") and err.count("\n") == 1, err
    assert "holds no draft layers (no mtp.* tensor)" in err
    assert f"convert-dsv4 ORIGINAL OUT --target draft --serve-with {reexport}" in err
    assert not (tmp_path / "out").exists()
    # what was read: config.json and the one shard's header (its 8-byte length and the JSON), no more
    from dsv4.convert.sources.inventory import read_inventory

    shard = (reexport / "model.safetensors").read_bytes()
    assert read_inventory(reexport).header_bytes == 8 + struct.unpack("<Q", shard[:8])[0]
    assert not (reexport / INDEX_NAME).exists()


def test_check_names_the_drafter_of_a_draft_directory(dspark_draft, monkeypatch, capsys) -> None:
    out = dspark_draft
    code, text, err = run_main(monkeypatch, capsys, "check", out, "--fast")
    assert code == 0, err
    assert "  drafter:              DeepSeek V4-Flash-0731-style DSpark\n" in text
    assert f"  serve {out} beside TARGET, the model it drafts for:\n" in text
    assert f"""--speculative-config '{{"method":"dspark","model":"{out}"}}'""" in text
    code, text, _ = run_main(monkeypatch, capsys, "check", out, "--fast", "--json")
    assert json.loads(text)["drafter_family"] == "dspark-0731"


def test_check_refuses_a_draft_beside_a_target_vllm_would_build_another_drafter_for(
    families, dspark_draft, tmp_path, monkeypatch, capsys
) -> None:
    """A 0731 DSpark draft beside a Vision-Exp target: every field vLLM builds the draft from agrees
    but the vision tower, which gives every stage a gate.bias_vl the 0731 draft lacks."""
    target = _write_config(tmp_path, {**_config(families["dspark"]), "vision_n_layers": 2}) / "config.json"
    code, text, _ = run_main(monkeypatch, capsys, "check", dspark_draft, "--fast", "--serve-with", target)
    assert code == 86
    (line,) = [line for line in text.splitlines() if line.startswith("  FAIL serve")]
    assert f"{target}: vision_n_layers is 2, the draft's is '(absent)': vLLM 0.33.0 builds the draft's layers" in line
    # beside the checkpoint it was converted from, the serve check passes
    code, text, err = run_main(monkeypatch, capsys, "check", dspark_draft, "--fast", "--serve-with", families["dspark"])
    assert code == 0, text + err


def test_a_vision_exp_draft_keeps_every_stage_s_bias_vl_and_skips_the_vision_tower(tmp_path, monkeypatch, capsys):
    from dsv4.convert.pipeline import convert
    from dsv4.convert.sources.inventory import read_inventory

    source = write_checkpoint(tmp_path / "vision", preset="tiny", variant="vision")
    result = convert(source, tmp_path / "draft", target="draft")
    out = read_inventory(result.out)
    kept = sorted(n for n in out.tensors if n.endswith(".ffn.gate.bias_vl"))
    assert kept == [f"mtp.{s}.ffn.gate.bias_vl" for s in range(3)]
    src = load_file(source / read_inventory(source).tensors[kept[0]].file)[kept[0]]
    assert load_file(result.out / out.tensors[kept[0]].file)[kept[0]].equal(src)
    assert not [n for n in out.tensors if n.startswith(("vision.", "aligner.", "image_"))]
    assert (result.out / "config.json").read_bytes() == (source / "config.json").read_bytes()
    assert {result.plan.skipped[n].split(":")[0] for n in ("vision.patch_embed.weight", "aligner.proj.weight")} == {
        "V4-Flash-Vision-Exp's vision encoder",
        "V4-Flash-Vision-Exp's vision aligner",
    }
    code, text, err = run_main(monkeypatch, capsys, "check", result.out, "--fast")
    assert code == 0, text + err
    assert "  drafter:              DeepSeek V4-Flash-Vision-Exp DSpark (ffn.gate.bias_vl per stage)\n" in text
    assert "    # vLLM 0.33.0 (CUDA, ROCm)\n" in text  # no XPU: the vision target is a stub there


def test_a_vision_exp_checkpoint_without_a_stage_s_bias_vl_is_refused_naming_it(families, monkeypatch, capsys):
    """Completeness is the converter's: vLLM would leave the parameter uninitialised, saying nothing."""
    code, _, err = run_main(monkeypatch, capsys, "plan", families["vision"], "--target", "draft")
    assert code == 32 and err.count("\n") == 1  # missing_source
    assert "mtp.0.ffn.gate.bias_vl: its source tensor mtp.0.ffn.gate.bias_vl is not in the checkpoint" in err


def test_a_bias_vl_beside_a_config_without_a_vision_tower_is_refused(tmp_path, monkeypatch, capsys):
    source = write_checkpoint(tmp_path / "vision", preset="tiny", variant="vision")
    config = _config(source)
    del config["vision_n_layers"]
    _write_config(source, config)
    code, _, err = run_main(monkeypatch, capsys, "plan", source, "--target", "draft")
    assert code == 33 and err.count("\n") == 1  # layout_mismatch: the conversion would drop it
    assert "tensor mtp.0.ffn.gate.bias_vl: not a tensor of the draft layout for this config.json" in err


def test_each_family_is_told_apart_from_its_config_and_names() -> None:
    dspark = preset_config("tiny", "dspark")
    names = ["mtp.0.main_proj.weight", "mtp.0.ffn.gate.weight"]
    assert identify_drafter(preset_config("tiny"), names, NATIVE_BLOCK) == "v4-mtp"
    assert identify_drafter(preset_config("tiny", "base"), names, NATIVE_BLOCK) == "base-mtp"
    assert identify_drafter({**preset_config("tiny"), "expert_dtype": None}, names, NATIVE_BLOCK) == "v4-mtp"
    assert identify_drafter(dspark, names, NATIVE_BLOCK) == "dspark-0731"
    # Vision-Exp by its config, or by a vision tensor where the config says nothing of a tower
    assert identify_drafter({**dspark, "vision_n_layers": 32}, names, NATIVE_BLOCK) == "vision-exp"
    assert identify_drafter(dspark, [*names, "mtp.2.ffn.gate.bias_vl"], NATIVE_BLOCK) == "vision-exp"
    assert identify_drafter(dspark, [*names, "aligner.proj.weight"], NATIVE_BLOCK) == "vision-exp"
    assert identify_drafter({**dspark, "vision_n_layers": 0}, names, NATIVE_BLOCK) == "dspark-0731"
    assert identify_drafter({"model_type": "deepseek_v41", "text_config": {}}, names, NATIVE_BLOCK) == "v41-dspark"
    # Pro-0813 by its main model, V4-Pro's (its first two layers compressed at 128), at any size
    assert identify_drafter(preset_config("pro", "dspark"), names, NATIVE_BLOCK) == "pro-0813"
    assert identify_drafter(preset_config("tiny-pro", "dspark"), names, NATIVE_BLOCK) == "pro-0813"
    assert identify_drafter(preset_config("flash", "dspark"), names, NATIVE_BLOCK) == "dspark-0731"
    assert identify_drafter(preset_config("pro"), names, NATIVE_BLOCK) == "v4-mtp"  # V4-Pro's own MTP drafter
    # neither Pro-0813's stage placement nor its Markov rank makes a drafter on Flash's main model Pro's
    flash_0731 = preset_config("flash", "dspark")
    on_flash = {**flash_0731, "dspark_markov_rank": 512, "dspark_target_layer_ids": [40, 41, 42]}
    assert identify_drafter(on_flash, names, NATIVE_BLOCK) == "dspark-0731"
    assert identify_drafter({**preset_config("tiny-pro", "dspark"), "vision_n_layers": 2}, names, NATIVE_BLOCK) == (
        "vision-exp"
    )
    for ratios in ("128, 128", None, [128]):  # malformed or short: the config loader judges it, after
        assert identify_drafter({**dspark, "compress_ratios": ratios}, names, NATIVE_BLOCK) == "dspark-0731"
    # no draft block under the layout's names: none, whatever the config says
    assert identify_drafter(dspark, ["layers.0.attn.wkv.weight", "embed.weight"], NATIVE_BLOCK) == NO_DRAFTER
    assert identify_drafter({"model_type": "llama"}, names, NATIVE_BLOCK) is None
    # in the bundled layout's names (a reverse plan, check of an --target xpu output)
    assert identify_drafter(dspark, ["model.layers.0.attn.wkv.weight"], LAYOUT_KINDS["bundled"].block) == "dspark-0731"
    # every family identification names is in the registry, with its serve commands' kind
    assert set(drafter_families()[1]) == {"v4-mtp", "base-mtp", "dspark-0731", "pro-0813", "vision-exp", "v41-dspark"}


def test_a_tiny_pro_0813_converts_to_each_target_and_checks_against_the_reference(
    families, tmp_path, monkeypatch, capsys
) -> None:
    """Pro-0813 in Pro-0813's shape (stages on the last three of more layers, its own Markov rank,
    more heads, groups and experts than tiny): the draft keeps every mtp.* tensor and runs in the
    bundled model as the independent reference does; the xpu output is the DSpark XPU model's 98
    parameters, each of the shape its layout gives at these dimensions."""
    from dsv4.convert.pipeline import convert
    from dsv4.convert.sources.inventory import read_inventory

    source = families["pro"]
    draft = convert(source, tmp_path / "draft", target="draft").out
    native = read_inventory(source).tensors
    assert set(read_inventory(draft).tensors) == {n for n in native if n.startswith("mtp.")} | {
        "embed.weight",
        "head.weight",
    }
    assert (draft / "config.json").read_bytes() == (source / "config.json").read_bytes()
    code, text, err = run_main(monkeypatch, capsys, "check", draft, "--native", source)
    assert code == 0, text + err
    assert "  drafter:              DeepSeek V4-Pro-0813 DSpark (on V4-Pro's main model)\n" in text
    assert "  PASS native " in text and "top-1 agreement 1.000" in text
    xpu = convert(source, tmp_path / "xpu", target="xpu").out
    assert len(read_inventory(xpu).tensors) == 98
    code, text, err = run_main(monkeypatch, capsys, "check", xpu, "--fast")
    assert code == 0, text + err
    assert "  PASS layout " in text and "DSpark stage layer(s) [0, 1, 2]" in text
    assert "  drafter:              DeepSeek V4-Pro-0813 DSpark (on V4-Pro's main model)\n" in text


@pytest.mark.parametrize(
    "entry",
    [
        'name = "x"\ntitle = "X"\nkind = "eagle"',  # a kind with no table or serve command
        'name = "x"\ntitle = "X"\nkind = "mtp"\nsince = { TensorRT = "1.0" }',  # a runtime the target has not
        'name = "x"\ntitle = "X"\nkind = "mtp"\nuntil = { vLLM = 34 }',  # a release that is no string
        'name = "x"\nkind = "mtp"',  # no title
    ],
)
def test_a_malformed_drafter_entry_is_refused_naming_the_file(entry: str, tmp_path: Path) -> None:
    draft = Path(__file__).parents[2] / "mapping" / "targets" / "draft.toml"
    text = draft.read_text().split("\n[[drafter]]", 1)[0] + f"\n[[drafter]]\n{entry}\n"
    path = tmp_path / "draft.toml"
    path.write_text(text)
    with pytest.raises(TableError, match=r"^targets/draft\.toml: a \[\[drafter\]\] entry needs") as raised:
        _target_file(path)
    assert raised.value.kind == "malformed_table"
