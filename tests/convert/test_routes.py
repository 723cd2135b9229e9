"""A draft made to serve beside a quantised target, converted end to end (convert(...,
serving=...)) with hand-made ServePlans on tiny drafts: what each route writes, read back
as the runtime's scheme reads it, against the native checkpoint decoded independently
(model/reference.py); what conversion.json records of the computed tensors; the refusal of a
block FP8 cannot hold; a resumed run."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
import torch
from ct_read import ct_args, read_mxfp4, read_nvfp4, read_w4a16
from edits import tree_digest
from safetensors.torch import load_file, save_file
from tensors import load_all

from dsv4.convert import pipeline, transforms
from dsv4.convert.errors import PlanError
from dsv4.convert.inmemory import bundled_plan
from dsv4.convert.pipeline import ConversionResult, convert
from dsv4.convert.plan import Plan
from dsv4.convert.schemes import registry
from dsv4.convert.schemes.base import Decision, Output, Scheme, ServePlan, layer_map
from dsv4.convert.serving import Served, Serving
from dsv4.convert.serving_target import read_serving_target
from dsv4.convert.sources.inventory import Inventory
from dsv4.convert.sources.source import Source
from dsv4.convert.synth import write_checkpoint
from dsv4.model.native import Layout, standalone_draft_layout
from dsv4.model.presets import preset_config
from dsv4.model.reference import fp4_weight, fp8_weight

BLOCK = (128, 128)
ServeWith = Callable[[Source | None, Plan], ServePlan]


def _overlay(part: str, native: Layout) -> list[Output]:
    """FP8 linears keep their bytes with an F32 weight_scale; FP4 experts are MXFP4 byte copies."""
    (wd, ws), (sd, ss) = native[f"{part}.weight"], native[f"{part}.scale"]
    w, s = f"{part}.weight", f"{part}.scale"
    if wd == "I8":
        return [Output(f"{w}_packed", "U8", ws, "copy", (w,)), Output(f"{w}_scale", "U8", ss, "copy", (s,))]
    scale = "e8m0_to_f32" if sd == "F8_E8M0" else "copy"
    return [Output(w, wd, ws, "copy", (w,)), Output(f"{w}_scale", "F32", ss, scale, (s,))]


def _fp8_from_fp4(part: str, native: Layout) -> list[Output]:
    (wd, ws), w, s = native[f"{part}.weight"], f"{part}.weight", f"{part}.scale"
    if wd != "I8":
        return _overlay(part, native)
    n, k = ws[0], 2 * ws[1]
    return [
        Output(w, "F8_E4M3", (n, k), "fp4_to_fp8_block.weight", (w, s)),
        Output(f"{w}_scale", "F32", (-(-n // 128), -(-k // 128)), "fp4_to_fp8_block.weight_scale", (w, s)),
    ]


# part suffix -> the preset it is requantised into (by _requant)
MIXED = {
    "attn.wq_a": "NVFP4A16",
    "attn.wkv": "NVFP4A16",
    "attn.wq_b": "W4A16",
    "attn.wo_b": "MXFP4A16",
    "shared_experts.w1": "W4A16",
    "shared_experts.w3": "W4A16",
    "shared_experts.w2": "MXFP4A16",
    ".w1": "NVFP4A16",  # the routed experts
    ".w2": "NVFP4A16",
    ".w3": "NVFP4A16",
}
PARTNER = {"attn.wq_a": "attn.wkv", "attn.wkv": "attn.wq_a", "w1": "w3", "w3": "w1"}  # the fused pairs
FORMATS = {  # preset -> (format, leaves (dtype, shape of [N, K]), the reading vLLM does)
    "W4A16": (
        "pack-quantized",
        {"weight_packed": ("I32", 8), "weight_scale": ("BF16", 128), "weight_shape": None},
        read_w4a16,
    ),
    "NVFP4A16": (
        "nvfp4-pack-quantized",
        {"weight_packed": ("U8", 2), "weight_scale": ("F8_E4M3", 16), "weight_global_scale": None},
        read_nvfp4,
    ),
    "MXFP4A16": ("mxfp4-pack-quantized", {"weight_packed": ("U8", 2), "weight_scale": ("U8", 32)}, read_mxfp4),
}


def _requant(part: str, native: Layout) -> list[Output]:
    """Each quantised module requantised into one of the three formats (the fused pairs into
    NVFP4, whose global scale they share), the rest as the overlay has them."""
    preset = next((p for suffix, p in MIXED.items() if part.endswith(suffix)), None)
    if preset is None:
        return _overlay(part, native)
    fmt, leaves, _ = FORMATS[preset]
    (wd, ws), w, s = native[f"{part}.weight"], f"{part}.weight", f"{part}.scale"
    n, k = ws[0], ws[1] * (2 if wd == "I8" else 1)
    inputs = (w, s)
    for mine, theirs in PARTNER.items():
        if part.endswith(mine):
            inputs += (f"{part.removesuffix(mine)}{theirs}.weight", f"{part.removesuffix(mine)}{theirs}.scale")
    shapes = {"weight_shape": ("I64", (2,)), "weight_global_scale": ("F32", (1,))}
    specs = {leaf: shapes[leaf] if per is None else (per[0], (n, k // per[1])) for leaf, per in leaves.items()}
    args = ct_args(preset, fmt)
    return [
        Output(f"{part}.{leaf}", d, shape, f"requant.{leaf}", inputs, exact=False, args=args)
        for leaf, (d, shape) in specs.items()
    ]


def serving(src: Path, outputs: Callable[[str, Layout], list[Output]]) -> ServeWith:
    """A ServePlan giving every quantised module of the draft (FP8 linears, experts) `outputs`;
    the bf16 ones (embedding, head, router) stay as the draft holds them."""
    layers = layer_map(bundled_plan(src))

    def serve_with(source: Source | None, plan: Plan) -> ServePlan:
        native = standalone_draft_layout(plan.model_config)
        decisions = [
            Decision(module, layers.kinds[module], parts, Scheme("test", outputs), "test")
            for module, parts in layers.parts.items()
            if native.get(f"{parts[0]}.weight", ("BF16",))[0] != "BF16"
        ]
        return ServePlan("overlay", decisions, None, None, "test")

    return serve_with


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny drafts with two routed experts (the fewest top-2 routing takes): a requantised
    tensor costs compressed-tensors tens of milliseconds."""
    root = tmp_path_factory.mktemp("routes")
    out = {}
    for variant in ("instruct", "base"):
        config = {**preset_config("tiny", variant), "n_routed_experts": 2}
        out[variant] = write_checkpoint(root / variant / "src", config=config, variant=variant)
    return out


def convert_serving(src: Path, out: Path, serve_with: ServeWith) -> ConversionResult:
    """`convert --target draft --serve-with SRC` with the serve plan `serve_with` gives in place
    of the one the scheme registry would decide (these tests hold the routes to hand-made plans)."""

    def decide(inventory: Inventory, plan: Plan, serving: Serving) -> Served:
        native = standalone_draft_layout(plan.model_config)
        return Served(serving, serve_with(None, plan), plan.target, plan.identity.drafter, native)

    with patch.object(pipeline, "decide_serving", decide):
        return convert(src, out, target="draft", serving=Serving(read_serving_target(src)))


def served(src: Path, out: Path, outputs: Callable[[str, Layout], list[Output]]) -> ConversionResult:
    return convert_serving(src, out, serving(src, outputs))


def record(out: Path) -> dict[str, Any]:
    return json.loads((out / "conversion.json").read_text())


def parts_of(native: dict[str, torch.Tensor], dtype: torch.dtype) -> list[str]:
    return sorted(n.removesuffix(".weight") for n, t in native.items() if n.endswith(".weight") and t.dtype == dtype)


def test_overlay_keeps_fp8_bytes_decodes_e8m0_scales_and_relabels_fp4_experts(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    result = served(sources["instruct"], tmp_path / "out", _overlay)
    assert result.bytes_read == result.plan.bytes_to_read  # what the plan said it reads, read once
    src, out = load_all(sources["instruct"]), load_all(tmp_path / "out")
    linears, experts = parts_of(src, torch.float8_e4m3fn), parts_of(src, torch.int8)
    assert linears and experts
    for p in linears:
        assert torch.equal(out[f"{p}.weight"].view(torch.uint8), src[f"{p}.weight"].view(torch.uint8))
        assert torch.equal(out[f"{p}.weight_scale"], torch.exp2(src[f"{p}.scale"].view(torch.uint8).float() - 127))
        assert f"{p}.scale" not in out
    for p in experts:
        assert out[f"{p}.weight_packed"].dtype == torch.uint8 == out[f"{p}.weight_scale"].dtype
        assert torch.equal(out[f"{p}.weight_packed"], src[f"{p}.weight"].view(torch.uint8))
        assert torch.equal(out[f"{p}.weight_scale"], src[f"{p}.scale"].view(torch.uint8))
    computed = record(tmp_path / "out")["serve"]["tensors"]
    assert computed == {
        f"{p}.weight_scale": {"transform": "e8m0_to_f32", "inputs": [f"{p}.scale"], "exact": True} for p in linears
    }


def test_a_route_of_copies_only_records_no_serve_object(sources: dict[str, Path], tmp_path: Path) -> None:
    # Base: F32 scales and FP8 experts, so the overlay only renames and relabels
    served(sources["base"], tmp_path / "out", _overlay)
    assert "tensors" not in record(tmp_path / "out")["serve"]  # the target is recorded, no tensor computed
    out = load_all(tmp_path / "out")
    assert out["mtp.0.ffn.experts.0.w1.weight_scale"].dtype == torch.float32


def _no_quantization_config(src: Path) -> ServeWith:
    layers = layer_map(bundled_plan(src))

    def serve_with(source: Source | None, plan: Plan) -> ServePlan:
        target = {k: v for k, v in plan.config.items() if k != "quantization_config"}
        native = standalone_draft_layout(plan.model_config)
        return registry.serve_plan(
            target, layers, native, "t/config.json", lambda m, **k: PlanError(m, kind="quant_carry", **k)
        )

    return serve_with


@pytest.mark.parametrize("variant", ["instruct", "base"])
def test_bf16_route_is_the_native_weights_bit_for_bit(sources: dict[str, Path], tmp_path: Path, variant: str) -> None:
    convert_serving(sources[variant], tmp_path / "out", _no_quantization_config(sources[variant]))
    src, out = load_all(sources[variant]), load_all(tmp_path / "out")
    for p in parts_of(src, torch.float8_e4m3fn) + parts_of(src, torch.int8):
        w, s = src[f"{p}.weight"], src[f"{p}.scale"]
        want = fp4_weight(w, s) if w.dtype == torch.int8 else fp8_weight(w, s, BLOCK)
        assert out[f"{p}.weight"].dtype == torch.bfloat16 and f"{p}.scale" not in out
        assert torch.equal(out[f"{p}.weight"].float().view(torch.int32), want.view(torch.int32)), p
    computed = record(tmp_path / "out")["serve"]["tensors"]
    assert {e["transform"] for e in computed.values()} == {"dequant_bf16"}
    assert all(e["exact"] and e["max_abs_error"] == e["rel_rms_error"] == 0.0 for e in computed.values())


def test_fp4_experts_into_fp8_blocks_are_exact(sources: dict[str, Path], tmp_path: Path) -> None:
    result = served(sources["instruct"], tmp_path / "out", _fp8_from_fp4)
    src, out = load_all(sources["instruct"]), load_all(tmp_path / "out")
    # a weight and its scale are one computation: its inputs are read once, as planned
    copied = sum(t.nbytes for t in result.plan.tensors if t.transform is None)
    inputs = sum(src[f"{p}.{leaf}"].nbytes for p in parts_of(src, torch.int8) for leaf in ("weight", "scale"))
    inputs += sum(src[f"{p}.scale"].nbytes for p in parts_of(src, torch.float8_e4m3fn))  # their e8m0_to_f32
    assert result.bytes_read == result.plan.bytes_to_read == copied + inputs
    for p in parts_of(src, torch.int8):
        weight, scale = out[f"{p}.weight"], out[f"{p}.weight_scale"]
        s = scale.repeat_interleave(128, 0)[: weight.shape[0]].repeat_interleave(128, 1)[:, : weight.shape[1]]
        assert weight.dtype == torch.float8_e4m3fn  # read as vLLM's FP8-block layer reads it
        assert torch.equal(
            (weight.float() * s).view(torch.int32), fp4_weight(src[f"{p}.weight"], src[f"{p}.scale"]).view(torch.int32)
        )
    computed = record(tmp_path / "out")["serve"]["tensors"]
    assert len(computed) == 2 * len(parts_of(src, torch.int8)) + len(parts_of(src, torch.float8_e4m3fn))
    assert all(e["exact"] for e in computed.values())


def test_a_block_fp8_cannot_hold_is_refused_naming_it_and_nothing_is_left(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", preset="tiny", variant="instruct")
    name = "mtp.0.ffn.experts.1.w2.scale"
    shard = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    raw = tensors[name].view(torch.uint8)
    raw[130, 1] = int(raw[128:256, :4].max()) - 15  # block (row 1, column 0) now spans 15 binades at least
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(PlanError) as caught:
        served(src, tmp_path / "out", _fp8_from_fp4)
    assert caught.value.kind == "inexact_transform"
    assert str(caught.value).startswith(
        "mtp.0.ffn.experts.1.w2.weight: 128x128 block (row 1, column 0) of mtp.0.ffn.experts.1.w2.weight: "
        "its E8M0 scale exponents span"
    )
    # no OUT, no partial directory: only the lock file every run leaves beside OUT
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "src"]


def test_requant_writes_the_targets_schemes_and_records_their_error(sources: dict[str, Path], tmp_path: Path) -> None:
    served(sources["instruct"], tmp_path / "out", _requant)
    src, out = load_all(sources["instruct"]), load_all(tmp_path / "out")
    computed = record(tmp_path / "out")["serve"]["tensors"]
    requantised = [
        p for p in parts_of(src, torch.float8_e4m3fn) + parts_of(src, torch.int8) if f"{p}.weight_packed" in out
    ]
    assert {next(v for k, v in MIXED.items() if p.endswith(k)) for p in requantised} == set(FORMATS)
    for p in requantised:
        w, s = src[f"{p}.weight"], src[f"{p}.scale"]
        want = fp4_weight(w, s) if w.dtype == torch.int8 else fp8_weight(w, s, BLOCK)
        read = FORMATS[next(v for k, v in MIXED.items() if p.endswith(k))][2]
        error = (read({k.removeprefix(f"{p}."): v for k, v in out.items() if k.startswith(f"{p}.")}) - want).abs()
        entry = computed[f"{p}.weight_packed"]
        assert entry["exact"] is False and entry["inputs"][:2] == [f"{p}.weight", f"{p}.scale"]
        assert entry["max_abs_error"] == pytest.approx(error.max().item(), rel=0.02), p
        assert 0.01 < entry["rel_rms_error"] < 0.2  # 4-bit round-to-nearest of a gaussian-like weight
    # one NVFP4 global scale per fused layer, 448 * 6 / the amax of both weights (generate_gparam)
    amax = max(
        fp8_weight(src[f"mtp.0.attn.{m}.weight"], src[f"mtp.0.attn.{m}.scale"], BLOCK).abs().max().item()
        for m in ("wq_a", "wkv")
    )
    for pair in (("attn.wq_a", "attn.wkv"), ("ffn.experts.1.w1", "ffn.experts.1.w3")):
        assert out[f"mtp.0.{pair[0]}.weight_global_scale"] == out[f"mtp.0.{pair[1]}.weight_global_scale"]
    assert out["mtp.0.attn.wkv.weight_global_scale"].item() == pytest.approx(448 * 6 / amax)


def test_an_interrupted_run_resumes_its_computed_tensors(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real, calls = transforms.compute, []

    def interrupted(*args: Any) -> transforms.Computed:
        calls.append(args[2])
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(transforms, "compute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        served(sources["instruct"], tmp_path / "out", _fp8_from_fp4)
    assert not (tmp_path / "out").exists()
    calls.clear()
    monkeypatch.setattr(transforms, "compute", lambda *args: calls.append(args[2]) or real(*args))
    assert served(sources["instruct"], tmp_path / "out", _fp8_from_fp4).status == "resumed"
    resumed = len(calls)
    calls.clear()
    assert served(sources["instruct"], tmp_path / "fresh", _fp8_from_fp4).status == "converted"
    assert resumed == len(calls) - 4  # the four finished computations were not redone
    # the same tensors, and the same measured errors (kept from the journal); the launch
    # commands name OUT, so they and the record of their sha256 differ by the directory
    named = ("serve/commands.sh", "conversion.json")
    resumed_tree, fresh_tree = (
        {f: d for f, d in tree_digest(tmp_path / o).items() if f not in named} for o in ("out", "fresh")
    )
    assert resumed_tree == fresh_tree
    assert record(tmp_path / "out")["serve"]["tensors"] == record(tmp_path / "fresh")["serve"]["tensors"]


@pytest.mark.parametrize(
    "output,said",
    [
        (
            Output(
                "mtp.0.attn.wq_b.weight",
                "BF16",
                (256, 128),
                "dequant_bf16",
                ("mtp.0.attn.wq_b.weight", "mtp.0.attn.wq_b.scale"),
            ),
            "makes BF16[512, 128], not BF16[256, 128]",
        ),
        (
            Output("mtp.0.attn.wq_b.weight", "F32", (512, 128), "e8m0_to_f32", ("mtp.0.attn.wq_b.weight",)),
            "takes one E8M0 scale, not ['F8_E4M3']",
        ),
        (
            Output("mtp.0.attn.wq_b.weight", "BF16", (512, 128), "hadamard", ("mtp.0.attn.wq_b.weight",)),
            "no transform 'hadamard'",
        ),
        (
            Output("mtp.0.attn.wq_b.weight", "BF16", (512, 128), "copy", ("mtp.0.attn.wq_b.weight",)),
            "is F8_E4M3[512, 128], not relabelled as BF16[512, 128]",
        ),
        (
            Output("mtp.0.attn.wq_b.weight", "BF16", (512, 128), "dequant_bf16", ("mtp.0.attn.wq_c.weight",)),
            "reads mtp.0.attn.wq_c.weight, no tensor of the native draft",
        ),
        (
            Output(
                "mtp.0.attn.wq_b.weight_packed",
                "U8",
                (512, 64),
                "requant.weight_packed",
                ("mtp.0.attn.wq_b.weight", "mtp.0.attn.wq_b.scale"),
                exact=False,
                args=(("format", "nvfp4-pack-quantized"), ("group_size", 32)),
            ),
            "nvfp4-pack-quantized takes groups of 16, not 32",
        ),
    ],
)
def test_an_output_its_transform_cannot_make_is_refused_before_anything_is_read(
    sources: dict[str, Path], tmp_path: Path, output: Output, said: str
) -> None:
    with pytest.raises(PlanError) as caught:
        served(sources["instruct"], tmp_path / "out", lambda part, native: [output] if part.endswith("wq_b") else [])
    assert caught.value.kind == "layout_mismatch" and said in str(caught.value)
    assert str(caught.value).startswith(f"{output.name}: model.layers.2.attn.wq_b built test takes it by ")
    assert not (tmp_path / "out").exists()
