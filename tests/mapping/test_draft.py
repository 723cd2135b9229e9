"""`--target draft`: the standalone draft directory vLLM 0.33.0 and SGLang 0.5.23 load as a
separate draft model (docs/serving.md). It holds the draft's tensors under their native
names, bytes unchanged, plus embed.weight and head.weight; config.json is the source's, byte
for byte; conversion.json records the conversion without any local path. A draft directory is
a native source (`--target xpu` from it equals `--target xpu` from the original), and `check`
and `smoke` work on it alone."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from edits import edit_config, edit_tensors
from inprocess import run_main

from dsv4.convert.check.run import run_checks
from dsv4.convert.choose import choose_table
from dsv4.convert.errors import OutputError, PlanError
from dsv4.convert.pipeline import convert
from dsv4.convert.plan import plan_conversion
from dsv4.convert.sources.inventory import read_inventory
from dsv4.convert.synth import write_checkpoint
from dsv4.mapping import errors as mapping_errors
from dsv4.mapping.table import TABLE_DIR, load_table, load_table_file
from dsv4.mapping.targets import installed_targets

SHARD = "model-00001-of-00001.safetensors"  # a tiny draft fits one shard
INDEX = "model.safetensors.index.json"
OUTPUT_FILES = ["config.json", "conversion.json", SHARD, INDEX]
KINDS = ("instruct", "base", "dspark")


def raw_tensors(ckpt: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, bytes) of every tensor of a checkpoint directory, read straight
    from the safetensors files (independent of the code under test)."""
    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        data = shard.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        header.pop("__metadata__", None)
        for name, e in header.items():
            a, b = e["data_offsets"]
            out[name] = (e["dtype"], e["shape"], data[8 + n + a : 8 + n + b])
    return out


def expected_draft_names(native: Path) -> set[str]:
    """What the runtimes load into the draft (every mtp.* tensor but Base's copies of the
    embedding and head), plus the shared embed.weight and head.weight."""
    names = set(raw_tensors(native))
    draft = {n for n in names if n.startswith("mtp.") and ".emb." not in n and not n.endswith(".head.weight")}
    return draft | {"embed.weight", "head.weight"}


@pytest.fixture(scope="module")
def natives(tiny_native: Path, tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dspark = write_checkpoint(
        tmp_path_factory.mktemp("tiny-dspark") / "native", preset="tiny", variant="dspark", main_layers="all", seed=0
    )
    return {"instruct": tiny_native, "base": tiny_base, "dspark": dspark}


@pytest.fixture(scope="module")
def drafts(natives: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts")
    return {k: convert(natives[k], root / k, target="draft").out for k in KINDS}


@pytest.fixture
def draft(drafts: dict[str, Path], tmp_path: Path) -> Path:
    """A fresh copy of the tiny instruct draft directory, to break."""
    return Path(shutil.copytree(drafts["instruct"], tmp_path / "draft"))


# --- what the directory holds -----------------------------------------------------------------
def test_draft_is_an_installed_target() -> None:
    assert "draft" in installed_targets()
    for name, drafter in (("draft", "mtp"), ("draft_dspark", "dspark")):
        table = load_table(name)
        assert (table.target, table.drafter, table.config) == ("draft", drafter, "source")
        assert (
            table.runtime == "vLLM 0.33.0, SGLang 0.5.23"
            and "vLLM" in table.runtime_class
            and "SGLang" in table.runtime_class
        )


@pytest.mark.parametrize("kind", KINDS)
def test_every_tensor_is_the_sources_bytes_under_its_native_name(
    kind: str, natives: dict[str, Path], drafts: dict[str, Path]
) -> None:
    source, out = raw_tensors(natives[kind]), raw_tensors(drafts[kind])
    assert set(out) == expected_draft_names(natives[kind])
    for name, tensor in out.items():
        assert tensor == source[name], name
    assert sorted(p.name for p in drafts[kind].iterdir()) == sorted(OUTPUT_FILES)


@pytest.mark.parametrize("kind", KINDS)
def test_config_json_is_the_sources_byte_for_byte(kind: str, natives: dict[str, Path], drafts: dict[str, Path]) -> None:
    assert (drafts[kind] / "config.json").read_bytes() == (natives[kind] / "config.json").read_bytes()


def test_the_dspark_draft_keeps_the_confidence_head_sglang_needs(
    natives: dict[str, Path], drafts: dict[str, Path]
) -> None:
    out = raw_tensors(drafts["dspark"])
    assert (
        out["mtp.2.confidence_head.proj.weight"] == raw_tensors(natives["dspark"])["mtp.2.confidence_head.proj.weight"]
    )


def test_base_mtp_copies_of_embedding_and_head_are_skipped_with_a_reason(natives: dict[str, Path]) -> None:
    inv = read_inventory(natives["base"])
    plan = plan_conversion(inv, choose_table("draft", inv))
    assert "copy of the top-level embed.weight" in plan.skipped["mtp.0.emb.tok_emb.weight"]
    assert "copy of the top-level head.weight" in plan.skipped["mtp.0.head.weight"]


@pytest.mark.parametrize("kind", KINDS)
def test_conversion_json_records_table_runtime_source_and_checksums_without_a_local_path(
    kind: str, natives: dict[str, Path], drafts: dict[str, Path]
) -> None:
    text = (drafts[kind] / "conversion.json").read_text()
    record = json.loads(text)
    table = "draft_dspark" if kind == "dspark" else "draft"
    assert (record["tool"], record["table"], record["table_version"], record["target"], record["direction"]) == (
        "dsv4-convert",
        table,
        "1",
        "draft",
        "forward",
    )
    assert (record["drafter"], record["runtime"]) == (
        "dspark" if kind == "dspark" else "mtp",
        "vLLM 0.33.0, SGLang 0.5.23",
    )
    assert record["source"]["location"] == natives[kind].name and record["source"]["revision"] is None
    assert record["source"]["config_sha256"] == hashlib.sha256((natives[kind] / "config.json").read_bytes()).hexdigest()
    # the config fields the runtimes read, as written
    config = json.loads((natives[kind] / "config.json").read_text())
    assert {k: config[k] for k in ("architectures", "model_type", "num_hidden_layers", "num_nextn_predict_layers")} == {
        k: record["config_fields"][k]
        for k in ("architectures", "model_type", "num_hidden_layers", "num_nextn_predict_layers")
    }
    for name, (_, _, data) in raw_tensors(drafts[kind]).items():
        assert record["tensors"][name]["sha256"] == hashlib.sha256(data).hexdigest()
    # a pushed output publishes no home directory: neither the source's path nor its parent's
    assert str(natives[kind].parent) not in text and "mtime" not in text


def test_an_xpu_conversion_records_no_local_path_either(tiny_native: Path, tmp_path: Path) -> None:
    """Issue 19 item 8: conversion.json used to record the absolute source path and mtimes."""
    out = convert(tiny_native, tmp_path / "xpu").out
    text = (out / "conversion.json").read_text()
    assert json.loads(text)["source"]["location"] == tiny_native.name
    assert str(tiny_native.parent) not in text and "mtime" not in text


def test_rerun_is_up_to_date_and_overwrite_replaces_a_draft_directory(natives: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "d"
    convert(natives["instruct"], out, target="draft")
    assert convert(natives["instruct"], out, target="draft").status == "up-to-date"
    # a draft directory has no layout record in config.json, and is still recognised as this tool's output
    assert convert(natives["instruct"], out, target="draft", overwrite=True).status == "converted"


# --- a draft directory is a native source -----------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_draft_to_xpu_equals_native_to_xpu_byte_for_byte(
    kind: str, natives: dict[str, Path], drafts: dict[str, Path], tmp_path: Path
) -> None:
    direct = convert(natives[kind], tmp_path / "direct", target="xpu").out
    via = convert(drafts[kind], tmp_path / "via", target="xpu").out
    for name in ("config.json", INDEX, SHARD):
        assert (via / name).read_bytes() == (direct / name).read_bytes(), name


# --- check and smoke --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_check_passes_on_a_draft_directory_alone_smoke_included(kind: str, drafts: dict[str, Path]) -> None:
    report = run_checks(drafts[kind], smoke=True)
    assert report.exit_code == 0, report.summary() + "\n" + "\n".join(r.reason for r in report.results)
    assert {r.name: r.status for r in report.results} == {
        "index": "pass",
        "readable": "pass",
        "sizes": "pass",
        "checksums": "pass",
        "config": "pass",
        "layout": "pass",
        "quant": "pass",
        "smoke": "pass",
        "native": "skip",
        "serve": "skip",
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["instruct", "dspark"])
def test_check_native_on_a_draft_directory_agrees_with_the_reference(
    kind: str, natives: dict[str, Path], drafts: dict[str, Path]
) -> None:
    report = run_checks(drafts[kind], native=natives[kind])
    assert report.exit_code == 0, report.summary() + "\n" + "\n".join(r.reason for r in report.results)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_smoke_runs_the_bundled_model_on_a_draft_directory(
    kind: str, drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(
        monkeypatch, capsys, "smoke", drafts[kind], "--device", "cpu", "--native", drafts[kind], "--json"
    )
    assert code == 0, err
    report = json.loads(out)
    agreement = report["draft_token_agreement"] if kind == "dspark" else report["top1_agreement_up_to_ties"]
    assert agreement == 1.0  # the draft directory is its own native reference


def add_a_converted_name(out: Path) -> None:
    edit_tensors(
        out, lambda t: t.update({"model.layers.2.mtp_block.attn.wq_b.weight": t["mtp.0.attn.wq_b.weight"].clone()})
    )


def drop_enorm(out: Path) -> None:
    edit_tensors(out, lambda t: t.pop("mtp.0.enorm.weight"))


def add_a_main_layer_tensor(out: Path) -> None:
    edit_tensors(out, lambda t: t.update({"layers.0.attn_norm.weight": t["mtp.0.attn_norm.weight"].clone()}))


def another_num_hidden_layers(out: Path) -> None:
    edit_config(out, lambda c: c.update(num_hidden_layers=3, compress_ratios=[*c["compress_ratios"][:-1], 0, 0]))


def two_mtp_blocks(out: Path) -> None:
    edit_config(out, lambda c: c.update(num_nextn_predict_layers=2, compress_ratios=[*c["compress_ratios"], 0]))


def fp8_experts(out: Path) -> None:
    edit_config(out, lambda c: c.update(expert_dtype="fp8"))


def four_experts(out: Path) -> None:
    edit_config(out, lambda c: c.update(n_routed_experts=4))


def no_architectures(out: Path) -> None:
    edit_config(out, lambda c: c.pop("architectures"))


@pytest.mark.parametrize(
    ("breakage", "check", "code", "named"),
    [
        (add_a_converted_name, "layout", 77, "1 unexpected: model.layers.2.mtp_block.attn.wq_b.weight in"),
        (drop_enorm, "layout", 76, "1 missing: mtp.0.enorm.weight"),
        (add_a_main_layer_tensor, "layout", 77, "1 unexpected: layers.0.attn_norm.weight in"),
        (another_num_hidden_layers, "config", 75, "num_hidden_layers is 3, but the conversion wrote 2"),
        (
            two_mtp_blocks,
            "config",
            75,
            "num_nextn_predict_layers = 2 means MTP block(s) mtp.[0, 1], but the tensors hold mtp.[0]",
        ),
        (
            fp8_experts,
            "config",
            75,
            "expert_dtype is 'fp8' but model-00001-of-00001.safetensors: tensor mtp.0.ffn.experts.0.w1.weight (I8) "
            "holds fp4 experts",
        ),
        (four_experts, "config", 75, "n_routed_experts = 4, but the tensors hold routed experts 0..7 (8)"),
        (
            no_architectures,
            "config",
            75,
            "no architectures: vLLM 0.33.0 and SGLang 0.5.23 pick the draft model class from it",
        ),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_each_breakage_of_a_draft_directory_fails_check_naming_it(
    draft: Path, breakage: Callable[[Path], None], check: str, code: int, named: str
) -> None:
    breakage(draft)
    report = run_checks(draft)
    failed = report.failures[0]
    assert (failed.name, report.exit_code) == (check, code), report.summary() + "\n" + failed.reason
    assert named in failed.reason and "\n" not in failed.reason


def test_a_dspark_draft_without_the_confidence_head_fails_check(drafts: dict[str, Path], tmp_path: Path) -> None:
    """What `--reverse` of an xpu DSpark conversion lacks, and SGLang's DSpark loader raises on."""
    out = Path(shutil.copytree(drafts["dspark"], tmp_path / "d"))
    edit_tensors(out, lambda t: t.pop("mtp.2.confidence_head.proj.weight"))
    report = run_checks(out)
    assert report.exit_code == 76 and "1 missing: mtp.2.confidence_head.proj.weight" in report.failures[0].reason


def test_the_command_exits_with_the_code_and_one_line_naming_the_tensor(
    draft: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    add_a_converted_name(draft)
    code, _, err = run_main(monkeypatch, capsys, "check", draft, "-q")
    assert code == 77 and err.count("\n") == 1 and "model.layers.2.mtp_block.attn.wq_b.weight" in err


# --- plan ---------------------------------------------------------------------------------------
def test_plan_shows_the_draft_target_and_its_table(
    natives: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_main(monkeypatch, capsys, "plan", natives["dspark"], "--target", "draft")
    assert code == 0 and out.startswith(f"forward plan: {natives['dspark']} -> draft (table draft_dspark v1)")
    code, out, _ = run_main(monkeypatch, capsys, "plan", natives["instruct"], "--target", "draft", "--json")
    plan = json.loads(out)
    # the same flat table keys conversion.json has
    assert (plan["table"], plan["table_version"], plan["target"], plan["runtime"]) == (
        "draft",
        "1",
        "draft",
        "vLLM 0.33.0, SGLang 0.5.23",
    )
    assert plan["ops"] == {"keep": len(expected_draft_names(natives["instruct"]))}


# --- the [keep] section of the table format -----------------------------------------------------
def test_a_keep_rule_for_a_name_the_native_format_lacks_is_a_dead_rule(tmp_path: Path) -> None:
    text = (TABLE_DIR / "draft.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('"mtp.{i}.enorm.weight",', '"mtp.{i}.enorm.weight", "mtp.{i}.ffn.norm_gate.weight",'))
    with pytest.raises(mapping_errors.TableError, match="norm_gate") as raised:
        load_table_file(bad)
    assert raised.value.kind == "dead_rule"


def test_a_table_missing_a_kept_tensor_cannot_plan(natives: dict[str, Path], tmp_path: Path) -> None:
    text = (TABLE_DIR / "draft.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('"mtp.{i}.enorm.weight", ', ""))
    table = load_table_file(bad)
    inv = read_inventory(natives["instruct"])
    with pytest.raises(PlanError, match="mtp.0.enorm.weight") as raised:
        plan_conversion(inv, table)
    assert raised.value.kind == "uncovered_key"


def test_keep_in_an_include_needs_equal_source_and_target_prefixes(tmp_path: Path) -> None:
    text = (TABLE_DIR / "draft.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(
        text.replace('source = "mtp.{i}."\ntarget = "mtp.{i}."', 'source = "mtp.{i}."\ntarget = "model.layers.{L}."')
    )
    with pytest.raises(mapping_errors.TableError, match="a kept tensor keeps its name"):
        load_table_file(bad)


# --- from the hub -------------------------------------------------------------------------------
def test_a_hub_source_gives_the_same_draft_directory_as_the_local_one(
    natives: dict[str, Path], drafts: dict[str, Path], tmp_path: Path
) -> None:
    from hubserver import FakeHub, hub_env, run_cli

    with FakeHub() as hub:
        commit = hub.commit_dir("org/dspark", natives["dspark"])
        out = tmp_path / "out"
        r = run_cli("convert", "org/dspark", str(out), "--target", "draft", "--json", env=hub_env(hub, tmp_path / "hf"))
        assert r.returncode == 0, r.stderr
    for name in ("config.json", INDEX, SHARD):
        assert (out / name).read_bytes() == (drafts["dspark"] / name).read_bytes(), name
    record = json.loads((out / "conversion.json").read_text())
    assert (record["source"]["location"], record["source"]["revision"]) == ("hub:org/dspark", commit)
    assert json.loads(r.stdout)["bytes_read"] == sum(len(d) for _, _, d in raw_tensors(out).values())


# --- full size ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_full_size_flash_replica_plans_to_the_runtimes_1577_tensors(flash_sparse: Path) -> None:
    """Flash's 1,575 mtp.0.* tensors plus embed and head: the bytes of the xpu conversion
    (every op moves bytes), read from the embed shard, the head shard and the MTP shard."""
    inv = read_inventory(flash_sparse)
    plan = plan_conversion(inv, choose_table("draft", inv))
    assert (plan.table, len(plan.tensors), plan.bytes_to_write, len(plan.skipped)) == (
        "draft",
        1_577,
        5_711_911_276,
        67_610,
    )
    assert plan.files_needed == [
        "model-00001-of-00046.safetensors",
        "model-00045-of-00046.safetensors",
        "model-00046-of-00046.safetensors",
    ]
    assert plan.bytes_to_write == plan_conversion(inv, choose_table("xpu", inv)).bytes_to_write


@pytest.mark.slow
def test_the_full_size_0731_replica_plans_its_stages_with_the_confidence_head(tmp_path: Path) -> None:
    """The xpu DSpark layout's 12,980,953,116 bytes plus the 8,704-byte confidence head the
    xpu table skips (bf16 [1, 4096 + 256])."""
    ckpt = write_checkpoint(tmp_path / "0731", preset="flash", variant="dspark", main_layers="all", sparse=True)
    inv = read_inventory(ckpt)
    plan = plan_conversion(inv, choose_table("draft", inv))
    assert (plan.table, len(plan.tensors), plan.bytes_to_write) == ("draft_dspark", 4_707, 12_980_961_820)
    assert plan.bytes_to_write - plan_conversion(inv, choose_table("xpu", inv)).bytes_to_write == 8_704
    assert plan.files_needed == [f"model-000{k:02d}-of-00048.safetensors" for k in (1, 45, 46, 47, 48)]


def test_the_full_size_pro_0813_replica_plans_every_stage_tensor_from_the_stage_shards(tmp_path: Path) -> None:
    """V4-Pro-0813 at release size (its main layers left out: planning skips them by name): 7,009
    mtp.* tensors of 41,979,375,900 bytes, with embed and head 3,706,716,160 more; the xpu layout
    is the same bytes less the 15,360-byte confidence head it skips (bf16 [1, 7168 + 512]), among
    them one [384, 6144, 3584] uint8 w13 stack of 8,455,716,864 bytes per stage."""
    ckpt = write_checkpoint(tmp_path / "0813", preset="pro", variant="dspark", sparse=True)
    inv = read_inventory(ckpt)
    plan = plan_conversion(inv, choose_table("draft", inv))
    mtp = [t for t in plan.tensors if t.name.startswith("mtp.")]
    assert (plan.table, len(mtp), sum(t.nbytes for t in mtp)) == ("draft_dspark", 7_009, 41_979_375_900)
    assert plan.bytes_to_write - sum(t.nbytes for t in mtp) == 3_706_716_160
    assert plan.files_needed == [f"model-0000{k}-of-00005.safetensors" for k in range(1, 6)]
    xpu = plan_conversion(inv, choose_table("xpu", inv))
    assert (len(xpu.tensors), plan.bytes_to_write - xpu.bytes_to_write) == (98, 15_360)
    stacks = {t.name: (t.dtype, t.shape) for t in xpu.tensors if t.name.endswith("routed_experts.w13_weight")}
    assert stacks == {
        f"model.layers.{s}.ffn.experts.routed_experts.w13_weight": ("U8", (384, 6144, 3584)) for s in range(3)
    }


def test_a_compressed_tensors_draft_keeps_native_names_and_check_resolves_them_through_the_xpu_table(
    tmp_path: Path,
) -> None:
    """config.json keeps the source's native module names (the runtimes match them against
    native names); check resolves every linear of the model the xpu table makes of it."""
    pytest.importorskip("compressed_tensors")
    from quant_configs import REGEX, native_with

    native = native_with(tmp_path, REGEX)
    out = convert(native, tmp_path / "draft", target="draft").out
    assert (out / "config.json").read_bytes() == (native / "config.json").read_bytes()
    report = run_checks(out, fast=True)
    quant = {r.name: r for r in report.results}["quant"]
    assert report.exit_code == 0 and quant.status == "pass", quant.reason


def test_a_changed_source_config_is_not_up_to_date(tiny_native: Path, tmp_path: Path) -> None:
    """The draft's config.json is the source's: a rerun after the source's config.json
    changed (same shards) must rewrite it, not call the output up to date."""
    native = Path(shutil.copytree(tiny_native, tmp_path / "native"))
    out = tmp_path / "d"
    convert(native, out, target="draft")
    (native / "config.json").write_bytes(
        (native / "config.json").read_bytes().replace(b"\n}", b',\n  "_name_or_path": "edited"\n}')
    )
    with pytest.raises(OutputError) as raised:  # not up to date: replacing it takes --overwrite
        convert(native, out, target="draft")
    assert raised.value.kind == "output_exists"
    convert(native, out, target="draft", overwrite=True)
    assert (out / "config.json").read_bytes() == (native / "config.json").read_bytes()
