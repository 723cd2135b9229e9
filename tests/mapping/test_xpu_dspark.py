"""DeepSeek-V4-Flash-0731 (the DSpark drafter) converted to vLLM 0.33.0's XPU DSpark layout
(mapping/README.md#xpu-dspark-layout): the table is chosen from the checkpoint itself, every parameter comes from
the stage mapping/README.md#dspark-v4-flash-0731 names, the round trip gives the native bytes back, `plan`, `check` and
`batch` know the layout, and every malformed DSpark checkpoint is refused with its code."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from dspark_fixtures import write_half_dspark
from inprocess import run_main
from quant_configs import FP8_BLOCK, INT4_GROUP
from tensors import load_all

from dsv4.convert import quant_config as quant
from dsv4.convert.check.run import run_checks
from dsv4.convert.choose import choose_table
from dsv4.convert.exit_codes import exit_code
from dsv4.convert.pipeline import convert
from dsv4.convert.plan import plan_conversion, plan_reverse
from dsv4.convert.sources.inventory import Inventory, read_inventory
from dsv4.convert.synth import write_checkpoint
from dsv4.mapping import errors as mapping_errors
from dsv4.mapping.table import TABLE_DIR, load_table, load_table_file
from dsv4.model import errors as model_errors
from dsv4.model.config import ModelConfig
from dsv4.model.layout import build_draft_model, target_layout
from dsv4.model.presets import DSPARK_FIELDS, preset_config

S = 3  # tiny DSpark: three stages, like the release


def spec04_sources(cfg: ModelConfig) -> dict[str, list[str]]:
    """mapping/README.md#xpu-dspark-layout written out for the tests: each parameter -> its native sources, in the
    order their bytes follow one another (concat: the parts; stack: expert by expert)."""
    last = f"mtp.{cfg.dspark_stages - 1}."
    out = {
        "model.embed_tokens.weight": ["embed.weight"],
        "lm_head.weight": ["head.weight"],
        "model.main_proj.weight": ["mtp.0.main_proj.weight"],
        "model.main_proj.weight_scale_inv": ["mtp.0.main_proj.scale"],
        "model.main_norm.weight": ["mtp.0.main_norm.weight"],
        "model.norm.weight": [f"{last}norm.weight"],
        "model.hc_head_fn": [f"{last}hc_head_fn"],
        "model.hc_head_base": [f"{last}hc_head_base"],
        "model.hc_head_scale": [f"{last}hc_head_scale"],
        "model.markov_head.markov_w1.weight": [f"{last}markov_head.markov_w1.weight"],
        "model.markov_head.markov_w2.weight": [f"{last}markov_head.markov_w2.weight"],
    }
    E = cfg.n_routed_experts
    for s in range(cfg.dspark_stages):
        b, m = f"model.layers.{s}.", f"mtp.{s}."
        for same in (
            "hc_attn_fn",
            "hc_attn_base",
            "hc_attn_scale",
            "hc_ffn_fn",
            "hc_ffn_base",
            "hc_ffn_scale",
            "attn_norm.weight",
            "ffn_norm.weight",
            "attn.attn_sink",
            "attn.q_norm.weight",
            "attn.kv_norm.weight",
            "ffn.gate.weight",
        ):
            out[b + same] = [m + same]
        for lin in ("attn.wq_b", "attn.wo_a", "attn.wo_b"):
            out[f"{b}{lin}.weight"] = [f"{m}{lin}.weight"]
            out[f"{b}{lin}.weight_scale_inv"] = [f"{m}{lin}.scale"]
        out[b + "ffn.gate.e_score_correction_bias"] = [m + "ffn.gate.bias"]
        out[b + "attn.fused_wqa_wkv.weight"] = [m + "attn.wq_a.weight", m + "attn.wkv.weight"]
        out[b + "attn.fused_wqa_wkv.weight_scale_inv"] = [m + "attn.wq_a.scale", m + "attn.wkv.scale"]
        sh = m + "ffn.shared_experts."
        out[b + "ffn.shared_experts.gate_up_proj.weight"] = [sh + "w1.weight", sh + "w3.weight"]
        out[b + "ffn.shared_experts.gate_up_proj.weight_scale_inv"] = [sh + "w1.scale", sh + "w3.scale"]
        out[b + "ffn.shared_experts.down_proj.weight"] = [sh + "w2.weight"]
        out[b + "ffn.shared_experts.down_proj.weight_scale_inv"] = [sh + "w2.scale"]
        r, x = b + "ffn.experts.routed_experts.", m + "ffn.experts."
        out[r + "w13_weight"] = [f"{x}{e}.{w}.weight" for e in range(E) for w in ("w1", "w3")]
        out[r + "w13_weight_scale"] = [f"{x}{e}.{w}.scale" for e in range(E) for w in ("w1", "w3")]
        out[r + "w2_weight"] = [f"{x}{e}.w2.weight" for e in range(E)]
        out[r + "w2_weight_scale"] = [f"{x}{e}.w2.scale" for e in range(E)]
    return out


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


def edit_config(ckpt: Path, edit) -> Path:
    config = json.loads((ckpt / "config.json").read_text())
    edit(config)
    (ckpt / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ckpt


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp("dspark") / "native", preset="tiny", variant="dspark", main_layers="all", seed=3
    )


@pytest.fixture(scope="module")
def xpu(native: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(native, tmp_path_factory.mktemp("dspark-xpu") / "out").out


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_dict(preset_config("tiny", "dspark"))


# --- the table: chosen from the checkpoint ------------------------------------------------
def test_the_plan_picks_the_table_of_the_drafter_the_checkpoint_holds(native: Path, tiny_native: Path) -> None:
    assert choose_table("xpu", read_inventory(native)).name == "xpu_dspark"
    assert choose_table("xpu", read_inventory(tiny_native)).name == "xpu"


@pytest.mark.parametrize("which", ["dspark", "mtp"])
def test_plan_says_which_layout(
    which: str, native: Path, tiny_native: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(monkeypatch, capsys, "plan", native if which == "dspark" else tiny_native)
    assert code == 0, err
    first, layout = out.splitlines()[:2]
    assert ("(table xpu_dspark v1)" if which == "dspark" else "(table xpu v1)") in first
    assert layout.split()[2] == ("DSpark" if which == "dspark" else "MTP"), layout
    code, out, _ = run_main(monkeypatch, capsys, "plan", native, "--json")
    summary = json.loads(out)
    # one shape for plan --json and conversion.json: flat table and table_version (was "xpu_dspark v1")
    assert (
        summary["table"],
        summary["table_version"],
        summary["target"],
        summary["drafter"],
        summary["tensors_out"],
    ) == ("xpu_dspark", "1", "xpu", "dspark", 98)


def test_planning_and_converting_a_dspark_checkpoint_import_no_torch_once_the_layouts_are_cached(
    native: Path, tmp_path: Path
) -> None:
    from child_imports import imported_by

    imported_by("plan", str(native))  # fills this session's layout cache if it is not yet
    assert imported_by("plan", str(native)) == []
    assert imported_by(str(native), str(tmp_path / "out"), "-q") == []


def test_both_tables_share_the_v4_block_rules() -> None:
    mtp, dspark = load_table("xpu"), load_table("xpu_dspark")

    def block(table, src: str, dst: str) -> set[tuple]:
        return {
            (r.op, tuple(s.removeprefix(src) for s in r.sources), (r.target or "").removeprefix(dst), r.when)
            for r in table.rules
            if r.sources[0].startswith(src) and (r.target or "").startswith(dst)
        }

    shared = block(mtp, "mtp.{i}.", "model.layers.{L}.mtp_block.")
    assert len(shared) == 25 + 4 + 4  # 21 renames + 4 concats, then 4 routed-expert stacks for each expert dtype
    assert block(dspark, "mtp.{s}.", "model.layers.{s}.") == shared


def dspark_table_with(tmp_path: Path, old: str, new: str) -> Path:
    text = (TABLE_DIR / "xpu_dspark.toml").read_text()
    assert old in text
    path = tmp_path / "variant.toml"
    path.write_text(text.replace(old, new))
    return path


def test_a_rule_naming_a_stage_needs_no_stage_in_its_target_but_a_per_stage_rule_does(tmp_path: Path) -> None:
    # {last} binds one stage; {s} in the source but not the target: S sources, one parameter
    bad = dspark_table_with(
        tmp_path, '"mtp.{last}.norm.weight" = "model.norm.weight"', '"mtp.{s}.norm.weight" = "model.norm.weight"'
    )
    with pytest.raises(
        mapping_errors.TableError, match=r"source placeholder\(s\) \['s'\] do not appear in the target"
    ) as raised:
        load_table_file(bad)
    assert raised.value.kind == "unbound_placeholder"


def test_a_table_binds_only_its_own_drafters_block_placeholders(tmp_path: Path) -> None:
    bad = dspark_table_with(
        tmp_path,
        '"mtp.{last}.norm.weight" = "model.norm.weight"',
        '"mtp.{i}.norm.weight" = "model.layers.{L}.norm.weight"',
    )
    with pytest.raises(
        mapping_errors.TableError,
        match=r"placeholder \{L\} belongs to the other drafter kind; a dspark table binds \['first', 'last', 's'\]",
    ) as raised:
        load_table_file(bad)
    assert raised.value.kind == "unbound_placeholder"


@pytest.mark.parametrize(
    "old, new",
    [
        ('"mtp.{last}.norm.weight"', '"mtp.{first}.norm.weight"'),
        ('"mtp.{first}.main_proj.scale"', '"mtp.{last}.main_proj.scale"'),
    ],
)
def test_a_rule_for_a_tensor_of_another_stage_is_a_dead_rule(tmp_path: Path, old: str, new: str) -> None:
    """norm.weight is the last stage's and main_proj stage 0's (mapping/README.md#dspark-source-checkpoint): a rule
    pinned to the other stage can never fire, and the loader says so."""
    with pytest.raises(
        mapping_errors.TableError, match=rf"source pattern {re.escape(new.strip(chr(34)))} matches no tensor"
    ) as raised:
        load_table_file(dspark_table_with(tmp_path, old, new))
    assert raised.value.kind == "dead_rule"


@pytest.mark.parametrize("name", ["../xpu", "nope", "/work/x"])
def test_an_include_is_named_never_a_path(tmp_path: Path, name: str) -> None:
    # two includes are installed since --target draft (v4_block_native: the block in native names),
    # three since the DSpark tables share their skips and refusals (dspark_skip_refuse), four since the
    # V4.1 tables share theirs (dspark_v41_skip_refuse)
    with pytest.raises(
        mapping_errors.TableError,
        match=rf"\[\[include\]\] file '{re.escape(name)}' is not an installed include \(installed: "
        rf"dspark_skip_refuse, dspark_v41_skip_refuse, v4_block, v4_block_native\)",
    ):
        load_table_file(dspark_table_with(tmp_path, 'file = "v4_block"', f'file = "{name}"'))


def test_an_include_names_exactly_file_source_and_target(tmp_path: Path) -> None:
    with pytest.raises(
        mapping_errors.TableError, match=r"\[\[include\]\] needs exactly the strings \['file', 'source', 'target'\]"
    ):
        load_table_file(dspark_table_with(tmp_path, 'file = "v4_block"', 'file = "v4_block"\nprefix = "x"'))


def test_an_include_with_the_wrong_prefix_writes_parameters_the_model_lacks(tmp_path: Path) -> None:
    bad = dspark_table_with(tmp_path, 'target = "model.layers.{s}."', 'target = "model.layers.{s}.mtp_block."')
    with pytest.raises(
        mapping_errors.TableError, match=r"model.layers.0.mtp_block.hc_attn_fn is not a parameter"
    ) as raised:
        load_table_file(bad)
    assert raised.value.kind == "unknown_target"


# --- values -------------------------------------------------------------------------------
def test_plan_is_spec_04_and_the_models_layout(native: Path, cfg: ModelConfig) -> None:
    plan = plan_conversion(read_inventory(native), load_table("xpu_dspark"))
    spec = spec04_sources(cfg)
    assert len(spec) == 98
    assert {t.name: [p.name for p in t.pieces] for t in plan.tensors} == spec
    assert {t.name: (t.dtype, t.shape) for t in plan.tensors} == target_layout(cfg)
    assert plan.skipped["mtp.2.confidence_head.proj.weight"].startswith("confidence head: NVIDIA only")
    skipped_top = {k for k in plan.skipped if not k.startswith(("layers.", "mtp."))}
    assert skipped_top == {"norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}
    consumed = [p.name for t in plan.tensors for p in t.pieces]
    assert len(consumed) == len(set(consumed))  # every source read once
    assert set(consumed) | set(plan.skipped) == set(read_inventory(native).tensors)


@pytest.mark.slow
def test_planning_the_full_size_0731_replica_gives_spec_04s_98_parameters(tmp_path: Path) -> None:
    """mapping/README.md#xpu-dspark-layout at 0731 size: 98 parameters, 12,980,953,116 bytes, read from the embed
    shard, the head shard and the three stage shards only."""
    ckpt = write_checkpoint(tmp_path / "0731", preset="flash", variant="dspark", main_layers="all", sparse=True)
    inv = read_inventory(ckpt)
    plan = plan_conversion(inv, choose_table("xpu", inv))
    assert (plan.table, len(plan.tensors), plan.bytes_to_write) == ("xpu_dspark", 98, 12_980_953_116)
    assert plan.files_needed == [f"model-000{k:02d}-of-00048.safetensors" for k in (1, 45, 46, 47, 48)]
    assert {t.name: (t.dtype, t.shape) for t in plan.tensors} == target_layout(ModelConfig.from_dict(inv.config))


def test_every_output_tensor_is_its_sources_bytes_from_the_stage_spec_04_names(
    native: Path, xpu: Path, cfg: ModelConfig
) -> None:
    n, x = load_all(native), load_all(xpu)
    spec = spec04_sources(cfg)
    assert set(x) == set(spec)
    for name, sources in spec.items():
        assert torch.equal(raw(x[name]), torch.cat([raw(n[s]) for s in sources])), name
    # each stage's values are its own: a stage mix-up (model.layers.{s} from mtp.{s'}) would fail above
    for leaf in ("attn_norm.weight", "attn.attn_sink", "attn.wq_b.weight", "ffn.experts.0.w1.weight"):
        values = [raw(n[f"mtp.{s}.{leaf}"]) for s in range(S)]
        assert all(not torch.equal(values[a], values[b]) for a in range(S) for b in range(a + 1, S)), leaf
    # dtypes as vLLM registers them: FP8 scales keep E8M0, FP4 experts are raw uint8
    assert x["model.main_proj.weight"].dtype == torch.float8_e4m3fn
    assert x["model.main_proj.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    assert x["model.layers.1.ffn.experts.routed_experts.w13_weight_scale"].dtype == torch.uint8
    config = json.loads((xpu / "config.json").read_text())
    assert config["dsv4_convert"]["table"] == "xpu_dspark" and config["dsv4_convert"]["layout"] == "xpu"
    assert {k: config[k] for k in DSPARK_FIELDS} == {k: preset_config("tiny", "dspark")[k] for k in DSPARK_FIELDS}


def test_native_to_xpu_to_native_gives_the_drafters_bytes_back(native: Path, xpu: Path, tmp_path: Path) -> None:
    back = convert(xpu, tmp_path / "back", reverse=True).out
    n, b = load_all(native), load_all(back)
    drafter = {k for k in n if k.startswith("mtp.")} - {
        "mtp.2.confidence_head.proj.weight"
    }  # skipped: not in the XPU model
    assert set(b) == drafter | {"embed.weight", "head.weight"}
    for name, t in b.items():
        assert t.dtype == n[name].dtype and t.shape == n[name].shape and torch.equal(raw(t), raw(n[name])), name
    # and forward again: the same output bytes
    again = convert(back, tmp_path / "again").out
    shards = sorted(p.name for p in xpu.glob("*.safetensors"))
    assert shards == sorted(p.name for p in again.glob("*.safetensors"))
    assert all((xpu / s).read_bytes() == (again / s).read_bytes() for s in shards)


# --- check --------------------------------------------------------------------------------
def test_check_passes_a_converted_dspark_checkpoint(xpu: Path) -> None:
    report = run_checks(xpu)
    status = {r.name: r.status for r in report.results}
    assert report.ok, report.summary()
    assert all(status[c] == "pass" for c in ("index", "readable", "sizes", "checksums", "config", "layout", "quant")), (
        status
    )
    config = next(r for r in report.results if r.name == "config")
    assert "DSpark stage layer(s) [0, 1, 2]" in config.reason and config.details["table"] == "xpu_dspark"


@pytest.mark.slow
def test_check_smoke_and_native_parity_on_a_dspark_checkpoint(native: Path, xpu: Path) -> None:
    # The 4-token context check used by default when this test was written, on which the
    # draft chain is decisive. (Check's default is now smoke's 8, whose context has a
    # near-tie at position 1: there the verdict forgives a flip, tested below.)
    report = run_checks(xpu, native=native, fast=True, tokens=4)
    results = {r.name: r for r in report.results}
    assert report.ok and results["smoke"].status == results["native"].status == "pass", report.summary()
    assert "one DSpark block" in results["smoke"].reason and len(results["smoke"].details["draft_tokens"]) == 5
    assert results["native"].details["draft_tokens"] == results["native"].details["reference_draft_tokens"]
    default = run_checks(xpu, native=native, fast=True)
    assert default.ok and default.result("native").details["top1_agreement_up_to_ties"] == 1.0, default.summary()


def copy_tree(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_check_refuses_a_dspark_output_recorded_as_the_mtp_table(xpu: Path, tmp_path: Path) -> None:
    out = edit_config(copy_tree(xpu, tmp_path / "out"), lambda c: c["dsv4_convert"].update(table="xpu"))
    record = json.loads((out / "conversion.json").read_text())
    (out / "conversion.json").write_text(
        json.dumps({**record, "table": "xpu"})
    )  # both records agree, on the wrong table
    report = run_checks(out, fast=True)
    assert (report.failures[0].name, report.exit_code) == ("config", 75)
    assert "maps mtp drafters" in report.failures[0].reason


def test_check_finds_stages_that_disagree_with_the_config(xpu: Path, tmp_path: Path) -> None:
    def two_stages(c: dict[str, Any]) -> None:
        c.update(dspark_target_layer_ids=[0, 1], compress_ratios=c["compress_ratios"][:-1])

    out = edit_config(copy_tree(xpu, tmp_path / "out"), two_stages)
    report = run_checks(out, fast=True)
    assert (report.failures[0].name, report.exit_code) == ("config", 75)
    assert "DSpark stage layer(s) [0, 1], but the tensors hold layer(s) [0, 1, 2]" in report.failures[0].reason


def test_quantisation_layer_names_of_the_dspark_draft(cfg: ModelConfig) -> None:
    names = {layer.name for layer in quant.draft_layers(build_draft_model(cfg))}
    assert "" not in names
    assert {"model.main_proj", "model.embed_tokens", "lm_head"} <= names
    for L in range(cfg.num_hidden_layers, cfg.num_hidden_layers + S):  # vLLM's layer prefix of stage s: N + s
        assert {
            f"model.layers.{L}.attn.fused_wqa_wkv",
            f"model.layers.{L}.attn.wq_b",
            f"model.layers.{L}.ffn.shared_experts.gate_up_proj",
            f"model.layers.{L}.ffn.experts",
        } <= names


def test_a_compressed_tensors_config_is_carried_to_the_dspark_layer_names(tmp_path: Path) -> None:
    pytest.importorskip("compressed_tensors.utils.match")
    qc: dict[str, Any] = {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "config_groups": {
            "experts": {
                "targets": [r"re:^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]$"],
                "weights": INT4_GROUP,
                "format": "pack-quantized",
            },
            "fp8": {
                "targets": [
                    r"re:^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123]|main_proj)$"
                ],
                "weights": FP8_BLOCK,
                "format": "float-quantized",
            },
        },
        "ignore": ["head", "embed", r"re:.*ffn\.gate$", r"re:.*markov_head\..*"],
    }
    native = write_checkpoint(tmp_path / "native", preset="tiny", variant="dspark")
    edit_config(native, lambda c: c.update(quantization_config=qc))
    out = convert(native, tmp_path / "out").out
    carried = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.main_proj" in carried["config_groups"]["fp8"]["targets"]
    N = json.loads((out / "config.json").read_text())["num_hidden_layers"]  # stage s: vLLM's layer prefix N + s
    assert {f"model.layers.{N + s}.attn.fused_wqa_wkv" for s in range(S)} <= set(
        carried["config_groups"]["fp8"]["targets"]
    )
    assert {f"model.layers.{N + s}.ffn.experts" for s in range(S)} == set(
        carried["config_groups"]["experts"]["targets"]
    )
    assert "lm_head" in carried["ignore"]
    quant_check = next(r for r in run_checks(out, fast=True).results if r.name == "quant")
    assert quant_check.status == "pass", quant_check.reason


# --- refusals (mapping/README.md#xpu-dspark-layout) ---------------------------------------
def with_tensors(inv: Inventory, add: dict[str, str] | None = None, drop: str | None = None) -> Inventory:
    """`inv` with tensors added (new name -> the existing tensor whose place it takes) or
    every tensor under prefix `drop` removed: what the planner sees, no file rewritten."""
    tensors = {k: v for k, v in inv.tensors.items() if drop is None or not k.startswith(drop)}
    tensors.update({new: dataclasses.replace(inv.tensors[like], name=new) for new, like in (add or {}).items()})
    return dataclasses.replace(inv, tensors=tensors)


def refusal(inv: Inventory) -> model_errors.DSV4Error:
    with pytest.raises(model_errors.DSV4Error) as info:
        plan_conversion(inv, choose_table("xpu", inv))
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize(
    "add, words",
    [
        ({"mtp.1.e_proj.weight": "mtp.1.attn.wq_a.weight"}, "mtp.1.e_proj.weight: an MTP block's e_proj"),
        ({"mtp.0.hnorm.weight": "mtp.0.main_norm.weight"}, "mtp.0.hnorm.weight: an MTP block's hnorm"),
        ({"mtp.2.head.weight": "head.weight"}, "mtp.2.head.weight: an MTP block's head"),
        ({"mtp.2.emb.tok_emb.weight": "embed.weight"}, "mtp.2.emb.tok_emb.weight: an MTP block's emb"),
        (
            {"mtp.3.attn_norm.weight": "mtp.2.attn_norm.weight"},
            "mtp.3.attn_norm.weight: index 3 but config.json has DSpark stages",
        ),
        # vLLM would take these from whatever stage it finds them in (last write wins)
        (
            {"mtp.0.norm.weight": "mtp.2.norm.weight"},
            "mtp.0.norm.weight: only the last stage mtp.2 holds this tensor, not stage 0",
        ),
        ({"mtp.1.markov_head.markov_w1.weight": "mtp.2.markov_head.markov_w1.weight"}, "only the last stage mtp.2"),
        (
            {"mtp.2.main_proj.weight": "mtp.0.main_proj.weight"},
            "mtp.2.main_proj.weight: only the first stage mtp.0 holds this tensor, not stage 2",
        ),
    ],
)
def test_tensors_a_dspark_stage_must_not_hold_are_refused(native: Path, add: dict[str, str], words: str) -> None:
    exc = refusal(with_tensors(read_inventory(native), add))
    assert (isinstance(exc, model_errors.CheckpointError) and exc.kind == "unsupported_layout") and exit_code(exc) == 35
    assert words in str(exc)


def test_a_missing_stage_is_refused(native: Path) -> None:
    exc = refusal(with_tensors(read_inventory(native), drop="mtp.1."))
    assert exit_code(exc) == 35 and "stage(s) [0, 2]: stage 1 is missing" in str(exc)


def test_reverse_refuses_a_dspark_output_missing_a_stage(xpu: Path) -> None:
    inv = with_tensors(read_inventory(xpu), drop="model.layers.1.")
    with pytest.raises(model_errors.CheckpointError, match=r"stage\(s\) \[0, 2\]: stage 1 is missing") as raised:
        plan_reverse(inv, choose_table("xpu", inv, "reverse"))
    assert raised.value.kind == "unsupported_layout"


def test_main_proj_without_dspark_fields_is_refused_on_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    native = write_half_dspark(tmp_path / "half")
    code, out, err = run_main(monkeypatch, capsys, native, tmp_path / "out", "-q")
    assert code == 35 and err.count("\n") == 1, err
    assert (
        "tensor mtp.0.main_proj.weight: a DSpark drafter's projection, but" in err
        and "no dspark_* fields" in err
        and "refusing to convert" in err
    )
    assert not (tmp_path / "out").exists()


def test_dspark_fields_without_main_proj_are_refused(native: Path) -> None:
    inv = read_inventory(native)
    exc = refusal(with_tensors(inv, drop="mtp.0.main_proj."))
    assert (
        exit_code(exc) == 35
        and "dspark_* fields (a DSpark drafter, mapping/README.md#dspark-v4-flash-0731), but the checkpoint has no "
        "tensor mtp.0.main_proj.weight"
        in str(exc)
    )


def test_an_mtp_checkpoint_with_dspark_fields_is_refused(tiny_native: Path) -> None:
    inv = read_inventory(tiny_native)
    config = {
        **inv.config,
        **{k: preset_config("tiny", "dspark")[k] for k in DSPARK_FIELDS},
        "dspark_target_layer_ids": [0],
    }
    exc = refusal(dataclasses.replace(inv, config=config))
    assert exit_code(exc) == 35 and "no tensor mtp.0.main_proj.weight" in str(exc)


def test_disagreeing_stage_counts_are_refused(native: Path) -> None:
    inv = read_inventory(native)
    exc = refusal(dataclasses.replace(inv, config={**inv.config, "n_mtp_layers": 2}))
    # the config loader's verdict (model/config.py): a config contradicting itself is malformed
    assert (isinstance(exc, model_errors.CheckpointError) and exc.kind == "malformed_config") and exit_code(exc) == 18
    assert "config.json: n_mtp_layers is 2 but dspark_target_layer_ids has 3 entries" in str(exc)


def test_v41_is_refused_with_its_own_message(native: Path) -> None:
    inv = read_inventory(native)
    exc = refusal(dataclasses.replace(inv, config={**inv.config, "model_type": "deepseek_v41"}))
    assert exit_code(exc) == 35 and "V4.1" in str(exc)


# --- batch: one manifest, both layouts ----------------------------------------------------
@pytest.mark.slow
def test_batch_converts_mtp_and_dspark_repos_with_their_tables_and_skips_them_on_rerun(
    native: Path, tiny_native: Path, tmp_path: Path
) -> None:
    from hubserver import FakeHub, hub_env, run_cli

    with FakeHub() as hub:
        hub.commit_dir("org/mtp", tiny_native)
        hub.commit_dir("org/dspark", native)
        manifest = tmp_path / "batch.toml"
        manifest.write_text(
            'target = "xpu"\nsources = ["org/mtp", "org/dspark"]\n\n[output]\ndir = "out"\nname = '
            '"{name}-{target}"\n\n[options]\ncheck = true\n'
        )
        env = hub_env(hub, tmp_path / "hf")
        r = run_cli("batch", str(manifest), env=env)
        assert r.returncode == 0, r.stderr
        report = json.loads((tmp_path / "out" / "batch-report.json").read_text())
        assert {e["repo"]: e["table"] for e in report["converted"]} == {"org/mtp": "xpu", "org/dspark": "xpu_dspark"}
        assert report["tables"] == {"xpu": "1", "xpu_dspark": "1", "xpu_dspark_v41": "1"}
        assert all(": OK: " in e["check"] for e in report["converted"]), report["converted"]
        out = tmp_path / "out" / "dspark-xpu"
        assert json.loads((out / "conversion.json").read_text())["table"] == "xpu_dspark"
        r = run_cli("batch", str(manifest), env=env)
        assert r.returncode == 0, r.stderr
        report = json.loads((tmp_path / "out" / "batch-report.json").read_text())
        skipped = {e["repo"]: e["reason"] for e in report["skipped"]}
        assert skipped.keys() == {"org/mtp", "org/dspark"} and report["converted"] == []
        assert "with table xpu_dspark v1" in skipped["org/dspark"] and "with table xpu v1" in skipped["org/mtp"]
