"""A draft written for a serving target (any route) loads into the bundled model, each linear decoded
as the form it is held in says (model/storage.py HELD_LINEARS, convert/route_load.py): exact routes
give the native draft's logits bit for bit, a lossy one its agreement figures.

The held drafts are made here from a tiny native draft by the names contract the routes write
(until the converter writes them): CT FP8 block (the e4m3 bytes, E8M0 -> F32 as 2**(byte - 127)),
MXFP4 experts (the FP4 bytes as U8), bf16 (the repo's dequantisation), W4A16 and NVFP4A16
(compressed-tensors' own scale computation and compressors). Every logits comparison runs on the CPU.
"""

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from safetensors.torch import load_file, save_file

from dsv4.convert.check.run import run_checks
from dsv4.convert.cli.main import cli
from dsv4.convert.inmemory import match_target_figures, model_loader
from dsv4.convert.pipeline import convert
from dsv4.convert.route_load import decoded, native_linears
from dsv4.convert.schemes.base import module_of
from dsv4.convert.synth import write_checkpoint
from dsv4.model.checkpoint import INDEX_NAME, Checkpoint
from dsv4.model.dtypes import tensor_bytes
from dsv4.model.errors import LoadError
from dsv4.model.quantized import Bf16Linear, DecodedExperts, Fp8Linear, RoutedExperts, dequant_block, dequant_packed
from dsv4.model.record import CONVERSION_RECORD
from dsv4.model.smoke import draft_logits
from dsv4.model.storage import FP4, HELD_LINEARS

CPU = torch.device("cpu")
TOKENS = 6


def _f32_scale(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.float32:  # Base's FP8 scales are F32 already
        return scale
    return torch.exp2(scale.view(torch.uint8).float() - 127)  # E8M0 byte b means 2**(b - 127)


def _dequantised(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    if weight.dtype == torch.int8:
        return dequant_packed(weight, scale, FP4)
    return dequant_block(weight, scale, block)


def _ct(preset: str, weight: torch.Tensor, group: int | None = None) -> dict[str, torch.Tensor]:
    """`weight` [N, K] quantised into `preset` by compressed-tensors: its scale computation
    (per group min/max, NVFP4's global scale) and its compressor's pack."""
    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    g = group or args.group_size
    groups = weight.float().unflatten(-1, (-1, g))
    state = {"weight": weight}
    global_scale = None
    if preset == "NVFP4A16":
        global_scale = generate_gparam(weight.float().min(), weight.float().max())
        state["weight_global_scale"] = global_scale
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=global_scale)
    state["weight_scale"] = scale.to(torch.bfloat16) if preset == "W4A16" else scale
    state["weight_zero_point"] = zero_point
    fmt = {"W4A16": "pack-quantized", "NVFP4A16": "nvfp4-pack-quantized", "MXFP4A16": "mxfp4-pack-quantized"}[preset]
    return BaseCompressor.get_value_from_registry(fmt).compress(state, scheme)


def _fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """An FP4 expert's values as e4m3 blocks with F32 power-of-two scales: exact, since the codes of
    one block span few exponents (asserted)."""
    values = _dequantised(weight, scale, block).float()
    grid = values.unflatten(0, (-1, block[0])).unflatten(-1, (-1, block[1]))  # [rows/bn, bn, cols/bk, bk]
    amax = grid.abs().amax(dim=(1, 3)).clamp_min(torch.finfo(torch.float32).tiny)
    scales = torch.exp2(torch.ceil(torch.log2(amax / torch.finfo(torch.float8_e4m3fn).max)))
    fp8 = (grid / scales[:, None, :, None]).to(torch.float8_e4m3fn)
    assert torch.equal(fp8.float() * scales[:, None, :, None], grid), "not exact in FP8 blocks"
    return {"weight": fp8.reshape(values.shape), "weight_scale": scales}


def held_as(form: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A native linear's (weight, scale) as the leaves of `form`, by the names contract."""
    if form == "fp4-as-fp8-block":
        return _fp8_blocks(weight, scale, block)
    if form == "ct-fp8-block":
        return {"weight": weight, "weight_scale": _f32_scale(scale)}
    if form == "ct-mxfp4":
        return {"weight_packed": weight.view(torch.uint8), "weight_scale": scale.view(torch.uint8)}
    if form == "bf16":
        return {"weight": _dequantised(weight, scale, block)}
    return _ct(form, _dequantised(weight, scale, block))


def write_held(native_draft: Path, out: Path, form_of: Callable[[str], str]) -> Path:
    """`native_draft` rewritten with each native linear held as `form_of(module)` says; every other
    tensor and config.json as they are."""
    cfg = Checkpoint(native_draft).model_config
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(native_draft.glob("*.safetensors")):
        tensors.update(load_file(shard))
    linears = native_linears(cfg)
    held = {n: t for n, t in tensors.items() if module_of(n) not in linears}
    for m in linears:
        leaves = held_as(form_of(m), tensors[f"{m}.weight"], tensors[f"{m}.scale"], cfg.weight_block_size)
        held.update({f"{m}.{leaf}": t.contiguous() for leaf, t in leaves.items()})
    out.mkdir(parents=True)
    shard = "model-00001-of-00001.safetensors"
    save_file(held, out / shard)
    index = {"metadata": {"total_size": sum(t.nbytes for t in held.values())}, "weight_map": dict.fromkeys(held, shard)}
    (out / INDEX_NAME).write_text(json.dumps(index))
    (out / "config.json").write_bytes((native_draft / "config.json").read_bytes())
    # conversion.json: the native draft's, listing the held tensors (what the routes' record is to list)
    record = json.loads((native_draft / CONVERSION_RECORD).read_text())
    record["tensors"] = {
        name: {"file": shard, "nbytes": t.nbytes, "sha256": hashlib.sha256(tensor_bytes(t)).hexdigest()}
        for name, t in held.items()
    }
    (out / CONVERSION_RECORD).write_text(json.dumps(record))
    return out


def is_expert(module: str) -> bool:
    return ".ffn.experts." in module


ROUTES: dict[str, Callable[[str, str], str]] = {
    # overlay: FP8-block linears; MXFP4 experts (instruct) or FP8-block ones with F32 scales (Base)
    "overlay": lambda m, variant: "ct-mxfp4" if is_expert(m) and variant == "instruct" else "ct-fp8-block",
    # bf16: every linear dequantised, wo_a kept in an FP8-block group
    "bf16": lambda m, variant: "ct-fp8-block" if m.endswith(".attn.wo_a") else "bf16",
    # match-target beside a CT FP8-block target: FP4 experts re-expressed, exactly, as FP8 blocks
    "fp8-block": lambda m, variant: "fp4-as-fp8-block" if is_expert(m) and variant == "instruct" else "ct-fp8-block",
    "w4a16": lambda m, variant: "W4A16",
    "nvfp4a16": lambda m, variant: "NVFP4A16",
    # an MXFP4 target: the experts' bytes copied, the FP8 linears requantised into MXFP4
    "mxfp4": lambda m, variant: "ct-mxfp4" if is_expert(m) else "MXFP4A16",
}


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """(variant, route) -> a tiny draft directory held by that route ("native": the native draft, "source":
    the native checkpoint it is converted from)."""
    root = tmp_path_factory.mktemp("held")
    made: dict[tuple[str, str], Path] = {}

    def draft(variant: str, route: str) -> Path:
        if (variant, route) not in made:
            if route == "source":
                made[variant, route] = write_checkpoint(root / variant / route, preset="tiny", variant=variant, seed=0)
            elif route == "native":
                convert(draft(variant, "source"), root / variant / route, target="draft")
                made[variant, route] = root / variant / route
            else:
                form = ROUTES[route]
                kind = "instruct" if variant == "dspark" else variant  # DSpark: an instruct release
                made[variant, route] = write_held(
                    draft(variant, "native"), root / variant / route, lambda m: form(m, kind)
                )
        return made[variant, route]

    return draft


def _logits(path: Path) -> torch.Tensor:
    load = model_loader(path)
    assert load is not None
    return draft_logits(load, CPU, TOKENS)


@pytest.mark.parametrize(
    ("variant", "route"),
    [("instruct", "overlay"), ("base", "overlay"), ("instruct", "bf16"), ("base", "bf16"), ("instruct", "fp8-block")],
)
def test_an_exact_route_gives_the_native_drafts_logits_bit_for_bit_on_the_cpu(drafts, variant, route):
    native, held = _logits(drafts(variant, "native")), _logits(drafts(variant, route))
    assert torch.equal(held, native)


def _dspark_base_logits(path: Path) -> torch.Tensor:
    model = model_loader(path)(CPU)
    cfg = model.config
    features = torch.randn(TOKENS, cfg.dspark_stages * cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    context = torch.arange(TOKENS)
    ids, positions = model.block_ids(3), model.block_positions(context)
    return model.base_logits(model.hidden_states(features.bfloat16(), context, ids, positions))


def test_a_dspark_drafter_by_overlay_gives_the_native_base_logits_bit_for_bit(drafts):
    # its stages' linears and experts go through the same held forms as an MTP block's
    assert torch.equal(
        _dspark_base_logits(drafts("dspark", "overlay")), _dspark_base_logits(drafts("dspark", "native"))
    )


def test_each_form_is_kept_in_the_models_container_for_it_or_decoded(drafts):
    overlay = model_loader(drafts("instruct", "overlay"))(CPU)
    layer = overlay.model.layers["2"]
    assert isinstance(layer.e_proj, Fp8Linear) and layer.e_proj.weight_scale_inv.dtype == torch.float32
    experts = layer.mtp_block.ffn.experts.routed_experts
    assert isinstance(experts, RoutedExperts) and experts.storage.name == "fp4"
    bf16 = model_loader(drafts("instruct", "bf16"))(CPU).model.layers["2"]
    assert isinstance(bf16.mtp_block.attn.fused_wqa_wkv, Bf16Linear)
    assert isinstance(bf16.mtp_block.attn.wo_a, Fp8Linear)  # wo_a keeps its FP8-block group
    assert isinstance(bf16.mtp_block.ffn.experts.routed_experts, DecodedExperts)  # one expert at a time
    fp8 = model_loader(drafts("instruct", "fp8-block"))(CPU).model.layers["2"].mtp_block.ffn.experts.routed_experts
    assert isinstance(fp8, RoutedExperts) and fp8.storage.name == "fp8"  # an instruct draft's experts in FP8 blocks


@pytest.mark.parametrize(
    ("form", "module", "preset", "fmt"),
    [
        ("ct-fp8-block", "mtp.0.attn.wq_b", "FP8_BLOCK", "float-quantized"),
        ("ct-mxfp4", "mtp.0.ffn.experts.5.w2", "MXFP4A16", "mxfp4-pack-quantized"),
    ],
)
def test_an_exact_ct_form_decodes_as_compressed_tensors_decompresses_it(drafts, form, module, preset, fmt):
    # the repo's own decoding of the e4m3 blocks and of the e2m1 nibbles (the low one the even input,
    # DeepSeek's order) against the library's: the same bf16 values
    draft = drafts("instruct", "overlay")
    cfg = Checkpoint(draft).model_config
    held = {x.name: t for x in HELD_LINEARS[form].leaves for t in [_tensors(draft)[f"{module}.{x.name}"]]}
    theirs = BaseCompressor.get_value_from_registry(fmt).decompress(
        dict(held), preset_name_to_scheme(preset, ["Linear"])
    )
    assert torch.equal(decoded(HELD_LINEARS[form], held, cfg, HELD_LINEARS[form].group), theirs["weight"].bfloat16())


def _tensors(draft: Path) -> dict[str, torch.Tensor]:
    return load_file(draft / "model-00001-of-00001.safetensors")


def _rewritten(src: Path, out: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    tensors = _tensors(src)
    edit(tensors)
    out.mkdir()
    save_file(tensors, out / "model.safetensors")  # one file, no index
    (out / "config.json").write_bytes((src / "config.json").read_bytes())
    return out


@pytest.mark.parametrize(
    ("edit", "kind", "tensor"),
    [
        (lambda t: t.pop("mtp.0.attn.wq_a.weight_scale"), "missing_key", "mtp.0.attn.wq_a.weight_scale"),
        (
            lambda t: t.update({"mtp.0.attn.wq_a.input_scale": torch.ones(1)}),
            "unexpected_key",
            "mtp.0.attn.wq_a.input_scale",
        ),
        (lambda t: t.update({"mtp.0.stray": torch.ones(1)}), "unexpected_key", "mtp.0.stray"),
        (lambda t: t.pop("mtp.0.attn.attn_sink"), "missing_key", "mtp.0.attn.attn_sink"),
        (
            lambda t: t.update({"mtp.0.attn.wq_a.weight_scale": t["mtp.0.attn.wq_a.weight_scale"].bfloat16()}),
            "dtype_mismatch",
            "mtp.0.attn.wq_a.weight_scale",
        ),
        (
            lambda t: t.update({"mtp.0.attn.wq_b.weight_scale": t["mtp.0.attn.wq_b.weight_scale"][:1]}),
            "shape_mismatch",
            "mtp.0.attn.wq_b.weight_scale",
        ),
    ],
)
def test_a_held_draft_is_loaded_strictly_a_refusal_naming_the_tensor(drafts, tmp_path, edit, kind, tensor):
    broken = _rewritten(drafts("instruct", "overlay"), tmp_path / "broken", edit)
    with pytest.raises(LoadError) as err:
        model_loader(broken)(CPU)
    assert err.value.kind == kind
    assert tensor in str(err.value) and str(broken) in str(err.value)


@pytest.mark.parametrize("route", ["overlay", "bf16", "w4a16", "nvfp4a16", "mxfp4"])
def test_every_routes_draft_is_refused_without_a_leaf_or_with_an_extra_one(drafts, tmp_path, route):
    held = drafts("instruct", route)
    last = sorted(n for n in _tensors(held) if n.startswith("mtp.0.attn.wq_b."))[-1]
    without = _rewritten(held, tmp_path / "without", lambda t: t.pop(last))
    # the leaf by name; a bf16 linear without its one tensor, the linear
    named = re.escape(last) if route != "bf16" else r"mtp\.0\.attn\.wq_b\.\*"
    with pytest.raises(LoadError, match=f"missing tensors? (.* or )?{named}") as err:
        model_loader(without)(CPU)
    assert err.value.kind == "missing_key"
    extra = "mtp.0.attn.wq_b.input_global_scale"
    more = _rewritten(held, tmp_path / "more", lambda t: t.update({extra: torch.ones(1)}))
    with pytest.raises(LoadError, match=f"unexpected tensor {re.escape(extra)}") as err:
        model_loader(more)(CPU)
    assert err.value.kind == "unexpected_key"


def test_a_layer_whose_parts_are_held_in_different_forms_is_refused_naming_the_layer(drafts, tmp_path):
    def half_bf16(m: str, variant: str = "instruct") -> str:
        return "bf16" if m.endswith(".attn.wkv") else ROUTES["overlay"](m, variant)

    mixed = write_held(drafts("instruct", "native"), tmp_path / "mixed", half_bf16)
    with pytest.raises(LoadError, match=r"fused_wqa_wkv holds its parts in different forms"):
        model_loader(mixed)(CPU)


# A lossy draft: round-to-nearest into 4 bits of weights whose native values are themselves 4-bit
# (FP4 experts) or 8-bit, on random tiny weights. Bounds (measured on this fixture, with margin):
# the relative RMS of the logits' difference within 20% (measured 11-13%), and where the native top-2 margin is
# decisive (above 1% of max|logit|), top-1 agreement at least 0.5.
@pytest.mark.parametrize("route", ["w4a16", "nvfp4a16", "mxfp4"])
def test_a_lossy_draft_reports_its_top1_agreement_and_logits_error(drafts, route):
    figures = match_target_figures(drafts("instruct", route), drafts("instruct", "native"), tokens=TOKENS)
    assert figures["device"] == "cpu" and figures["rows"] == TOKENS
    assert 0 < figures["logits_rel_rms"] < 0.2
    assert figures["logits_max_abs_diff"] > 0  # lossy: not the native logits
    assert figures["rows_compared"] >= 1 and figures["top1_agreement"] >= 0.5
    assert json.loads(json.dumps(figures, allow_nan=False)) == figures  # conversion.json can record them as they are


def test_check_native_runs_the_bundled_model_on_a_held_draft(drafts):
    report = run_checks(drafts("base", "overlay"), native=drafts("base", "source"), device="cpu", quiet=True)
    status = {r.name: (r.status, r.reason) for r in report.results}
    assert status["layout"][0] == "pass"
    assert "34 linears held as 34 ct-fp8-block," in status["layout"][1]  # Base: FP8-block experts too
    assert status["smoke"][0] == "pass" and status["native"][0] == "pass", status


def test_smoke_native_runs_on_a_held_draft_from_the_command_line(drafts):
    held, source = drafts("instruct", "overlay"), drafts("instruct", "source")
    result = CliRunner().invoke(cli, ["smoke", str(held), "--device", "cpu", "--tokens", "4", "--native", str(source)])
    assert result.exit_code == 0, result.output
    assert f"smoke: {held} on cpu" in result.output and "top-1 agreement 1.000" in result.output
