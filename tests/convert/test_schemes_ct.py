"""The draft a compressed-tensors serving target gets, route by route: each module's scheme
for the tiny instruct (FP4 experts), base (FP8 experts) and DSpark drafts beside a target with
N = 43 main layers, written out by hand from vLLM 0.33.0's rules (convert/schemes/ct_match.py
cites them), or the one-line refusal; the overlay's JSON; the tensors each scheme makes."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from dsv4.convert.errors import PlanError
from dsv4.convert.inmemory import bundled_plan
from dsv4.convert.plan import Plan
from dsv4.convert.schemes import registry
from dsv4.convert.schemes.base import ServePlan, layer_map
from dsv4.convert.synth import write_checkpoint
from dsv4.model.native import standalone_draft_layout
from tests.quant_configs import preset_group, serving_target

ERROR = partial(PlanError, kind="quant_carry")
N = 43
L = f"model.layers.{N}."

LINEARS = ["e_proj", "h_proj", "attn.fused_wqa_wkv", "attn.wq_b", "attn.wo_a", "attn.wo_b"]
LINEARS += ["ffn.shared_experts.gate_up_proj", "ffn.shared_experts.down_proj"]
BF16_ALWAYS = {"model.embed_tokens": "unquantised", f"{L}head": "unquantised", f"{L}ffn.gate": "unquantised"}


def table(linears: str, experts: str, wo_a: str | None = None) -> dict[str, str]:
    """An MTP draft's decision: every quantisable linear `linears`, wo_a `wo_a` (default the
    same), the routed experts `experts`; the embedding, head and router always bf16."""
    out = {f"{L}{m}": linears for m in LINEARS} | {f"{L}attn.wo_a": wo_a or linears, f"{L}ffn.experts": experts}
    return out | BF16_ALWAYS


OVERLAY = {"instruct": table("ct-fp8-block", "ct-mxfp4"), "base": table("ct-fp8-block", "ct-fp8-block")}
BF16 = table("unquantised", "unquantised", wo_a="ct-fp8-block")
LOSSY = "--allow-lossy"
XPU_WO_A = f"the draft's {L}attn.wo_a would be unquantised, which vLLM's V4 O-projection cannot read on xpu"
NATIVE = "--draft-format native: vLLM builds the MTP draft with this compressed-tensors config"
HADAMARD = {
    "config_groups": {
        "v": {"type": "hadamard", "apply": [{"targets": ["Linear"], "location": "input", "ignore": ["lm_head"]}]}
    }
}

TARGETS: dict[str, dict[str, Any]] = {
    "fp8-block": serving_target("FP8_BLOCK", ["lm_head"], fp8_wo_a=False),
    "w4a16": serving_target("W4A16", ["lm_head"]),
    "nvfp4a16": serving_target("NVFP4A16", ["lm_head"]),
    "nvfp4": serving_target("NVFP4", ["lm_head"]),
    "mxfp4a16": serving_target("MXFP4A16", ["lm_head"]),
    "ignores-draft": serving_target("W4A16", ["lm_head", r"re:.*layers\.43\..*"]),
    "ignores-mtp": serving_target("FP8_BLOCK", ["lm_head", "re:^mtp.*"], fp8_wo_a=False),
    "hadamard": serving_target("W4A16", ["lm_head"], transform_config=HADAMARD),
    "modelopt-nvfp4": {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": ["lm_head"],
    },
}

# (target, route, allow_lossy) -> variant -> the decision table, or a refusal's words
Expected = dict[str, Any]
MATCH: dict[tuple[str, bool], Expected] = {
    ("fp8-block", False): {
        "instruct": table("ct-fp8-block", "ct-fp8-block"),
        "base": table("ct-fp8-block", "ct-fp8-block"),
    },
    ("w4a16", False): {"instruct": LOSSY, "base": LOSSY},
    ("w4a16", True): {
        "instruct": table("requant-wna16", "requant-wna16", wo_a="ct-fp8-block"),
        "base": table("requant-wna16", "requant-wna16", wo_a="ct-fp8-block"),
    },
    ("nvfp4a16", False): {"instruct": LOSSY, "base": LOSSY},
    ("nvfp4a16", True): {
        "instruct": table("requant-nvfp4a16", "requant-nvfp4a16", wo_a="ct-fp8-block"),
        "base": table("requant-nvfp4a16", "requant-nvfp4a16", wo_a="ct-fp8-block"),
    },
    ("nvfp4", False): {"instruct": "input_global_scale", "base": "input_global_scale"},
    ("nvfp4", True): {"instruct": "input_global_scale", "base": "input_global_scale"},
    ("mxfp4a16", False): {"instruct": LOSSY, "base": LOSSY},
    ("mxfp4a16", True): {
        "instruct": table("requant-mxfp4a16", "ct-mxfp4", wo_a="ct-fp8-block"),  # FP4 experts are MXFP4 already
        "base": table("requant-mxfp4a16", "requant-mxfp4a16", wo_a="ct-fp8-block"),
    },
    ("ignores-draft", False): {"instruct": XPU_WO_A, "base": XPU_WO_A},
    ("ignores-draft", True): {"instruct": XPU_WO_A, "base": XPU_WO_A},
    # the regex compressed-tensors' MTP carry-over writes matches no draft name in vLLM 0.33.0
    ("ignores-mtp", False): {
        "instruct": table("ct-fp8-block", "ct-fp8-block"),
        "base": table("ct-fp8-block", "ct-fp8-block"),
    },
    ("hadamard", False): {"instruct": "transform_config.config_groups.v.apply.0", "base": "transform_config"},
    ("hadamard", True): {"instruct": "transform_config.config_groups.v.apply.0", "base": "transform_config"},
    # every draft linear, the head included, is NVFP4 W4A4 under the target's config (modelopt.py:228-264)
    ("modelopt-nvfp4", False): {"instruct": "needs the calibrated activation scale input_scale", "base": "input_scale"},
}
for name in TARGETS:
    MATCH.setdefault((name, True), MATCH[(name, False)])


def routes_of(target: str) -> dict[str, Expected]:
    """auto, overlay, bf16 and native for `target` (match-target is MATCH's)."""
    if target == "ignores-draft":  # ignore is checked before any group: the draft's wo_a is bf16
        return {r: {"instruct": XPU_WO_A, "base": XPU_WO_A} for r in ("auto", "overlay", "bf16")} | {"native": NATIVE}
    if target == "modelopt-nvfp4":  # one algorithm for every layer not excluded: bf16 is the exact route
        every = {"instruct": table("unquantised", "unquantised"), "base": table("unquantised", "unquantised")}
        other = "is not a route for a ModelOpt target"
        return {"auto": every, "bf16": every, "overlay": other, "native": other}
    overlay = {"instruct": OVERLAY["instruct"], "base": OVERLAY["base"]}
    return {"auto": overlay, "overlay": overlay, "bf16": {"instruct": BF16, "base": BF16}, "native": NATIVE}


CASES = [(t, r, False) for t in TARGETS for r in ("auto", "overlay", "bf16", "native")]
CASES += [(t, "match-target", lossy) for t in TARGETS for lossy in (False, True)]


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Plan]:
    root = tmp_path_factory.mktemp("ct")
    return {
        v: bundled_plan(write_checkpoint(root / v, preset="tiny", variant=v, seed=0))
        for v in ("instruct", "base", "dspark")
    }


def plan_for(plan: Plan, qc: Any, route: str, allow_lossy: bool = False) -> ServePlan:
    config = {**plan.config, "num_hidden_layers": N, "quantization_config": qc}
    native = standalone_draft_layout(plan.model_config)
    return registry.serve_plan(
        config, layer_map(plan), native, "t/config.json", ERROR, route=route, allow_lossy=allow_lossy
    )


def outcome(plan: Plan, qc: Any, route: str, allow_lossy: bool) -> dict[str, str] | str:
    try:
        got = plan_for(plan, qc, route, allow_lossy)
    except PlanError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("t/config.json: ")
        return str(exc)
    return {d.module: d.scheme.name for d in got.decisions}


@pytest.mark.parametrize(("target", "route", "allow_lossy"), CASES)
@pytest.mark.parametrize("variant", ["instruct", "base"])
def test_each_module_of_an_mtp_draft_gets_the_scheme_vllm_builds(
    plans: dict[str, Plan], variant: str, target: str, route: str, allow_lossy: bool
) -> None:
    want = MATCH[(target, allow_lossy)] if route == "match-target" else routes_of(target)[route]
    want = want if isinstance(want, str) else want[variant]
    got = outcome(plans[variant], TARGETS[target], route, allow_lossy)
    if isinstance(want, str):
        assert isinstance(got, str) and want in got, got
    else:
        assert got == want


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("route", ["auto", "overlay", "bf16", "native", "match-target"])
def test_a_dspark_draft_takes_a_config_of_its_own_and_no_launch_change(
    plans: dict[str, Plan], target: str, route: str
) -> None:
    """vLLM builds DSpark from the draft's own config.json (dspark/utils.py:115-117): whatever the
    target's groups, every DSpark linear is FP8 block and every FP4 expert MXFP4, exactly."""
    plan = plans["dspark"]
    if TARGETS[target]["quant_method"] == "modelopt":
        return dspark_beside_modelopt(plan, route)
    if route not in ("auto", "overlay"):
        with pytest.raises(
            PlanError, match=f"--draft-format {route}: a DSpark draft is built from its own config.json"
        ):
            plan_for(plan, TARGETS[target], route)
        return
    got = plan_for(plan, TARGETS[target], route)
    layers = [f"model.layers.{k}." for k in (N, N + 1, N + 2)]
    want = {f"{p}{m}": "ct-fp8-block" for p in layers for m in LINEARS if m not in ("e_proj", "h_proj")}
    want |= {f"{p}ffn.experts": "ct-mxfp4" for p in layers} | {f"{p}ffn.gate": "unquantised" for p in layers}
    want |= {"model.main_proj": "ct-fp8-block", "model.embed_tokens": "unquantised", "lm_head": "unquantised"}
    want |= {"model.markov_head.markov_w1": "unquantised", "model.markov_head.markov_w2": "unquantised"}
    assert {d.module: d.scheme.name for d in got.decisions} == want
    assert got.overrides is None and got.route == "overlay"
    numbers = r"(43|44|45)"
    assert got.quantization_config is not None
    assert [g["targets"] for g in got.quantization_config["config_groups"].values()] == [
        [
            rf"re:^model\.(layers\.{numbers}\.)?(attn\.fused_wqa_wkv|attn\.wq_b|attn\.wo_a|attn\.wo_b|"
            r"ffn\.shared_experts\.gate_up_proj|ffn\.shared_experts\.down_proj|main_proj|context_wkv_proj)$"
        ],
        [rf"re:^model\.(layers\.{numbers}\.)?ffn\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)$"],
    ]


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ("drop", "no scheme"),  # the converter's config before it named the layer
        ("ignore", "ignore"),
    ],
)
def test_nvidias_dspark_context_wkv_proj_must_take_the_wkv_layers_scheme(
    plans: dict[str, Plan], edit: str, said: str
) -> None:
    """vLLM's NVIDIA DSpark also builds model.context_wkv_proj from the draft's own config and
    loads every stage's wkv tensors into it (nvidia/dspark.py:72-86, 142-150, 514-518); XPU and
    AMD have no such layer. The config the converter writes gives it the wkv layers' FP8 block
    group, and `decide` (what check --serve-with runs) refuses one that gives it another scheme."""
    plan = plans["dspark"]
    own = plan_for(plan, TARGETS["w4a16"], "auto").quantization_config
    assert own is not None
    native = standalone_draft_layout(plan.model_config)

    def decide(qc: dict[str, Any]) -> list[Any]:
        config = {**plan.config, "num_hidden_layers": N, "quantization_config": qc}
        return registry.decide(config, layer_map(plan), native, "d/config.json", ERROR)

    assert {d.scheme.name for d in decide(own) if d.module.endswith("fused_wqa_wkv")} == {"ct-fp8-block"}
    edited = json.loads(json.dumps(own))
    if edit == "drop":
        (target,) = edited["config_groups"]["dsv4_draft_linears"]["targets"]
        edited["config_groups"]["dsv4_draft_linears"]["targets"] = [target.replace("|context_wkv_proj", "")]
    else:
        edited["ignore"] = ["model.context_wkv_proj"]
    with pytest.raises(PlanError) as refused:
        decide(edited)
    assert str(refused.value) == (
        f"d/config.json: quantization_config gives model.context_wkv_proj {said} on nvidia but the draft's wkv "
        f"({L}attn.fused_wqa_wkv) dsv4_draft_linears (FP8_BLOCK); vLLM's NVIDIA DSpark loads the wkv tensors "
        "into both (nvidia/dspark.py:72-86, 514-518), its XPU and AMD classes have no context_wkv_proj"
    )


def dspark_beside_modelopt(plan: Plan, route: str) -> None:
    if route not in ("auto", "bf16"):
        with pytest.raises(
            PlanError, match=f"--draft-format {route}: a DSpark draft beside a ModelOpt target takes bf16"
        ):
            plan_for(plan, TARGETS["modelopt-nvfp4"], route)
        return
    got = plan_for(plan, TARGETS["modelopt-nvfp4"], route)
    assert {d.scheme.name for d in got.decisions} == {"unquantised"} and got.overrides is None
    assert got.quantization_config == {**TARGETS["modelopt-nvfp4"], "exclude_modules": ["lm_head", "model.*"]}


def test_a_modelopt_target_excludes_the_draft_layers_at_launch(plans: dict[str, Plan]) -> None:
    got = plan_for(plans["instruct"], TARGETS["modelopt-nvfp4"], "auto")
    assert got.route == "bf16" and got.overrides == {"quantization_config": got.quantization_config}
    assert got.overrides["quantization_config"] == {
        **TARGETS["modelopt-nvfp4"],
        "exclude_modules": ["lm_head", "model.layers.43.*"],
    }
    nested = {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}
    got = plan_for(plans["instruct"], nested, "bf16")
    assert got.overrides is not None
    assert got.overrides["quantization_config"]["quantization"]["exclude_modules"] == ["lm_head", "model.layers.43.*"]


def test_the_overlay_adds_draft_groups_first_and_the_draft_to_every_transforms_ignore(plans: dict[str, Plan]) -> None:
    qc = TARGETS["hadamard"]
    got = plan_for(plans["instruct"], qc, "auto")
    assert got.route == "overlay" and got.overrides == {"quantization_config": got.quantization_config}
    effective = got.overrides["quantization_config"]
    assert list(effective["config_groups"]) == ["dsv4_draft_linears", "dsv4_draft_experts", "wo_a", "group_0"]
    linears, experts = (
        effective["config_groups"]["dsv4_draft_linears"],
        effective["config_groups"]["dsv4_draft_experts"],
    )
    assert linears == preset_group(
        "FP8_BLOCK",
        [
            r"re:^model\.layers\.43\.(e_proj|h_proj|attn\.fused_wqa_wkv|attn\.wq_b|attn\.wo_a|attn\.wo_b|"
            r"ffn\.shared_experts\.gate_up_proj|ffn\.shared_experts\.down_proj)$"
        ],
        "float-quantized",
    )
    assert experts == preset_group(
        "MXFP4A16",
        [r"re:^model\.layers\.43\.ffn\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)$"],
        "mxfp4-pack-quantized",
    )
    assert effective["ignore"] == qc["ignore"]  # the target's layers keep what they had
    assert effective["transform_config"]["config_groups"]["v"]["apply"][0]["ignore"] == [
        "lm_head",
        r"re:^model\.layers\.43\.",
    ]
    assert {k: v for k, v in effective.items() if k not in ("config_groups", "transform_config")} == {
        k: v for k, v in qc.items() if k not in ("config_groups", "transform_config")
    }
    json.dumps(got.overrides)  # what --hf-overrides takes


def test_the_bf16_overlay_ignores_the_draft_but_wo_a(plans: dict[str, Plan]) -> None:
    got = plan_for(plans["base"], TARGETS["w4a16"], "bf16")
    effective = got.overrides["quantization_config"] if got.overrides else {}
    assert effective["ignore"] == ["lm_head", r"re:^model\.layers\.43\.(?!attn\.wo_a$)"]
    assert effective["config_groups"]["dsv4_draft_linears"]["targets"] == [r"re:^model\.layers\.43\.attn\.wo_a$"]
    assert "dsv4_draft_experts" not in effective["config_groups"]


def test_the_schemes_make_the_tensors_vllm_loads(plans: dict[str, Plan]) -> None:
    """Names, dtypes, shapes and transforms (tiny: H = 256, expert w1 [128, 256], wq_a [128, 256])."""
    outs = {}
    for variant in ("instruct", "base"):
        for route, qc, lossy in (("overlay", TARGETS["w4a16"], False), ("match-target", TARGETS["w4a16"], True)):
            native = standalone_draft_layout(plans[variant].model_config)
            for d in plan_for(plans[variant], qc, route, lossy).decisions:
                outs |= {(variant, route, o.name): o for o in d.outputs(native)}

    def of(variant: str, route: str, name: str) -> tuple[str, tuple[int, ...], str, tuple[str, ...], bool]:
        o = outs[(variant, route, name)]
        return o.dtype, o.shape, o.transform, o.inputs, o.exact

    e, w1 = "mtp.0.e_proj", "mtp.0.ffn.experts.0.w1"
    assert of("instruct", "overlay", f"{e}.weight") == ("F8_E4M3", (256, 256), "copy", (f"{e}.weight",), True)
    assert of("instruct", "overlay", f"{e}.weight_scale") == ("F32", (2, 2), "e8m0_to_f32", (f"{e}.scale",), True)
    assert of("base", "overlay", f"{e}.weight_scale") == ("F32", (2, 2), "copy", (f"{e}.scale",), True)
    assert of("instruct", "overlay", f"{w1}.weight_packed") == ("U8", (128, 128), "copy", (f"{w1}.weight",), True)
    assert of("instruct", "overlay", f"{w1}.weight_scale") == ("U8", (128, 8), "copy", (f"{w1}.scale",), True)
    assert of("base", "overlay", f"{w1}.weight_scale")[:3] == ("F32", (1, 2), "copy")
    assert of("instruct", "match-target", f"{e}.weight_packed")[:3] == ("I32", (256, 32), "requant.weight_packed")
    assert of("instruct", "match-target", f"{e}.weight_scale")[:3] == ("BF16", (256, 2), "requant.weight_scale")
    assert of("instruct", "match-target", f"{e}.weight_shape")[:3] == ("I64", (2,), "requant.weight_shape")
    assert of("instruct", "match-target", f"{e}.weight_shape")[4] is False
    o = outs[("instruct", "match-target", f"{e}.weight_packed")]
    assert (
        dict(o.args)["num_bits"] == 4
        and dict(o.args)["group_size"] == 128
        and dict(o.args)["format"] == "pack-quantized"
    )
    wq_a = "mtp.0.attn.wq_a"  # a fused pair's parts share one NVFP4 global scale: each reads both
    qc = TARGETS["nvfp4a16"]
    nv = {
        o.name: o
        for d in plan_for(plans["instruct"], qc, "match-target", True).decisions
        for o in d.outputs(standalone_draft_layout(plans["instruct"].model_config))
    }
    assert nv[f"{wq_a}.weight_global_scale"].inputs == (
        f"{wq_a}.weight",
        f"{wq_a}.scale",
        "mtp.0.attn.wkv.weight",
        "mtp.0.attn.wkv.scale",
    )
    assert nv[f"{w1}.weight_global_scale"].inputs[2:] == (
        "mtp.0.ffn.experts.0.w3.weight",
        "mtp.0.ffn.experts.0.w3.scale",
    )
    assert nv[f"{w1}.weight_scale"].dtype == "F8_E4M3" and nv[f"{w1}.weight_scale"].shape == (128, 16)
    # vLLM's NVFP4 MoE method registers an input_global_scale in A16 mode too, which no A16 kernel
    # reads: each expert part gets a unit one (exact), so every parameter is filled; a linear has none
    unit = nv[f"{w1}.input_global_scale"]
    assert (unit.dtype, unit.shape, unit.transform, unit.inputs, unit.exact) == (
        "F32",
        (1,),
        "unit_scale",
        (f"{w1}.scale",),
        True,
    )
    assert {n.rsplit(".", 1)[1] for n in nv if n.startswith("mtp.0.ffn.experts.3.w2.")} == {
        "weight_packed",
        "weight_scale",
        "weight_global_scale",
        "input_global_scale",
    }
    assert f"{wq_a}.input_global_scale" not in nv and "mtp.0.ffn.shared_experts.w1.input_global_scale" not in nv


def test_match_target_with_fp4_experts_reblocks_them_into_fp8(plans: dict[str, Plan]) -> None:
    native = standalone_draft_layout(plans["instruct"].model_config)
    d = next(
        d
        for d in plan_for(plans["instruct"], TARGETS["fp8-block"], "match-target").decisions
        if d.module.endswith("experts")
    )
    w1 = {o.name: o for o in d.outputs(native)}
    stem = "mtp.0.ffn.experts.0.w1"
    assert (w1[f"{stem}.weight"].transform, w1[f"{stem}.weight"].shape) == ("fp4_to_fp8_block.weight", (128, 256))
    assert (w1[f"{stem}.weight_scale"].transform, w1[f"{stem}.weight_scale"].shape) == (
        "fp4_to_fp8_block.weight_scale",
        (1, 2),
    )
    assert w1[f"{stem}.weight"].inputs == (f"{stem}.weight", f"{stem}.scale") and w1[f"{stem}.weight"].exact


def test_the_draft_config_says_what_its_layers_are_built_with(plans: dict[str, Plan], tmp_path: Path) -> None:
    overlay = plan_for(plans["instruct"], TARGETS["w4a16"], "overlay")
    assert overlay.quantization_config == overlay.overrides["quantization_config"]  # type: ignore[index]
    match = plan_for(plans["instruct"], TARGETS["fp8-block"], "match-target")
    assert match.overrides is None and match.quantization_config == TARGETS["fp8-block"]
    assert match.why.startswith("match-target: ") and overlay.why.startswith("overlay: ")
