"""`convert-dsv4 check`: passes on converter outputs; each way a converted checkpoint can be
broken fails its own check with its own exit code and a reason naming the tensor or file.

Malformed records (conversion.json, the index, config.json; a FIFO or a device in their place)
fail their own check in one line, never a traceback or a read that never ends; `--junit` writes
its report into a folder it creates, or fails after the report in one line. `--serve-with
TARGET`: a draft directory loads in vLLM 0.33.0 only beside a target whose config builds the
same layers, since vLLM builds the draft's layers from the TARGET's config and quantisation
(NOTES.md, "Serving a draft"). Property-based (tests/fuzzing.py): random and mutated
conversion.json records give a true record or one of the tool's own errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from edits import (
    INDEX,
    RECORD,
    SHARD,
    edit_config,
    edit_tensors,
    replace_by_special_file,
)
from fuzzing import FUZZ, json_values, mutate_text, one_line_own_error, outcome
from hypothesis import given
from hypothesis import strategies as st
from inprocess import one_error_line, run_in_subprocess_one_line, run_main

from dsv4.convert.check.context import Context as _Context
from dsv4.convert.check.files import check_checksums, check_index, check_readable, check_sizes
from dsv4.convert.check.run import run_checks
from dsv4.convert.cli.main import cli
from dsv4.convert.exit_codes import exit_code
from dsv4.convert.output import read_record
from dsv4.convert.pipeline import convert
from dsv4.convert.synth import write_checkpoint

# "serve" (check --serve-with, its tests below) is the last check; not asked for here, it skips
CHECKS = ["index", "readable", "sizes", "checksums", "config", "layout", "quant", "smoke", "native", "serve"]
L = 2  # tiny: num_hidden_layers = 2, so MTP block 0 is decoder layer 2
B = f"model.layers.{L}.mtp_block."


@pytest.fixture(scope="module")
def natives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native")
    return {
        "instruct": write_checkpoint(root / "instruct", preset="tiny", variant="instruct", main_layers="all", seed=0),
        "base": write_checkpoint(root / "base", preset="tiny", variant="base", main_layers="all", seed=0),
        "other": write_checkpoint(root / "other", preset="tiny", variant="instruct", main_layers="all", seed=1),
    }


@pytest.fixture(scope="module")
def converted(natives: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("converted")
    return {v: convert(natives[v], root / v).out for v in ("instruct", "base")}


@pytest.fixture
def out(converted: dict[str, Path], tmp_path: Path) -> Path:
    """A fresh copy of the converted tiny instruct checkpoint, to break."""
    return Path(shutil.copytree(converted["instruct"], tmp_path / "out"))


def statuses(report) -> dict[str, str]:
    return {r.name: r.status for r in report.results}


# --- passing ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["instruct", "base"])
def test_converter_output_passes_every_check_it_runs(converted: dict[str, Path], variant: str) -> None:
    report = run_checks(converted[variant], smoke=True)
    assert report.ok and report.exit_code == 0, report.summary()
    assert [r.name for r in report.results] == CHECKS
    assert statuses(report) == {**dict.fromkeys(CHECKS, "pass"), "native": "skip", "serve": "skip"}
    assert report.result("layout").details == {"missing": [], "unexpected": [], "shape": [], "dtype": []}


@pytest.mark.slow
def test_full_size_flash_replica_passes(tmp_path: Path) -> None:
    # --fast: the conversion of 5.7 GB of holes is this test's cost; hashing holes is
    # covered on a tiny sparse replica below
    native = write_checkpoint(tmp_path / "flash", preset="flash", sparse=True, main_layers=0)
    out = convert(native, tmp_path / "out").out
    report = run_checks(out, fast=True)
    assert report.ok, report.summary()
    assert report.result("readable").details["bytes"] == 5_711_911_276
    assert report.result("config").details["mtp_layers"] == [43]


def test_holes_of_a_sparse_output_hash_as_the_zeros_they_read_as(tmp_path: Path) -> None:
    native = write_checkpoint(tmp_path / "sparse", preset="tiny", sparse=True)
    report = run_checks(convert(native, tmp_path / "out").out)
    assert report.ok, report.summary()
    assert report.result("checksums").details["hashed"] == 41


def test_fast_skips_hashing_and_says_so(out: Path) -> None:
    data = bytearray((out / SHARD).read_bytes())
    data[-1] ^= 0xFF  # the last tensor's last byte
    (out / SHARD).write_bytes(data)
    report = run_checks(out, fast=True)
    assert report.ok
    assert statuses(report)["checksums"] == "skip"
    assert "--fast" in report.result("checksums").reason and "not hashed" in report.result("checksums").reason


@pytest.mark.slow
def test_native_parity_with_the_reference(out: Path, natives: dict[str, Path]) -> None:
    report = run_checks(out, native=natives["instruct"])
    assert report.ok, report.summary()
    assert statuses(report)["smoke"] == statuses(report)["native"] == "pass"
    assert report.result("native").details["top1_agreement"] == 1.0


# --- failing: each its own check and exit code ----------------------------------------------
def drop_enorm(out: Path) -> None:
    edit_tensors(out, lambda t: t.pop(f"model.layers.{L}.enorm.weight"))


def add_norm_gate(out: Path) -> None:
    # the seed's remap targets: a module vLLM's draft does not have (mapping/README.md#seed-bugs, bug 4)
    edit_tensors(out, lambda t: t.update({f"{B}ffn.norm_gate.gate.weight": t[f"{B}ffn.gate.weight"].clone()}))


def misshape_sink(out: Path) -> None:
    edit_tensors(out, lambda t: t.update({f"{B}attn.attn_sink": torch.zeros(5)}))


def widen_enorm(out: Path) -> None:
    name = f"model.layers.{L}.enorm.weight"
    edit_tensors(out, lambda t: t.update({name: t[name].float()}))


def flip_a_byte(out: Path) -> None:
    data = bytearray((out / SHARD).read_bytes())
    data[len(data) // 2] ^= 0x01
    (out / SHARD).write_bytes(data)


def point_at_missing_shard(out: Path) -> None:
    index = json.loads((out / INDEX).read_text())
    index["weight_map"][f"model.layers.{L}.hnorm.weight"] = "model-00002-of-00002.safetensors"
    (out / INDEX).write_text(json.dumps(index))


def two_mtp_blocks(out: Path) -> None:
    edit_config(out, lambda c: c.update(num_nextn_predict_layers=2))


def fp8_experts(out: Path) -> None:
    edit_config(out, lambda c: c.update(expert_dtype="fp8"))


def block_64(out: Path) -> None:
    edit_config(out, lambda c: c["quantization_config"].update(weight_block_size=[64, 64]))


def forget_the_record(out: Path) -> None:
    edit_config(out, lambda c: c.pop("dsv4_convert"))


def stray_shard(out: Path) -> None:
    shutil.copy(out / SHARD, out / "model-00002-of-00002.safetensors")


def wrong_total_size(out: Path) -> None:
    index = json.loads((out / INDEX).read_text())
    index["metadata"]["total_size"] += 1
    (out / INDEX).write_text(json.dumps(index))


def nan_scales(out: Path) -> None:
    # E8M0 byte 255 is NaN: the layout is right, the forward is not finite
    name = f"model.layers.{L}.e_proj.weight_scale_inv"
    edit_tensors(out, lambda t: t.update({name: torch.full_like(t[name].view(torch.uint8), 255).view(t[name].dtype)}))


@pytest.mark.parametrize(
    ("breakage", "check", "exit_code", "named"),
    [
        (drop_enorm, "layout", 76, f"1 missing: model.layers.{L}.enorm.weight"),
        (add_norm_gate, "layout", 77, f"{B}ffn.norm_gate.gate.weight in {SHARD}"),
        (misshape_sink, "layout", 78, f"{B}attn.attn_sink is [5] in {SHARD}, expected [4]"),
        (widen_enorm, "layout", 79, f"model.layers.{L}.enorm.weight is F32 in {SHARD}, expected BF16"),
        (flip_a_byte, "checksums", 74, f"{SHARD}: tensor "),
        (point_at_missing_shard, "index", 71, "model-00002-of-00002.safetensors: named in"),
        (two_mtp_blocks, "config", 75, "MTP layer(s) [2, 3], but the tensors hold layer(s) [2]"),
        (
            fp8_experts,
            "config",
            75,
            f"expert_dtype is 'fp8' but {SHARD}: tensor {B}ffn.experts.routed_experts.w13_weight (U8) holds fp4 "
            f"experts",
        ),
        (
            block_64,
            "config",
            75,
            f"weight_block_size [64, 64] gives model.layers.{L}.e_proj.weight_scale_inv the shape [4, 4]",
        ),
        (forget_the_record, "config", 75, "no dsv4_convert record"),
        (stray_shard, "index", 71, "model-00002-of-00002.safetensors: shard not named in"),
        (wrong_total_size, "sizes", 73, "metadata.total_size is"),
        (nan_scales, "smoke", 84, "non-finite"),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_each_breakage_fails_its_check(
    out: Path, breakage: Callable[[Path], None], check: str, exit_code: int, named: str
) -> None:
    breakage(out)
    report = run_checks(out, smoke=True)
    failed = report.failures[0]
    assert (failed.name, report.exit_code) == (check, exit_code), report.summary() + "\n" + failed.reason
    assert named in failed.reason
    assert "\n" not in failed.reason


def test_a_missing_shard_skips_the_checks_that_need_it(out: Path) -> None:
    point_at_missing_shard(out)
    report = run_checks(out, fast=True)
    assert [r.name for r in report.failures] == ["index"]
    assert statuses(report)["layout"] == "skip" and "index check failed" in report.result("layout").reason


@pytest.mark.slow
def test_native_parity_fails_against_a_different_checkpoint(out: Path, natives: dict[str, Path]) -> None:
    report = run_checks(out, native=natives["other"])
    assert (report.failures[0].name, report.exit_code) == ("native", 85)
    assert str(natives["other"]) in report.failures[0].reason


# --- reports for CI -----------------------------------------------------------------------
def test_junit_lists_one_case_per_check_and_the_failure_with_its_reason(out: Path, tmp_path: Path) -> None:
    drop_enorm(out)
    junit = tmp_path / "check.xml"
    result = CliRunner().invoke(cli, ["check", str(out), "--fast", "--junit", str(junit)])
    assert result.exception is not None and exit_code(result.exception) == 76
    root = ET.parse(junit).getroot()
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert list(cases) == CHECKS
    failure = cases["layout"].find("failure")
    assert failure is not None and f"model.layers.{L}.enorm.weight" in failure.get("message")
    assert failure.get("type") == "missing_tensors"
    assert cases["checksums"].find("skipped") is not None and cases["smoke"].find("skipped") is not None
    assert cases["index"].find("failure") is None and cases["index"].find("skipped") is None
    suite = root.find("testsuite")
    # 10 checks since "serve" (--serve-with) was added; it skips here, not asked for
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("10", "1", "4")


def test_json_report(converted: dict[str, Path]) -> None:
    result = CliRunner().invoke(cli, ["check", str(converted["instruct"]), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] and report["exit_code"] == 0
    assert [(c["name"], c["status"]) for c in report["checks"]] == [
        (n, "skip" if n in ("smoke", "native", "serve") else "pass") for n in CHECKS
    ]


@pytest.mark.slow
def test_the_process_exits_with_the_check_code_and_a_one_line_reason(out: Path) -> None:
    add_norm_gate(out)
    proc = subprocess.run([sys.executable, "-m", "dsv4", "check", str(out), "--fast"], capture_output=True, text=True)
    assert proc.returncode == 77
    assert "FAIL layout" in proc.stdout
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: ") and "norm_gate" in errors[0]


def test_check_under_an_address_space_limit_too_small_for_torch_is_one_line(tiny_pair: tuple[Path, Path]) -> None:
    import resource

    limit = 512 << 20  # a batch job's memory cap (ulimit -v 512M): torch's libraries alone do not fit

    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    done = subprocess.run(
        [sys.executable, "-c", "from dsv4.convert.entry import main; main()", "check", str(tiny_pair[1])],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=capped,
    )
    assert done.returncode == 3, done.stderr  # not OpenBLAS's exit(1) inside torch's import
    assert (
        done.stderr.startswith("error: check: not enough memory: the address-space limit (ulimit -v) is 512 MiB")
        and done.stderr.count("\n") == 1
    )


@pytest.mark.slow
def test_check_native_and_smoke_native_give_one_verdict(
    out: Path, natives: dict[str, Path], monkeypatch, capsys
) -> None:
    # the routed experts stacked in reverse order (a converter stacking them wrongly): the
    # routing is the reference's, the outputs are not. One pass rule (dsv4.model.parity),
    # one message; check keeps its code 85, smoke its 55; the same default token count.
    def swap_experts(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if ".routed_experts." in n]:
            t[name] = t[name].flip(0).contiguous()  # every expert takes another one's weights

    edit_tensors(out, swap_experts)
    report = run_checks(out, native=natives["instruct"])
    assert (report.failures[0].name, report.exit_code) == ("native", 85)
    code, _, err = run_main(monkeypatch, capsys, "smoke", out, "--device", "cpu", "--native", natives["instruct"])
    assert code == 55
    verdict = err.removeprefix("error: ").rstrip("\n")
    assert verdict == report.failures[0].reason and verdict.startswith(
        f"{out}: differs from the reference on {natives['instruct']}: "
    )


# --- check: conversion.json ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def checked(tiny_native: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[_Context, dict[str, Any]]:
    """A converted checkpoint whose index and data were read once (the checks conversion.json
    feeds need them), and its true conversion.json."""
    out = tmp_path_factory.mktemp("fuzz-record") / "xpu"
    convert(tiny_native, out)
    ctx = _Context(out, fast=False, smoke=False, native=None, device="cpu", tokens=1, min_top1=1.0, max_rel_diff=0.0)
    check_index(ctx, {})
    check_readable(ctx, {})
    return ctx, json.loads((out / "conversion.json").read_text())


def check_record(ctx: _Context, raw: bytes) -> dict[str, Any] | None:
    """Run the checks that read conversion.json on `raw`; the record if both passed."""
    (ctx.root / "conversion.json").write_bytes(raw)
    ctx.record = None
    try:
        check_sizes(ctx, {})
        check_checksums(ctx, {})
    except Exception as exc:
        one_line_own_error(exc)
        return None
    outcome("accepted")
    return ctx.record.to_json() if ctx.record is not None else None  # the typed record (model/record.py), as JSON


def assert_accepted_record_is_true(ctx: _Context, record: dict[str, Any]) -> None:
    """Passing both checks means the record lists exactly the shards' tensors, right."""
    assert ctx.headers is not None
    assert set(record["tensors"]) == set(ctx.headers.tensors)
    for name, src in ctx.headers.tensors.items():
        entry = record["tensors"][name]
        assert (entry["file"], entry["nbytes"], entry["sha256"]) == (src.file, src.nbytes, ctx.hashes[name])


@FUZZ
@given(value=json_values)
def test_random_conversion_records(checked: tuple[_Context, dict[str, Any]], value: Any) -> None:
    ctx, _ = checked
    record = check_record(ctx, json.dumps(value).encode())
    assert record is None  # a random value is never a complete, true record


@FUZZ
@given(data=st.data())
def test_mutated_conversion_records(checked: tuple[_Context, dict[str, Any]], data: st.DataObject) -> None:
    ctx, true = checked
    record = json.loads(json.dumps(true))
    names = sorted(record["tensors"])
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        where = data.draw(
            st.sampled_from(["entry", "field", "drop field", "tensors", "top", "add tensor"]), label="where"
        )
        name = data.draw(st.sampled_from(names), label="tensor")
        field = data.draw(st.sampled_from(["file", "nbytes", "sha256", "other"]), label="field")
        value = data.draw(
            json_values | st.sampled_from([true["tensors"][name][f] for f in ("file", "nbytes", "sha256")]),
            label="value",
        )
        tensors = (
            record["tensors"] if isinstance(record["tensors"], dict) else {}
        )  # an earlier mutation may have replaced it
        if where == "entry":
            tensors[name] = value
        elif where == "field" and isinstance(tensors.get(name), dict):
            tensors[name][field] = value
        elif where == "drop field" and isinstance(tensors.get(name), dict):
            tensors[name].pop(field, None)
        elif where == "tensors":
            record["tensors"] = value
        elif where == "add tensor":
            tensors[data.draw(st.text(max_size=20), label="new name")] = value
        elif where == "top":
            record[data.draw(st.sampled_from(["tool", "table", "source", "fingerprint"]), label="key")] = value
    text = json.dumps(record, indent=2)
    if data.draw(st.booleans(), label="edit the text"):
        text = mutate_text(text, data)
    accepted = check_record(ctx, text.encode("utf-8", "surrogatepass"))
    if accepted is not None:
        assert_accepted_record_is_true(ctx, accepted)


@FUZZ
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_read_record_takes_any_bytes(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    path = tmp_path_factory.getbasetemp() / "any-record.json"
    path.write_bytes(raw)
    record = read_record(path)
    assert record is None or isinstance(record, dict)


def test_the_true_record_the_mutations_start_from_passes(checked: tuple[_Context, dict[str, Any]]) -> None:
    ctx, true = checked
    accepted = check_record(ctx, json.dumps(true).encode())
    assert accepted is not None
    assert_accepted_record_is_true(ctx, accepted)


def edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("table", ["path", 5, ["xpu"]])
def test_check_refuses_a_config_recording_a_table_that_is_no_installed_name(
    table: object, out: Path, table_copy: Path
) -> None:
    edit_json(
        out / "config.json",
        lambda c: c["dsv4_convert"].update(table=str(table_copy.with_suffix("")) if table == "path" else table),
    )
    report = run_checks(out, fast=True)
    failed = report.failures[0]
    assert (failed.name, report.exit_code) == ("config", 75), report.summary()
    assert (
        "dsv4_convert.table" in failed.reason
        and "installed: draft, draft_dspark, draft_dspark_v41, xpu, xpu_dspark, xpu_dspark_v41" in failed.reason
    )  # the draft tables are installed too


# --- check on malformed records ----------------------------------------------------------------
def first_tensor(record: dict) -> str:
    return sorted(record["tensors"])[0]


def record_entry_is_a_number(out: Path) -> None:
    edit_json(out / RECORD, lambda r: r["tensors"].update({first_tensor(r): 5}))


def record_tensors_is_a_list(out: Path) -> None:
    edit_json(out / RECORD, lambda r: r.update(tensors=list(r["tensors"])))


def record_nbytes_is_a_string(out: Path) -> None:
    edit_json(
        out / RECORD,
        lambda r: r["tensors"][first_tensor(r)].update(nbytes=str(r["tensors"][first_tensor(r)]["nbytes"])),
    )


def record_file_is_a_number(out: Path) -> None:
    edit_json(out / RECORD, lambda r: r["tensors"][first_tensor(r)].update(file=1))


def record_sha256_is_a_number(out: Path) -> None:
    edit_json(out / RECORD, lambda r: r["tensors"][first_tensor(r)].update(sha256=5))


def record_sha256_is_uppercase(out: Path) -> None:
    edit_json(
        out / RECORD,
        lambda r: r["tensors"][first_tensor(r)].update(sha256=r["tensors"][first_tensor(r)]["sha256"].upper()),
    )


def record_nested_100000_deep(out: Path) -> None:
    (out / RECORD).write_text("[" * 100_000 + "]" * 100_000)


def record_with_a_duplicate_key(out: Path) -> None:
    # json.loads keeps the last "tensors": a record whose first copy lies would pass unread
    text = (out / RECORD).read_text()
    (out / RECORD).write_text('{"tensors": {"x": 1},' + text.lstrip()[1:])


def record_with_a_huge_integer(out: Path) -> None:
    text = (out / RECORD).read_text()
    (out / RECORD).write_text(text.replace('"nbytes": ', '"nbytes": ' + "9" * 5000, 1))


def index_metadata_is_a_list(out: Path) -> None:
    edit_json(out / INDEX, lambda i: i.update(metadata=[1]))


def index_total_size_is_a_string(out: Path) -> None:
    edit_json(out / INDEX, lambda i: i["metadata"].update(total_size=str(i["metadata"]["total_size"])))


def index_total_size_is_true(out: Path) -> None:
    edit_json(out / INDEX, lambda i: i["metadata"].update(total_size=True))


def index_weight_map_values_are_numbers(out: Path) -> None:
    edit_json(out / INDEX, lambda i: i.update(weight_map={k: 5 for k in i["weight_map"]}))


def config_quantization_is_a_list(out: Path) -> None:
    edit_json(out / "config.json", lambda c: c.update(quantization_config=[1]))


@pytest.mark.parametrize(
    ("breakage", "codes", "named"),
    [
        (record_entry_is_a_number, {73}, "is 5, not an object"),
        (record_tensors_is_a_list, {73}, "no 'tensors' object"),
        (record_nbytes_is_a_string, {73}, "].nbytes is '"),
        (record_file_is_a_number, {73}, "].file is 1, not a file name"),
        (record_sha256_is_a_number, {74}, ".sha256 is 5, not 64 lowercase hex digits"),
        (record_sha256_is_uppercase, {74}, "not 64 lowercase hex digits"),
        (record_nested_100000_deep, {73}, "nested more than"),
        (record_with_a_duplicate_key, {73}, "duplicate key 'tensors'"),
        (record_with_a_huge_integer, {73}, "integer of 50"),
        # the index check reads the index strictly (metadata and total_size types) where the
        # inventory's reader does so; otherwise the sizes check refuses it: one of the two
        (index_metadata_is_a_list, {71, 73}, "metadata"),
        (index_total_size_is_a_string, {71, 73}, "total_size"),
        (index_total_size_is_true, {71, 73}, "total_size"),
        (index_weight_map_values_are_numbers, {71}, INDEX),
        (
            config_quantization_is_a_list,
            {75},
            "quantization_config",
        ),  # (h3's config loader may refuse it first: the same code)
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_a_malformed_record_fails_its_own_check_in_one_line(
    breakage: Callable[[Path], None],
    codes: set[int],
    named: str,
    out: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    breakage(out)
    code, stdout, err = run_main(monkeypatch, capsys, "check", str(out))
    line = one_error_line(err)
    assert code in codes, line
    assert line.startswith("error: ") and named in line
    assert f"FAILED (exit {code})" in stdout  # the report is printed before the error


# --- check --junit -----------------------------------------------------------------------------
def test_junit_into_a_missing_folder_creates_it(
    out: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    junit = tmp_path / "reports" / "ci" / "check.xml"
    code, stdout, err = run_main(monkeypatch, capsys, "check", str(out), "--fast", "--junit", str(junit))
    assert (code, err) == (0, "")
    assert "OK: 6 passed" in stdout
    assert junit.read_text().startswith("<?xml") and 'name="checksums"' in junit.read_text()


@pytest.mark.parametrize("broken", [False, True])
def test_junit_that_cannot_be_written_fails_after_the_report_in_one_line(
    broken: bool, out: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if broken:
        record_sha256_is_a_number(out)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, stdout, err = run_main(monkeypatch, capsys, "check", str(out), "--junit", str(blocker / "check.xml"))
    line = one_error_line(err)
    assert code == 42
    assert line.startswith(
        f"error: {blocker / 'check.xml'}: cannot write the JUnit report ({blocker} is not a directory)"
    )
    assert ("FAILED (exit 74: checksums)" if broken else "all checks passed") in line
    assert ("FAILED (exit 74)" if broken else "OK: 7 passed") in stdout  # the whole report came first


# --- a record that is a FIFO or a device is refused, not read forever ----------------------
@pytest.mark.slow
@pytest.mark.skipif(not (hasattr(os, "mkfifo") and os.path.exists("/dev/zero")), reason="needs FIFOs and /dev/zero")
@pytest.mark.parametrize(("name", "code"), [("config.json", 75), ("conversion.json", 73)])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_check_refuses_a_record_that_is_not_a_regular_file(
    name: str, code: int, kind: str, tiny_xpu: Path, tmp_path: Path
) -> None:
    """check blocked forever on a FIFO config.json or conversion.json, and read /dev/zero until memory ran out."""
    out = tmp_path / "out"
    shutil.copytree(tiny_xpu, out)
    replace_by_special_file(out / name, kind)
    rc, line = run_in_subprocess_one_line("check", str(out), "--fast")
    assert rc == code
    assert str(out / name) in line and "not a regular file" in line, line


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve")
    native = write_checkpoint(root / "native", preset="tiny", seed=0)
    convert(native, root / "draft", target="draft")
    return native, root / "draft"


def test_check_plans_a_draft_directory_once(pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The quant check and the smoke run both need the draft directory's plan into the bundled
    layout; each made its own (convert/check/run.py and convert/inmemory.py) before."""
    from dsv4.convert import inmemory

    planned = []
    plan = inmemory.plan_conversion
    monkeypatch.setattr(inmemory, "plan_conversion", lambda *args: planned.append(1) or plan(*args))
    report = run_checks(pair[1], smoke=True)
    assert {r.name: r.status for r in report.results}["smoke"] == "pass"
    assert len(planned) == 1


def target_config(tmp_path: Path, native: Path, **changes: object) -> Path:
    config = {**json.loads((native / "config.json").read_text()), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def serve_result(draft: Path, target: Path | None):
    return next(r for r in run_checks(draft, serve_with=target).results if r.name == "serve")


def test_a_draft_serves_beside_the_checkpoint_it_came_from(pair: tuple[Path, Path]) -> None:
    native, draft = pair
    for target in (native, native / "config.json"):
        result = serve_result(draft, target)
        assert result.status == "pass", result.reason


def test_a_differently_quantised_target_fails_naming_the_field(pair: tuple[Path, Path], tmp_path: Path) -> None:
    # a compressed-tensors re-export of the same model: vLLM would build W4A16 layers for FP8 tensors
    native, draft = pair
    target = target_config(
        tmp_path, native, quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized"}
    )
    result = serve_result(draft, target)
    assert (result.status, result.exit_code) == ("fail", 86)
    assert result.error is not None and result.error.fields() == {
        "kind": "serve_mismatch",
        "path": str(target),
        "field": "quantization_config.activation_scheme",
    }
    assert result.reason.startswith(
        f"{target}: quantization_config.activation_scheme is '(absent)', the draft's is 'dynamic'"
    )


def test_another_architecture_fails_naming_the_field(pair: tuple[Path, Path], tmp_path: Path) -> None:
    native, draft = pair
    target = target_config(tmp_path, native, num_hidden_layers=3)
    result = serve_result(draft, target)
    assert (result.status, result.exit_code) == ("fail", 86)
    assert "num_hidden_layers is 3, the draft's is 2" in result.reason


def test_a_target_config_that_is_not_a_json_object_is_named_once(pair: tuple[Path, Path], tmp_path: Path) -> None:
    # config errors carry their file (model/config.py): the reason must not say the path twice
    _, draft = pair
    target = tmp_path / "config.json"
    target.write_text("[]")
    result = serve_result(draft, target)
    assert (result.status, result.exit_code) == ("fail", 86)
    assert result.reason == (
        f"{target}: cannot read the target's config: the top level is [] (a list); expected a JSON object"
    )


def test_not_asked_or_not_a_draft_directory_skips(pair: tuple[Path, Path], tmp_path: Path) -> None:
    native, draft = pair
    assert serve_result(draft, None).status == "skip"
    xpu = tmp_path / "xpu"
    convert(native, xpu)
    result = serve_result(xpu, native)
    assert result.status == "skip" and "only a --target draft output" in result.reason


def test_the_command_exits_86_with_one_line(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    native, draft = pair
    target = target_config(tmp_path, native, expert_dtype="fp8")
    code, _out, err = run_main(monkeypatch, capsys, "check", draft, "--serve-with", target, "-q")
    assert code == 86
    assert err.count("\n") == 1 and "expert_dtype is 'fp8', the draft's is 'fp4'" in err


@pytest.mark.parametrize("content", [None, b"{not json", b"[1, 2]"], ids=["missing", "not-json", "not-an-object"])
def test_a_target_config_that_cannot_be_read_fails_the_check_naming_it(
    pair: tuple[Path, Path], tmp_path: Path, content: bytes | None
) -> None:
    # an OSError and a malformed config.json end the same way: the serve check fails (86) naming
    # the file, never an internal error
    _native, draft = pair
    target = tmp_path / "config.json"
    if content is not None:
        target.write_bytes(content)
    result = serve_result(draft, target)
    assert (result.status, result.exit_code) == ("fail", 86)
    assert result.error is not None and result.error.fields() == {"kind": "serve_mismatch", "path": str(target)}
    assert result.reason.startswith(f"{target}: cannot read the target's config: ")
