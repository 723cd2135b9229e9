"""DeepSeek V4.1's DSpark drafter to `--target draft` (mapping/draft_dspark_v41.toml): config.json
nested and kept byte for byte, the 32x32 UE8M0 block scales kept as they are, and every way a
source can differ from the drafter vLLM builds refused in one line naming the tensor (vLLM's
loader would skip it, or leave a parameter uninitialised, without a word). The draft runs in the
bundled model (model/dspark.py, through mapping/xpu_dspark_v41.toml in memory) and agrees with the
independent reference on its source (model/dspark_reference.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from inprocess import run_main
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv4.convert.batch.card import card_body
from dsv4.convert.inmemory import bundled_plan, read_planned
from dsv4.convert.pipeline import convert
from dsv4.convert.sources.location import open_source
from dsv4.convert.synth import write_checkpoint
from dsv4.mapping.table import load_table
from dsv4.mapping.targets import require_target
from dsv4.model.checkpoint import INDEX_NAME, Checkpoint
from dsv4.model.errors import LoadError
from dsv4.model.loader import load_state
from dsv4.model.storage import ceil_div

Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def v41(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("v41") / "src", preset="tiny", variant="v41")


@pytest.fixture(scope="module")
def converted(v41: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v41-out") / "draft"
    convert(v41, out, target="draft")
    return out


def _raw(root: Path, name: str) -> bytes:
    """Tensor `name`'s stored bytes in checkpoint `root`."""
    with safe_open(root / Checkpoint(root).headers.tensors[name].file, framework="pt") as f:
        return f.get_tensor(name).view(torch.uint8).numpy().tobytes()


def _edited(v41: Path, out: Path, edit: Callable[[Tensors], None]) -> Path:
    """A copy of `v41` whose stage-0 shard is rewritten after `edit` changed its tensors."""
    shutil.copytree(v41, out)
    index = json.loads((out / INDEX_NAME).read_text())
    shard = index["weight_map"]["mtp.0.main_proj.weight"]
    tensors = load_file(out / shard)
    edit(tensors)
    save_file(tensors, out / shard, metadata={"format": "pt"})
    others = {n: f for n, f in index["weight_map"].items() if f != shard}
    index["weight_map"] = {**others, **dict.fromkeys(tensors, shard)}
    (out / INDEX_NAME).write_text(json.dumps(index))
    return out


def test_a_v41_draft_keeps_config_json_and_its_32x32_e8m0_scales_byte_for_byte(v41: Path, converted: Path) -> None:
    assert (converted / "config.json").read_bytes() == (v41 / "config.json").read_bytes()
    held = Checkpoint(converted).headers.tensors
    scales = [n for n in held if n.endswith(".scale") and ".experts." not in n]
    assert len(scales) == 3 * 8 + 1  # per stage wq_a, wq_b, wkv, wo_a, wo_b, shared w1-w3; main_proj
    for name in scales:
        weight = held[name.removesuffix(".scale") + ".weight"]
        rows, cols = weight.shape
        assert (held[name].dtype, held[name].shape) == ("F8_E8M0", (ceil_div(rows, 32), ceil_div(cols, 32)))
        assert _raw(converted, name) == _raw(v41, name)


def test_a_v41_draft_is_the_drafter_vllm_builds(converted: Path) -> None:
    held = Checkpoint(converted).headers.tensors
    for s in range(3):  # 4 experts per stage (dspark_n_routed_experts), not the main model's 8
        assert {n.split(".")[4] for n in held if n.startswith(f"mtp.{s}.ffn.experts.")} == {"0", "1", "2", "3"}
        assert held[f"mtp.{s}.ffn.gate.bias_vl"].shape == held[f"mtp.{s}.ffn.gate.bias"].shape == (4,)
    assert {"mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight"} <= held.keys()
    assert not [n for n in held if "hc_head" in n or "markov_w" in n]


def test_check_runs_a_v41_draft_in_the_bundled_model_and_it_agrees_with_its_source(
    v41: Path, converted: Path, monkeypatch, capsys
) -> None:
    code, out, _ = run_main(monkeypatch, capsys, "check", converted, "--native", v41, "--device", "cpu")
    assert code == 0, out
    assert "PASS layout    all 171 tensors of the draft layout present with their shapes and dtypes" in out
    assert "PASS smoke     strict load and one DSpark block (8-token context) on cpu: hidden [5, 256]" in out
    assert f"PASS native    agrees with the reference on {v41}" in out and "confidence max|diff|" in out


def test_smoke_drafts_a_v41_block_collapsed_to_one_stream_with_finite_confidences(
    converted: Path, monkeypatch, capsys
) -> None:
    code, out, err = run_main(monkeypatch, capsys, "smoke", converted, "--device", "cpu", "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    # no hc_head: the hidden states leave the stages collapsed, [B, H] (vLLM deepseek_v41/nvidia/dspark.py:238-247)
    assert report["hidden_shape"] == [5, 256] and report["logits_shape"] == [5, 512]
    assert len(report["draft_tokens"]) == 5 and all(0 <= t < 512 for t in report["draft_tokens"])
    assert len(report["confidence"]) == 5 and all(0.0 < c < 1.0 for c in report["confidence"])


def test_smoke_native_fails_a_v41_draft_with_one_scale_byte_changed(
    v41: Path, converted: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)
    shard = broken / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    scale = tensors["mtp.1.attn.wkv.scale"].view(torch.uint8).clone()
    scale.view(-1)[0] += 1  # one 32x32 block of stage 1's wkv doubled
    tensors["mtp.1.attn.wkv.scale"] = scale.view(torch.float8_e8m0fnu)
    save_file(tensors, shard, metadata={"format": "pt"})
    code, _, err = run_main(monkeypatch, capsys, "smoke", broken, "--device", "cpu", "--native", v41)
    # the unchanged draft agrees (test_check_runs_a_v41_draft_in_the_bundled_model_and_it_agrees_with_its_source)
    assert code == 55 and err.startswith(f"error: {broken}: differs from the reference on {v41}: "), err


def _expert_count(state: Tensors) -> None:  # the main model's 8 experts in stage 0, not dspark_n_routed_experts
    name = "model.layers.0.ffn.experts.routed_experts.w2_weight"
    state[name] = state[name].repeat(2, 1, 1)


@pytest.mark.parametrize(
    ("edit", "kind", "tensor"),
    [
        (lambda state: state.pop("model.layers.1.ffn.gate.bias_vl"), "missing_key", "model.layers.1.ffn.gate.bias_vl"),
        (
            lambda state: state.pop("model.confidence_head.proj.weight"),
            "missing_key",
            "model.confidence_head.proj.weight",
        ),
        (
            lambda state: state.setdefault("model.hc_head_scale", torch.zeros(1)),  # 0731's head: none in V4.1
            "unexpected_key",
            "model.hc_head_scale",
        ),
        (_expert_count, "shape_mismatch", "model.layers.0.ffn.experts.routed_experts.w2_weight"),
    ],
)
def test_the_strict_loader_refuses_a_v41_state_unlike_the_model(
    converted: Path, edit: Callable[[Tensors], object], kind: str, tensor: str
) -> None:
    plan = bundled_plan(converted)
    with open_source(converted) as source:
        state = read_planned(plan, source.reader)
    edit(state)
    with pytest.raises(LoadError) as refused:
        load_state(plan.model_config, state, "cpu")
    assert (refused.value.kind, refused.value.tensor) == (kind, tensor) and "\n" not in str(refused.value)


def test_check_names_what_a_v41_draft_lacks_adds_or_reshapes(
    converted: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)
    shard = broken / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    del tensors["mtp.1.ffn.gate.bias_vl"]
    tensors["mtp.0.ffn.experts.4.w1.weight"] = tensors["mtp.0.ffn.experts.3.w1.weight"].clone()
    tensors["mtp.2.attn.wkv.scale"] = tensors["mtp.2.attn.wkv.scale"][:1].clone()  # a 128-row grid
    save_file(tensors, shard, metadata={"format": "pt"})
    index = {"weight_map": dict.fromkeys(tensors, shard.name)}
    (broken / INDEX_NAME).write_text(json.dumps(index))
    code, out, _ = run_main(monkeypatch, capsys, "check", broken)
    (layout,) = [line for line in out.splitlines() if line.startswith("  FAIL layout")]
    assert code != 0 and "1 missing: mtp.1.ffn.gate.bias_vl" in layout
    assert "mtp.0.ffn.experts.4.w1.weight" in layout and "mtp.2.attn.wkv.scale is [1, 8]" in layout


def test_plan_names_the_v41_drafter_its_method_and_releases(v41: Path, monkeypatch, capsys) -> None:
    code, out, _ = run_main(monkeypatch, capsys, "plan", v41, "--target", "draft")
    assert code == 0
    assert "(table draft_dspark_v41 v1)" in out and "drafter:              DeepSeek V4.1 DSpark" in out
    assert (
        """# vLLM 0.33.0 (CUDA, ROCm)\n    vllm serve TARGET --speculative-config '{"method":"dspark","model":"OUT"}'"""
        in out
    )
    assert (
        "# SGLang 0.5.23\n    python -m sglang.launch_server --model-path TARGET --speculative-algorithm DSPARK" in out
    )


def _drop(name: str) -> Callable[[Tensors], None]:
    return lambda tensors: tensors.pop(name)


def _extra_expert(tensors: Tensors) -> None:  # a fifth expert in stage 0: past dspark_n_routed_experts = 4
    for leaf in ("w1.weight", "w1.scale", "w2.weight", "w2.scale", "w3.weight", "w3.scale"):
        tensors[f"mtp.0.ffn.experts.4.{leaf}"] = tensors[f"mtp.0.ffn.experts.3.{leaf}"].clone()


def _regridded(tensors: Tensors) -> None:  # wq_a [128, 256] on a 128x128 grid: [1, 2]
    tensors["mtp.0.attn.wq_a.scale"] = tensors["mtp.0.attn.wq_a.scale"][:1, :2].clone()


def _f32(tensors: Tensors) -> None:  # the same grid as F32 values, as V4 Base stores its scales
    tensors["mtp.0.attn.wq_a.scale"] = tensors["mtp.0.attn.wq_a.scale"].float()


REFUSALS = {
    "dropped": (
        _drop("mtp.0.ffn.gate.bias_vl"),
        32,
        "its source tensor mtp.0.ffn.gate.bias_vl is not in the checkpoint",
    ),
    "expert-past-bound": (
        _extra_expert,
        35,
        "tensor mtp.0.ffn.experts.4.w1.scale: index 4 but config.json has dspark_n_routed_experts = 4",
    ),
    "regridded": (
        _regridded,
        33,
        "tensor mtp.0.attn.wq_a.scale: F8_E8M0[1, 2] but config.json (instruct, weight_block_size [32, 32]) implies "
        "F8_E8M0[4, 8]",
    ),
    "f32-scale": (_f32, 33, "tensor mtp.0.attn.wq_a.scale: F32[4, 8] but config.json (instruct, weight_block_size"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_v41_source_unlike_its_drafter_is_refused_in_one_line(
    v41: Path, tmp_path: Path, case: str, monkeypatch, capsys
) -> None:
    edit, code, said = REFUSALS[case]
    source = _edited(v41, tmp_path / "src", edit)
    got, out, err = run_main(monkeypatch, capsys, "plan", source, "--target", "draft")
    assert (got, out, err.count("\n")) == (code, "", 1) and said in err


def test_xpu_refuses_v41_and_points_to_draft(v41: Path, monkeypatch, capsys) -> None:
    code, _, err = run_main(monkeypatch, capsys, "plan", v41, "--target", "xpu")
    assert code == 35 and err.count("\n") == 1
    assert "vLLM 0.33.0 has no XPU model for DeepSeek V4.1" in err and "--target draft serves it" in err


def test_the_model_card_of_a_v41_draft_serves_it_with_dspark_on_cuda_and_rocm() -> None:
    body = card_body("org/v41-draft", "org/v41", "abc", load_table("draft_dspark_v41"), require_target("draft"))
    assert "The DeepSeek V4.1 DSpark (model_type deepseek_v41, text_config nested) draft model" in body
    assert """# vLLM 0.33.0 (CUDA, ROCm)\nvllm serve org/v41 --speculative-config '{"method":"dspark",""" in body
    assert "--speculative-algorithm DSPARK --speculative-draft-model-path org/v41-draft" in body


def test_serve_with_is_refused_for_a_v41_draft_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    """No quantised V4.1 serving target is modelled: `plan` and `convert` refuse before anything is
    written, naming the source and what to do instead, and `check --serve-with` fails saying so (both
    once failed on the nested config's num_hidden_layers)."""
    src = write_checkpoint(tmp_path / "src", preset="tiny", variant="v41", seed=0)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_bytes((src / "config.json").read_bytes())
    for command in (("plan", src), (src, tmp_path / "out")):
        code, _, err = run_main(monkeypatch, capsys, *command, "--target", "draft", "--serve-with", tmp_path / "t")
        assert code == 35 and err.count("\n") == 1, err
        assert f"{src}: --serve-with is not built for DeepSeek V4.1 drafts" in err
        assert "convert it without --serve-with" in err
    assert not (tmp_path / "out").exists()
    convert(src, tmp_path / "draft", target="draft")
    code, out, _ = run_main(monkeypatch, capsys, "check", tmp_path / "draft", "--fast", "--serve-with", tmp_path / "t")
    assert code == 86 and "--serve-with is not built for DeepSeek V4.1 drafts" in out
