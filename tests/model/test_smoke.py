"""`convert-dsv4 smoke`: load strictly, run a draft step, check it (model/README.md#smoke-test-and-reference)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from dsv4.convert.cli.main import cli
from dsv4.convert.synth import write_checkpoint
from dsv4.model.errors import LoadError
from dsv4.model.loader import load_converted
from dsv4.model.mtp import MoE
from dsv4.model.parity import TIE_REL, RoutingLog, logging_routing, parity_verdict
from dsv4.model.reference import NativeReference
from dsv4.model.smoke import run_smoke


@pytest.mark.slow
def test_smoke_reports_shapes_timings_and_agreement_as_json(tiny_pair):
    native, converted = tiny_pair
    result = CliRunner().invoke(
        cli, ["smoke", str(converted), "--device", "cpu", "--tokens", "12", "--native", str(native), "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report["device"] == "cpu"
    expected_kernels = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else report["kernels"]
    assert report["kernels"] == expected_kernels
    assert report["hidden_shape"] == [12, 4 * 256] and report["logits_shape"] == [12, 512]
    assert report["top1_agreement"] == 1.0
    assert report["hidden_max_abs_diff"] < 0.05 and report["logits_max_abs_diff"] < 0.05
    for stage in (
        "load_ms",
        "forward_first_ms",
        "forward_warm_ms",
        "logits_first_ms",
        "logits_warm_ms",
        "reference_forward_ms",
    ):
        assert report[stage] > 0


def test_smoke_says_which_device_and_kernels_ran(tiny_pair):
    _, converted = tiny_pair
    result = CliRunner().invoke(cli, ["smoke", str(converted), "--device", "cpu", "--tokens", "3"])
    assert result.exit_code == 0, result.output
    assert f"smoke: {converted} on cpu, fused norms: " in result.output
    assert "hidden [3, 1024], logits [3, 512], all finite" in result.output


@pytest.mark.slow
def test_smoke_fails_when_the_reference_disagrees(tiny_pair, tmp_path):
    # a reference from another seed is another model: agreement must fall below 1
    other = write_checkpoint(tmp_path / "other", preset="tiny", variant="instruct", seed=9)
    result = CliRunner().invoke(
        cli, ["smoke", str(tiny_pair[1]), "--device", "cpu", "--tokens", "16", "--native", str(other)]
    )
    assert isinstance(result.exception, LoadError) and result.exception.kind == "smoke_output"
    # the verdict of `check --native` too (model/parity.py): one message for both commands
    assert f"differs from the reference on {other}" in str(result.exception) and "top-1 agreement" in str(
        result.exception
    )


def test_a_bad_checkpoint_exits_with_the_load_error_code(tiny_pair, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_pair[1].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    # the parameter gone from its shard and from the index (the index alone no longer listing
    # it is now an index/header disagreement, index_mismatch 13, as plan and check say:
    # the loader reads headers through the inventory's reader)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = bad / index["weight_map"].pop("model.layers.2.enorm.weight")
    kept = load_file(shard)
    del kept["model.layers.2.enorm.weight"]
    save_file(kept, shard)
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = subprocess.run(
        [sys.executable, "-m", "dsv4", "smoke", str(bad), "--device", "cpu"], capture_output=True, text=True
    )
    assert proc.returncode == 51, proc.stderr  # missing_key: the index no longer lists a parameter
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "model.layers.2.enorm.weight" in proc.stderr.strip().splitlines()[-1]


def test_top1_agreement_forgives_near_ties_only():
    from dsv4.model.smoke import top1_agreement_up_to_ties

    ref = torch.tensor([[10.0, 9.95, 0.0], [10.0, 5.0, 0.0], [0.0, 1.0, 10.0]])
    # token 0: a near-tie (gap 0.05 <= 1% of 10) flipped; token 1: a decisive flip; token 2 agrees
    mine = torch.tensor([[9.9, 10.0, 0.0], [5.0, 10.0, 0.0], [0.0, 1.0, 10.0]])
    assert top1_agreement_up_to_ties(mine, ref) == pytest.approx(2 / 3)
    assert top1_agreement_up_to_ties(ref, ref) == 1.0


@pytest.mark.slow
def test_without_triton_the_command_says_so_once_in_its_result(tiny_pair):
    """No Python warning with a source path, and no `warning:` line repeating the result's
    "fused norms: torch fallback (...)" (was: both; and -q, which hides notices, showed it)."""
    hide_triton = (
        "import sys; sys.modules['triton'] = None; from dsv4.convert.cli.main import main; "
        "sys.argv[0] = 'convert-dsv4'; main()"
    )
    for quiet in ([], ["-q"]):
        proc = subprocess.run(
            [sys.executable, "-c", hide_triton, "smoke", str(tiny_pair[1]), "--device", "cpu", "--tokens", "2", *quiet],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ""
        assert (
            "torch fallback (triton is not importable)" in proc.stdout
            and proc.stdout.count("triton is not importable") == 1
        )


def test_on_the_cpu_the_fallback_is_not_blamed_on_triton_interpret(tiny_pair):
    # TRITON_INTERPRET=1 selects Triton's slow interpreter (for tests): never the advice on a CPU
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "dsv4", "smoke", str(tiny_pair[1]), "--device", "cpu", "--tokens", "2"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert (
        "fused norms: torch fallback (the tensors are on the CPU, and the Triton kernels are for XPU and CUDA)"
        in proc.stdout
    )
    assert "TRITON_INTERPRET" not in proc.stdout


def counting(load):
    """`load` (a smoke Loader), with the number of times it was called in `.calls`."""

    def counted(device):
        counted.calls += 1
        return load(device)

    counted.calls = 0
    return counted


def test_smoke_with_the_reference_loads_the_model_once_when_the_routing_agrees(tiny_pair):
    # the warm run's routing is the one compared: no reload and third forward when nothing needs rerunning
    native, converted = tiny_pair
    load = counting(lambda device: load_converted(converted, device))
    report = run_smoke(converted, "cpu", tokens=4, reference_dir=native, load=load)
    assert report["routing_disagreements"] == [] and parity_verdict(report)[0]
    assert load.calls == 1


@pytest.mark.slow
def test_smoke_reruns_the_model_with_the_references_experts_on_a_near_tie(tiny_pair):
    # a model whose gate bias flips the reference's closest routing choice: it is loaded again
    # and run with the reference's experts, and the flip is reported as a near-tie
    native, converted = tiny_pair
    tokens = 8
    cfg = load_converted(converted, "cpu").config
    gen = torch.Generator().manual_seed(0)  # run_smoke's inputs for seed 0
    ids, positions = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen), torch.arange(tokens)
    prev = torch.randn(tokens, cfg.hc_dim, generator=gen).to(torch.bfloat16)
    ref = NativeReference(native, "cpu")
    with logging_routing([ref], RoutingLog()) as log:
        ref.forward(ids, positions, prev)
    k = cfg.num_experts_per_tok
    top = log.calls[0].selection.topk(k + 1, dim=-1)
    gaps = top.values[:, k - 1] - top.values[:, k]
    token = int(gaps.argmin())
    expert, margin = int(top.indices[token, k]), float(gaps[token])
    tolerance = TIE_REL * float(log.calls[0].selection[token].abs().max())
    assert margin < tolerance, "the fixture has a near-tie to flip"

    def flipped(device):
        model = load_converted(converted, device)
        moe = next(m for m in model.modules() if isinstance(m, MoE))
        with torch.no_grad():
            moe.gate.e_score_correction_bias[expert] += (margin + tolerance) / 2
        return model

    load = counting(flipped)
    report = run_smoke(converted, "cpu", tokens=tokens, reference_dir=native, load=load)
    assert load.calls == 2
    assert any(d["token"] == token and d["near_tie"] for d in report["routing_disagreements"])
    assert parity_verdict(report)[0], parity_verdict(report)[1]
