"""The scheme registry (convert/schemes/): for each target quantisation method, the scheme
each module of a tiny MTP and a tiny DSpark draft gets and the tensors it then holds; an
unknown method refused naming the field; `check --serve-with` holding a draft to them."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from dsv4.convert.check.run import run_checks
from dsv4.convert.errors import PlanError
from dsv4.convert.inmemory import bundled_plan
from dsv4.convert.pipeline import convert
from dsv4.convert.plan import Plan
from dsv4.convert.schemes import registry
from dsv4.convert.schemes.base import Decision, layer_map
from dsv4.convert.synth import write_checkpoint
from dsv4.model.native import standalone_draft_layout

ERROR = partial(PlanError, kind="quant_carry")
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}

# the DeepSeek fp8 decision, module by module, written out from mapping/README.md#quantisation-layer-names
# and the native storage (mapping/README.md#storage-dtypes), not derived from the code
BLOCK = {
    "attn.fused_wqa_wkv": "fp8-block",
    "attn.wq_b": "fp8-block",
    "attn.wo_a": "fp8-block",
    "attn.wo_b": "fp8-block",
    "ffn.gate": "unquantised",  # the router: bf16 in the checkpoint, never quantised
    "ffn.shared_experts.gate_up_proj": "fp8-block",
    "ffn.shared_experts.down_proj": "fp8-block",
}
EXPERTS = {"instruct": "fp4-experts", "base": "fp8-block", "dspark": "fp4-experts"}


def fp8_decision(variant: str, n: int) -> dict[str, str]:
    """What a DeepSeek fp8 target gives each module of the tiny `variant` draft (N = n)."""
    top = {"model.embed_tokens": "unquantised"}
    if variant == "dspark":  # three stages, one main projection, the Markov head
        top |= {"lm_head": "unquantised", "model.main_proj": "fp8-block"}
        top |= {"model.markov_head.markov_w1": "unquantised", "model.markov_head.markov_w2": "unquantised"}
        layers = range(n, n + 3)
    else:
        p = f"model.layers.{n}."
        top |= {f"{p}shared_head.head": "unquantised", f"{p}e_proj": "fp8-block", f"{p}h_proj": "fp8-block"}
        layers = range(n, n + 1)
    blocks = {f"model.layers.{k}.{m}": s for k in layers for m, s in {**BLOCK, "ffn.experts": EXPERTS[variant]}.items()}
    return top | blocks


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Plan]:
    root = tmp_path_factory.mktemp("schemes")
    variants = ("instruct", "base", "dspark")
    return {v: bundled_plan(write_checkpoint(root / v, preset="tiny", variant=v, seed=0)) for v in variants}


def decisions(plan: Plan, qc: dict[str, Any] | None, **target: Any) -> dict[str, Decision]:
    config = {**plan.config, **target}
    config.pop("quantization_config", None)
    if qc is not None:
        config["quantization_config"] = qc
    native = standalone_draft_layout(plan.model_config)
    return {d.module: d for d in registry.decide(config, layer_map(plan), native, "target/config.json", ERROR)}


@pytest.mark.parametrize("variant", ["instruct", "base", "dspark"])
def test_deepseek_fp8_serves_each_module_as_the_native_checkpoint_stores_it(
    plans: dict[str, Plan], variant: str
) -> None:
    plan = plans[variant]
    got = decisions(plan, FP8)
    assert {m: d.scheme.name for m, d in got.items()} == fp8_decision(variant, plan.model_config.num_hidden_layers)
    n = plan.model_config.num_hidden_layers
    assert got[f"model.layers.{n}.attn.fused_wqa_wkv"].parts == ("mtp.0.attn.wq_a", "mtp.0.attn.wkv")
    assert len(got[f"model.layers.{n}.ffn.experts"].parts) == 3 * plan.model_config.n_routed_experts
    native = standalone_draft_layout(plan.model_config)
    assert registry.draft_tensors(list(got.values()), native) == native  # the draft served as it is


@pytest.mark.parametrize("variant", ["instruct", "base", "dspark"])
def test_no_quantization_config_gives_every_module_a_bf16_weight(plans: dict[str, Plan], variant: str) -> None:
    plan = plans[variant]
    got = decisions(plan, None)
    assert set(got) == set(fp8_decision(variant, plan.model_config.num_hidden_layers))
    assert {d.scheme.name for d in got.values()} == {"unquantised"}
    native = standalone_draft_layout(plan.model_config)
    held = registry.draft_tensors(list(got.values()), native)
    cfg = plan.model_config
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    assert held["mtp.0.ffn.experts.0.w1.weight"] == ("BF16", (I, H))  # FP4 or FP8, dequantised to its logical shape
    assert held["mtp.0.ffn.experts.0.w2.weight"] == ("BF16", (H, I))
    assert held["mtp.0.ffn.gate.weight"] == native["mtp.0.ffn.gate.weight"]  # bf16 already
    assert not [name for name in held if name.endswith(".scale")]
    assert {name for name in held if not name.endswith(".weight")} == {
        name for name in native if not name.endswith((".weight", ".scale"))
    }  # norms' neighbours, hyper-connections, sinks and the gate's bias stay


def test_the_modules_are_named_after_the_targets_layers(plans: dict[str, Plan]) -> None:
    got = decisions(plans["instruct"], FP8, num_hidden_layers=43)
    assert "model.layers.43.attn.fused_wqa_wkv" in got and "model.layers.2.e_proj" not in got
    assert set(got) == set(fp8_decision("instruct", 43))


@pytest.mark.parametrize(
    ("qc", "field", "said"),
    [
        ({"quant_method": "awq", "bits": 4}, "quantization_config.quant_method", "quant_method 'awq' is not"),
        ({"bits": 4}, "quantization_config.quant_method", "quant_method None is not"),
        ([1, 2], "quantization_config", "quantization_config is list, expected an object"),
        ({**FP8, "moe_quant_algo": "NVFP4"}, "quantization_config.moe_quant_algo", "moe_quant_algo is 'NVFP4'"),
        ({**FP8, "modules_to_not_convert": ["head"]}, "quantization_config.modules_to_not_convert", "lists native"),
    ],
    ids=["awq", "no-method", "not-an-object", "mixed-experts", "named-layers"],
)
def test_a_method_or_config_no_entry_knows_is_refused_naming_the_field(
    plans: dict[str, Plan], qc: Any, field: str, said: str
) -> None:
    with pytest.raises(PlanError) as err:
        decisions(plans["instruct"], qc)
    assert err.value.fields() == {"kind": "quant_carry", "path": "target/config.json", "field": field}
    assert str(err.value).startswith("target/config.json: ") and said in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("n", [0, "2", None])
def test_a_target_without_a_layer_count_is_refused_naming_the_field(plans: dict[str, Plan], n: Any) -> None:
    with pytest.raises(PlanError) as err:
        decisions(plans["instruct"], FP8, num_hidden_layers=n)
    assert err.value.field == "num_hidden_layers"


def test_check_serve_with_refuses_fp8_tensors_beside_a_target_that_quantises_nothing(tmp_path: Path) -> None:
    """A draft whose source config has no quantization_config, served beside that source:
    every field agrees, but vLLM would build bf16 layers and load the FP8 bytes into them."""
    native = write_checkpoint(tmp_path / "native", preset="tiny", seed=0)
    config = json.loads((native / "config.json").read_text())
    del config["quantization_config"]
    (native / "config.json").write_text(json.dumps(config))
    draft = convert(native, tmp_path / "draft", target="draft").out
    report = run_checks(draft, serve_with=native)
    serve = report.result("serve")
    assert (serve.status, serve.exit_code) == ("fail", 86), serve.reason
    assert serve.error is not None and serve.error.fields() == {
        "kind": "serve_mismatch",
        "path": str(native / "config.json"),
        "tensor": "mtp.0.attn.wkv.scale",
    }
    assert "the target needs no such tensor: model.layers.2.attn.fused_wqa_wkv is built unquantised" in serve.reason


def test_check_serve_with_says_what_each_module_is_built_as(tmp_path: Path) -> None:
    native = write_checkpoint(tmp_path / "native", preset="tiny", seed=0)
    draft = convert(native, tmp_path / "draft", target="draft").out
    serve = run_checks(draft, serve_with=native).result("serve")
    assert serve.status == "pass", serve.reason
    assert "12 draft modules hold exactly what their schemes take (1 fp4-experts, 8 fp8-block, 3 unquantised)" in (
        serve.reason
    )
