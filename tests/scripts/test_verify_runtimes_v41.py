"""scripts/verify_runtimes.py on a DeepSeek V4.1 draft: vLLM 0.33.0's two V4.1 DSpark loaders
(models/deepseek_v41/{nvidia,amd}/dspark.py) and SGLang 0.5.23's DSpark loader, cut out of the
cached wheels (scripts/test.sh fetches them; without them these tests fail), on the tiny V4.1
checkpoint converted with --target draft, and what the runtimes do with a broken draft."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_verify_runtimes import vr

from dsv4.convert.pipeline import convert
from dsv4.convert.serving import Serving
from dsv4.convert.serving_target import read_serving_target
from dsv4.convert.synth import write_checkpoint
from tests.quant_configs import serving_target

# isort: split
# on the path test_verify_runtimes' import of verify_runtimes puts there
from runtime_loaders.recording import read_tensors
from runtime_loaders.v41_verify import verify_v41

NVIDIA = "vllm-nvidia-v41-dspark"
SGLANG = "sglang-v41-dspark"


@pytest.fixture(scope="module")
def v41(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("v41")
    native = write_checkpoint(root / "native", preset="tiny", variant="v41", seed=0)
    convert(native, root / "draft", target="draft")
    return native, root / "draft"


def edited(draft: Path, out: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of DRAFT with its tensors changed by `edit`, in one shard."""
    tensors = dict(read_tensors(draft))
    edit(tensors)
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, "model.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(draft / "config.json", out / "config.json")
    return out


def test_every_v41_loader_fills_each_parameter_once_with_the_native_values(v41: tuple[Path, Path]) -> None:
    native, draft = v41
    reports = verify_v41(vr.wheel_cache(), draft, native)
    assert [r.loader for r in reports] == ["vllm-nvidia-v41-dspark", "vllm-amd-v41-dspark", SGLANG]
    for r in reports:
        assert r.passed, r.summary()
        assert r.filled == r.params and not r.inexact
    stages = 3
    for r in reports[:2]:
        # vLLM's own count agrees: 30 parameters per stage and 7 at model level (main_proj and its
        # scale, main_norm, norm, markov_w1/w2, the confidence head)
        assert r.params == r.runtime_loaded == 30 * stages + 7
        assert r.methods["model.layers.3.attn.wq_b"] == "ModelOptLinearMethod"
        assert r.methods["model.layers.3.ffn.experts"] == "Mxfp4MoEMethod"
        assert sorted(r.dropped) == ["embed.weight", "head.weight"]  # the target's, aliased
    # SGLang drops the stages' bias_vl (deepseek_v4_dspark.py:1152-1153), in the native run too
    assert [t for t in reports[2].dropped if t.startswith("mtp.")] == [f"mtp.{s}.ffn.gate.bias_vl" for s in range(3)]


def test_a_dropped_tensor_loads_silently_in_vllm_and_fails_the_proof(v41: tuple[Path, Path], tmp_path: Path) -> None:
    native, draft = v41
    broken = edited(draft, tmp_path / "d", lambda t: t.pop("mtp.1.attn.wq_b.weight"))
    vllm, sglang = verify_v41(vr.wheel_cache(), broken, native, [NVIDIA, SGLANG])
    assert not vllm.errors and vllm.runtime_loaded == vllm.params - 1  # "loaded: 96 params", no error
    assert vllm.unfilled == ["model.layers.1.attn.wq_b.weight (1 of 1 parts)"] and not vllm.passed
    assert sglang.unfilled == ["stages.1.self_attn.wq_b.weight"] and not sglang.passed


def test_an_expert_past_dspark_n_routed_experts_is_skipped_silently(v41: tuple[Path, Path], tmp_path: Path) -> None:
    native, draft = v41
    experts = json.loads((draft / "config.json").read_text())["text_config"]["dspark_n_routed_experts"]
    extra = f"mtp.0.ffn.experts.{experts}.w1.weight"
    broken = edited(draft, tmp_path / "d", lambda t: t.update({extra: t["mtp.0.ffn.experts.0.w1.weight"].clone()}))
    (vllm,) = verify_v41(vr.wheel_cache(), broken, native, [NVIDIA])
    assert not vllm.errors and vllm.runtime_loaded == vllm.params  # the runtime says nothing
    assert vllm.skipped == [extra] and not vllm.passed


def test_a_changed_scale_byte_is_caught_by_value(v41: tuple[Path, Path], tmp_path: Path) -> None:
    native, draft = v41

    def bump(tensors: dict[str, torch.Tensor]) -> None:
        scale = tensors["mtp.2.attn.wkv.scale"].view(torch.uint8).clone()
        scale[0, 0] += 1  # one 32x32 block's exponent: 32 rows of the expanded parameter
        tensors["mtp.2.attn.wkv.scale"] = scale.view(torch.float8_e8m0fnu)

    (vllm,) = verify_v41(vr.wheel_cache(), edited(draft, tmp_path / "d", bump), native, [NVIDIA])
    assert vllm.inexact == ["model.layers.2.attn.fused_wqa_wkv.weight_scale"] and not vllm.passed


def _regridded(tensors: dict[str, torch.Tensor]) -> None:
    rows, cols = tensors["mtp.0.attn.wq_b.weight"].shape
    tensors["mtp.0.attn.wq_b.scale"] = torch.full((-(-rows // 128), -(-cols // 128)), 127, dtype=torch.uint8).view(
        torch.float8_e8m0fnu
    )


def _as_f32(tensors: dict[str, torch.Tensor]) -> None:
    tensors["mtp.0.attn.wq_b.scale"] = tensors["mtp.0.attn.wq_b.scale"].float()


@pytest.mark.parametrize(
    ("edit", "raised"),
    [
        (_regridded, "RuntimeError"),  # the 32x-repeated 128 grid does not fit the [out, in/32] parameter
        (_as_f32, "AssertionError"),  # get_scale_weight_loader asserts uint8 / float8_e8m0fnu (modelopt.py:2324)
    ],
)
def test_a_scale_not_on_the_32_grid_in_e8m0_is_refused_by_vllm(
    v41: tuple[Path, Path], tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], None], raised: str
) -> None:
    native, draft = v41
    (vllm,) = verify_v41(vr.wheel_cache(), edited(draft, tmp_path / "d", edit), native, [NVIDIA])
    assert [e.split(":")[:2] for e in vllm.errors] == [["mtp.0.attn.wq_b.scale", f" {raised}"]]
    assert not vllm.passed


def test_a_vision_exp_drafts_routers_bias_vl_fill_nvidias_and_amds_v4_dspark(tmp_path: Path) -> None:
    # Vision-Exp is V4 DSpark with a vision tower: vLLM's NVIDIA and AMD V4 routers then have a
    # gate.bias_vl each (deepseek_v4/nvidia/model.py:311-318, amd/model.py:652-656), XPU's none
    native = write_checkpoint(tmp_path / "native", preset="tiny", variant="vision", seed=0)
    target = tmp_path / "target"
    target.mkdir()
    config = {**json.loads((native / "config.json").read_text()), "quantization_config": serving_target("W4A16", [])}
    (target / "config.json").write_text(json.dumps(config))
    convert(native, tmp_path / "draft", target="draft", serving=Serving(read_serving_target(target), "auto"))
    loaders = ["vllm-nvidia-dspark", "vllm-amd-dspark", "vllm-xpu-dspark"]
    reports = vr.verify_serving(vr.wheel_cache(), tmp_path / "draft", target, None, native, loaders)[1]
    for r in reports:
        assert r.passed, r.summary()
    # the text DSpark's 99, 97 and 96 parameters, and NVIDIA's and AMD's three routers' bias_vl
    assert [r.filled for r in reports] == [102, 100, 96]
