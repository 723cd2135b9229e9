"""The streaming converter: exact values, bounded reads, resumable after kill -9 with
byte-identical results, reversible, and nothing half-written that looks complete."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensors import load_all

from dsv4.convert import errors
from dsv4.convert.exit_codes import code_of
from dsv4.convert.pipeline import convert
from dsv4.convert.plan import plan_conversion
from dsv4.convert.sources.inventory import read_inventory
from dsv4.convert.writer import ShardWriter
from dsv4.mapping.table import load_table
from dsv4.model import errors as model_errors
from dsv4.model.checkpoint import INDEX_NAME

L = "model.layers.2."  # tiny: num_hidden_layers = 2
B = L + "mtp_block."


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsv4", *args], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )


def crashing_cli(point: int, *args: str) -> subprocess.CompletedProcess:
    """The CLI, killed (SIGKILL) once the output stream reaches byte `point` (tests/crashing_cli.py)."""
    return subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "crashing_cli.py"), str(point), *args],
        capture_output=True,
        text=True,
    )


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_values_are_what_spec_02_says(tiny_native: Path, tiny_xpu: Path) -> None:
    n, x = load_all(tiny_native), load_all(tiny_xpu)
    assert len(x) == 41
    # concat along dim 0
    assert torch.equal(
        raw(x[B + "attn.fused_wqa_wkv.weight"]),
        raw(torch.cat([n["mtp.0.attn.wq_a.weight"], n["mtp.0.attn.wkv.weight"]])),
    )
    assert torch.equal(
        raw(x[B + "ffn.shared_experts.gate_up_proj.weight_scale_inv"]),
        raw(torch.cat([n["mtp.0.ffn.shared_experts.w1.scale"], n["mtp.0.ffn.shared_experts.w3.scale"]])),
    )
    # weight_scale_inv keeps the source dtype and bytes (E8M0 for instruct)
    for src, dst in [
        ("mtp.0.e_proj.scale", L + "e_proj.weight_scale_inv"),
        ("mtp.0.attn.wq_b.scale", B + "attn.wq_b.weight_scale_inv"),
    ]:
        assert x[dst].dtype == torch.float8_e8m0fnu and torch.equal(raw(x[dst]), raw(n[src]))
    # row block e of w13 is expert e's w1 then w3, as raw uint8
    w13, w13s = x[B + "ffn.experts.routed_experts.w13_weight"], x[B + "ffn.experts.routed_experts.w13_weight_scale"]
    assert w13.dtype == torch.uint8 and w13s.dtype == torch.uint8
    for e in range(8):
        assert torch.equal(
            w13[e], raw(torch.cat([n[f"mtp.0.ffn.experts.{e}.w1.weight"], n[f"mtp.0.ffn.experts.{e}.w3.weight"]]))
        )
        # uint8 expert scales are the source E8M0 bytes, not a numeric cast (2^-7 -> 0)
        assert torch.equal(
            w13s[e], raw(torch.cat([n[f"mtp.0.ffn.experts.{e}.w1.scale"], n[f"mtp.0.ffn.experts.{e}.w3.scale"]]))
        )
        assert torch.equal(
            x[B + "ffn.experts.routed_experts.w2_weight_scale"][e], raw(n[f"mtp.0.ffn.experts.{e}.w2.scale"])
        )
    numeric_cast = n["mtp.0.ffn.experts.0.w1.scale"].float().to(torch.uint8)  # what the bug class would store
    assert not torch.equal(w13s[0][: numeric_cast.shape[0]], numeric_cast)
    # shared tensors come from the top level
    assert torch.equal(x["model.embed_tokens.weight"], n["embed.weight"])
    assert torch.equal(x[L + "shared_head.head.weight"], n["head.weight"])
    assert torch.equal(x[L + "shared_head.norm.weight"], n["mtp.0.norm.weight"])
    assert torch.equal(x[B + "ffn.gate.e_score_correction_bias"], n["mtp.0.ffn.gate.bias"])


def test_base_checkpoint_values(tiny_base: Path, tmp_path: Path) -> None:
    convert(tiny_base, tmp_path / "out")
    n, x = load_all(tiny_base), load_all(tmp_path / "out")
    assert x[L + "e_proj.weight_scale_inv"].dtype == torch.float32
    assert torch.equal(x[L + "e_proj.weight_scale_inv"], n["mtp.0.e_proj.scale"])
    w13 = x[B + "ffn.experts.routed_experts.w13_weight_scale_inv"]
    assert w13.dtype == torch.float32
    assert torch.equal(w13[3], torch.cat([n["mtp.0.ffn.experts.3.w1.scale"], n["mtp.0.ffn.experts.3.w3.scale"]]))
    # the Base checkpoint's own MTP emb/head are skipped: the draft uses the top level
    assert torch.equal(x["model.embed_tokens.weight"], n["embed.weight"])
    assert not torch.equal(n["mtp.0.head.weight"], n["head.weight"])
    assert torch.equal(x[L + "shared_head.head.weight"], n["head.weight"])


def test_output_directory_records_what_it_holds(tiny_native: Path, tiny_xpu: Path) -> None:
    assert sorted(p.name for p in tiny_xpu.iterdir()) == [
        "config.json",
        "conversion.json",
        "model-00001-of-00001.safetensors",
        INDEX_NAME,
    ]
    index = json.loads((tiny_xpu / INDEX_NAME).read_text())
    x = load_all(tiny_xpu)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in x.values())
    config = json.loads((tiny_xpu / "config.json").read_text())
    source_config = json.loads((tiny_native / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "dsv4_convert"} == source_config
    assert config["dsv4_convert"]["layout"] == "xpu" and config["dsv4_convert"]["table_version"] == "1"
    record = json.loads((tiny_xpu / "conversion.json").read_text())
    assert record["table_version"] == "1" and record["tool_version"]
    assert record["source"]["files"] and set(record["tensors"]) == set(x)
    import hashlib

    for name, t in x.items():
        assert record["tensors"][name]["sha256"] == hashlib.sha256(raw(t).numpy().tobytes()).hexdigest()


def test_shards_respect_max_shard_size(tiny_native: Path, tiny_xpu: Path, tmp_path: Path) -> None:
    convert(tiny_native, tmp_path / "out", max_shard_size=300_000)
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    # cut into shards, the output holds the one-shard conversion's tensors, bit for bit (this
    # compared the sharded output's names with themselves, which could not fail)
    sharded, whole = load_all(tmp_path / "out"), load_all(tiny_xpu)
    assert sharded.keys() == whole.keys()
    assert [name for name in whole if not torch.equal(raw(sharded[name]), raw(whole[name]))] == []
    assert len(sharded) == 41


def test_rerun_on_complete_output_does_nothing(tiny_native: Path, tiny_xpu: Path) -> None:
    before = tree_bytes(tiny_xpu)
    r = cli(str(tiny_native), str(tiny_xpu))
    assert r.returncode == 0 and "already up to date" in r.stdout
    assert tree_bytes(tiny_xpu) == before


def kill_points(tiny_native: Path) -> list[int]:
    """Positions in the output stream at which to kill: inside the first tensor written,
    right after a tensor's last byte (before its journal entry), and inside each stacked
    expert tensor (after some experts, before the rest). Increasing: each run resumes the
    previous one and dies further on."""
    plan = plan_conversion(read_inventory(tiny_native), load_table())
    points, at = [1], 0
    for t in plan.tensors:
        if t.op == "stack":
            points.append(at + t.pieces[0].nbytes * 3)
        at += t.nbytes
        if t.name.endswith("gate.weight"):
            points.append(at)
    return sorted(points)


def test_killed_runs_resume_to_byte_identical_output(tiny_native: Path, tiny_xpu: Path, tmp_path: Path) -> None:
    clean = tree_bytes(tiny_xpu)
    points = kill_points(tiny_native)
    assert len(points) >= 6
    out = tmp_path / "out"
    for point in points:
        r = crashing_cli(point, str(tiny_native), str(out), "-q")
        assert r.returncode == -9, r.stderr  # SIGKILL
        assert not out.exists()  # nothing that looks complete
        assert (tmp_path / ".out.partial").is_dir()
    r = cli(str(tiny_native), str(out), "-q")
    assert r.returncode == 0, r.stderr
    assert "resumed" in r.stdout
    assert not (tmp_path / ".out.partial").exists()
    # conversion.json names the same source, so everything, not only the tensors, is identical
    assert tree_bytes(out) == clean


def test_resume_redoes_a_journaled_tensor_whose_bytes_are_stale(
    tiny_native: Path, tiny_xpu: Path, tmp_path: Path
) -> None:
    """The journal is not fsynced per tensor: after a machine crash a journaled tensor may
    not be on disk. Resume re-hashes journaled tensors and redoes any that do not match."""
    out = tmp_path / "out"
    plan = plan_conversion(read_inventory(tiny_native), load_table())
    point = sum(t.nbytes for t in plan.tensors[:5]) + 1
    assert crashing_cli(point, str(tiny_native), str(out), "-q").returncode == -9
    partial = tmp_path / ".out.partial"
    first = json.loads((partial / "journal.jsonl").read_text().splitlines()[0])
    shard = partial / first["file"]
    header_len = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    offset = header_len + json.loads(shard.read_bytes()[8:header_len])[first["name"]]["data_offsets"][0]
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 4)
    assert cli(str(tiny_native), str(out), "-q").returncode == 0
    assert tree_bytes(out) == tree_bytes(tiny_xpu)


def test_round_trip_is_byte_identical(tiny_native: Path, tiny_xpu: Path, tmp_path: Path) -> None:
    back = tmp_path / "back"
    result = convert(tiny_xpu, back, reverse=True)
    n, b = load_all(tiny_native), load_all(back)
    used = {p.name for t in plan_conversion(read_inventory(tiny_native), load_table()).tensors for p in t.pieces}
    assert set(b) == used
    for name, t in b.items():
        assert t.dtype == n[name].dtype and t.shape == n[name].shape, name
        assert torch.equal(raw(t), raw(n[name])), name
    assert result.bytes_read == sum(t.numel() * t.element_size() for t in load_all(tiny_xpu).values())


def test_base_round_trip(tiny_base: Path, tmp_path: Path) -> None:
    convert(tiny_base, tmp_path / "x")
    convert(tmp_path / "x", tmp_path / "back", reverse=True)
    n, b = load_all(tiny_base), load_all(tmp_path / "back")
    assert all(torch.equal(raw(t), raw(n[k])) and t.dtype == n[k].dtype for k, t in b.items())


@pytest.mark.slow
def test_bytes_read_match_the_plan_on_full_flash(flash_sparse: Path, tmp_path: Path) -> None:
    result = convert(flash_sparse, tmp_path / "out")
    total = sum(p.stat().st_size for p in flash_sparse.glob("*.safetensors"))
    assert result.bytes_read <= 1.01 * result.plan.bytes_to_read
    assert result.bytes_read < total / 20


def test_missing_shard_exit_code(tiny_native: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for p in tiny_native.iterdir():
        os.link(p, src / p.name)
    (src / "model-00005-of-00005.safetensors").unlink()
    r = cli(str(src), str(tmp_path / "out"))
    assert r.returncode == code_of("missing_shard")
    assert "model-00005-of-00005.safetensors" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_truncated_shard_exit_code(tiny_native: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for p in tiny_native.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    mtp = src / "model-00005-of-00005.safetensors"
    os.truncate(mtp, mtp.stat().st_size - 100)
    r = cli(str(src), str(tmp_path / "out"))
    assert r.returncode == code_of("truncated_shard")
    assert "model-00005-of-00005.safetensors: tensor mtp.0." in r.stderr
    assert not (tmp_path / "out").exists()


def test_non_empty_output_is_refused(tiny_native: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    r = cli(str(tiny_native), str(out))
    assert r.returncode == code_of("output_exists") and "--overwrite" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]
    # --overwrite replaces only a previous output of this tool (tests/convert/test_output.py)
    assert cli(str(tiny_native), str(out), "--overwrite", "-q").returncode == code_of("overwrite_refused")
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]


def test_disk_full_leaves_no_final_directory(
    tiny_native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = ShardWriter.write
    calls = {"n": 0}

    def failing_write(self, name, data, at=0):
        calls["n"] += 1
        if calls["n"] == 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, name, data, at)

    monkeypatch.setattr(ShardWriter, "write", failing_write)
    with pytest.raises(errors.OutputError, match="No space left on device") as raised:
        convert(tiny_native, tmp_path / "out")
    assert raised.value.kind == "write_failed"
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    assert convert(tiny_native, tmp_path / "out").status == "resumed"


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_native: Path, tmp_path: Path) -> None:
    r = cli(str(tiny_native), str(tmp_path / "out"), "--dry-run", "--json")
    assert r.returncode == 0
    summary = json.loads(r.stdout)
    assert summary["tensors_out"] == 41 and summary["bytes_to_read"] > 0
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


def test_dry_run_json_is_the_plan_json_and_what_would_become_of_out(tiny_native: Path, tmp_path: Path) -> None:
    # --help: "`plan --json` plus "output" and "would""
    r = cli(str(tiny_native), str(tmp_path / "out"), "--dry-run", "--json")
    plan = json.loads(cli("plan", str(tiny_native), "--json").stdout)
    assert json.loads(r.stdout) == plan | {"output": str(tmp_path / "out"), "would": "create"}


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    ("case", "code", "said"),
    [
        ("out-is-source", 43, "is the source directory"),
        ("out-inside-source", 44, "is inside the source directory"),
        ("not-empty", 41, "exists and is not empty"),
        ("overwrite-foreign", 48, "--overwrite refused"),
    ],
)
def test_dry_run_refuses_what_the_run_would_refuse_and_touches_nothing(
    tiny_native: Path, tmp_path: Path, case: str, code: int, said: str
) -> None:
    out, extra = tmp_path / "out", []
    if case == "out-is-source":
        out = tiny_native
    elif case == "out-inside-source":
        out = tiny_native / "sub"
    else:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        extra = ["--overwrite"] if case == "overwrite-foreign" else []
    before = listing(tmp_path), listing(tiny_native)
    dry = cli(str(tiny_native), str(out), "--dry-run", *extra)
    assert (dry.returncode, dry.stdout) == (code, ""), dry.stderr
    assert said in dry.stderr and dry.stderr.count("\n") == 1
    assert (listing(tmp_path), listing(tiny_native)) == before  # no lock, no partial directory
    assert cli(str(tiny_native), str(out), *extra).returncode == code  # the run agrees


def test_dry_run_says_whether_out_would_be_created_replaced_or_is_up_to_date(tiny_native: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert "dry run: " + str(out) + " would be created" in cli(str(tiny_native), str(out), "--dry-run").stdout
    assert cli(str(tiny_native), str(out)).returncode == 0
    up = cli(str(tiny_native), str(out), "--dry-run")
    assert up.returncode == 0 and "is already up to date" in up.stdout
    assert (
        json.loads(cli(str(tiny_native), str(out), "--dry-run", "--overwrite", "--json").stdout)["would"] == "replace"
    )


def test_json_summary(tiny_native: Path, tmp_path: Path) -> None:
    r = cli(str(tiny_native), str(tmp_path / "out"), "--json")
    assert r.returncode == 0
    summary = json.loads(r.stdout)
    assert summary["status"] == "converted" and summary["output"] == str(tmp_path / "out")
    assert summary["bytes_read"] == summary["bytes_written"] == summary["bytes_planned"] > 0
    assert summary["seconds"] >= 0


def test_synth_convert_and_check_need_no_numpy(tmp_path: Path) -> None:
    """numpy is not a runtime dependency: the byte paths must not reach for it."""
    script = f"""
import sys
sys.modules["numpy"] = None  # any import of numpy now fails
from dsv4.convert.synth import write_checkpoint
from dsv4.convert.pipeline import convert
from dsv4.convert.check.run import run_checks
src = write_checkpoint({str(tmp_path / "n")!r}, preset="tiny", seed=3)
convert(src, {str(tmp_path / "x")!r})
report = run_checks({str(tmp_path / "x")!r})
assert report.ok, report.summary()
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


# --- issue 21 item 2: a source is one object with a lifetime -----------------------------------
@pytest.fixture
def closes(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every LocalReader, each time it is closed (convert/sources/source.py: Source.close); kept
    alive here, so two readers are never the same object."""
    from dsv4.convert.sources import local

    closed: list[object] = []
    close = local.LocalReader.close

    def counted(self: local.LocalReader) -> None:
        closed.append(self)
        close(self)

    monkeypatch.setattr(local.LocalReader, "close", counted)
    return closed


def _interrupting_bar(total: int, done: int, quiet: bool) -> None:
    raise KeyboardInterrupt  # Ctrl-C once the source is open and planned, before a byte is written


def test_a_source_is_closed_exactly_once_on_every_path(
    tiny_native: Path, tmp_path: Path, closes: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsv4.convert import pipeline
    from dsv4.convert.pipeline import dry_run

    convert(tiny_native, tmp_path / "ok")  # success
    assert len(closes) == 1
    dry_run(tiny_native, tmp_path / "preview")  # plans, writes nothing
    assert len(closes) == 2 and closes[0] is not closes[1]
    with pytest.raises(model_errors.DSV4Error):  # the plan is refused: a native checkpoint has no layout record
        convert(tiny_native, tmp_path / "reverse", reverse=True)
    assert len(closes) == 3
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in tiny_native.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    os.truncate(broken / "model-00005-of-00005.safetensors", 4)  # its header cannot be read: the inventory fails
    with pytest.raises(model_errors.CheckpointError) as raised:
        convert(broken, tmp_path / "from-broken")
    assert raised.value.kind == "truncated_shard"
    assert len(closes) == 4  # the reader exists before the headers are read (it notes the files first)
    monkeypatch.setattr(pipeline, "progress_bar", _interrupting_bar)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_native, tmp_path / "interrupted")
    assert len(closes) == 5 and len({id(r) for r in closes}) == 5  # five sources, each closed once
