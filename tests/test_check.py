"""`convert-dsv4 check`: passes on converter outputs; each way a converted checkpoint can be
broken fails its own check with its own exit code and a reason naming the tensor or file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from edits import INDEX, SHARD, edit_config, edit_tensors, raw_tensor_bytes, reseal
from inprocess import run_main

from dsv4.convert.check import run_checks
from dsv4.convert.cli import cli
from dsv4.convert.exit_codes import exit_code
from dsv4.convert.pipeline import convert
from dsv4.convert.synth import write_checkpoint

# "serve" (check --serve-with, tests/test_serve_with.py) is the last check; not asked for here, it skips
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
            f"expert_dtype is 'fp8' but {SHARD}: tensor {B}ffn.experts.routed_experts.w13_weight (U8) holds fp4 experts",
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
