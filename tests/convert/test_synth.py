"""The synthetic native checkpoint writer: layout counts match the release exactly
(mapping/README.md#native-checkpoint-format), files are valid safetensors, values are sane and
deterministic, sparse replicas are cheap; `synth` never writes over what a directory already holds,
and a full disk is exit 42 naming the path."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from edits import tree_digest
from inprocess import run_one_line
from safetensors import safe_open

from dsv4.convert import synth
from dsv4.convert.cli.main import cli
from dsv4.convert.synth import INDEX_NAME, pack_codes, write_checkpoint
from dsv4.model.checkpoint import Checkpoint
from dsv4.model.config import ModelConfig
from dsv4.model.presets import PRESETS, preset_config
from dsv4.model.storage import FP4

# mapping/README.md#storage-dtypes, written out here rather than imported so the test checks the code
E2M1_LUT = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]

FLASH_DTYPES = {"BF16": 433, "F32": 417, "F8_E4M3": 375, "F8_E8M0": 34167, "I8": 33792, "I64": 3}
FLASH_MTP_DTYPES = {"BF16": 8, "F32": 11, "F8_E4M3": 10, "F8_E8M0": 778, "I8": 768}
FLASH_MTP_BYTES = 3_593_787_756


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors header: u64 little-endian length, then JSON. Never touches the data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def shard_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("model-*.safetensors"))


def all_headers(ckpt: Path) -> dict[str, tuple[str, dict]]:
    """tensor name -> (shard file name, header entry)"""
    return {name: (f.name, entry) for f in shard_files(ckpt) for name, entry in read_header(f).items()}


def entry_bytes(entry: dict) -> int:
    start, end = entry["data_offsets"]
    return end - start


@pytest.fixture(scope="module")
def flash(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("flash"), preset="flash", main_layers="all", sparse=True)


@pytest.fixture(scope="module")
def pro(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("pro"), preset="pro", main_layers="all", sparse=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), main_layers="all")


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_base"), variant="base", main_layers="all")


def load_all(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in shard_files(ckpt):
        with safe_open(f, framework="pt") as sf:
            out.update({name: sf.get_tensor(name) for name in sf.keys()})
    return out


# --- layout: counts, bytes, shard placement ---------------------------------------------


@pytest.mark.slow
def test_flash_matches_release_counts(flash: Path) -> None:
    headers = all_headers(flash)
    assert len(headers) == 69_187
    assert Counter(e["dtype"] for _, e in headers.values()) == FLASH_DTYPES
    mtp = {n: e for n, (_, e) in headers.items() if n.startswith("mtp.")}
    assert len(mtp) == 1_575
    assert Counter(e["dtype"] for e in mtp.values()) == FLASH_MTP_DTYPES
    assert sum(entry_bytes(e) for e in mtp.values()) == FLASH_MTP_BYTES


@pytest.mark.slow
def test_pro_matches_release_counts(pro: Path) -> None:
    headers = all_headers(pro)
    assert len(headers) == 145_116
    assert sum(n.startswith("mtp.") for n in headers) == 2_343


@pytest.mark.slow
@pytest.mark.parametrize(("name", "n_shards"), [("flash", 46), ("pro", 64)])
def test_shards_laid_out_like_release(name: str, n_shards: int, request: pytest.FixtureRequest) -> None:
    ckpt: Path = request.getfixturevalue(name)
    files = shard_files(ckpt)
    assert [f.name for f in files] == [f"model-{k:05d}-of-{n_shards:05d}.safetensors" for k in range(1, n_shards + 1)]
    headers = all_headers(ckpt)
    assert headers["embed.weight"][0] == files[0].name
    assert headers["head.weight"][0] == files[-2].name
    assert {shard for n, (shard, _) in headers.items() if n.startswith("mtp.")} == {files[-1].name}
    assert headers["layers.7.attn.wkv.weight"][0] == files[8].name  # layer j -> shard j+2

    index = json.loads((ckpt / INDEX_NAME).read_text())
    assert index["weight_map"] == {n: shard for n, (shard, _) in headers.items()}
    assert index["metadata"]["total_size"] == sum(entry_bytes(e) for _, e in headers.values())
    assert json.loads((ckpt / "config.json").read_text()) == PRESETS[name]


@pytest.mark.slow
def test_sparse_files_are_holes(flash: Path) -> None:
    stats = [os.stat(f) for f in shard_files(flash)]
    logical = sum(s.st_size for s in stats)
    assert logical > 150e9
    assert sum(s.st_blocks * 512 for s in stats) < logical / 1000


def test_main_layer_subset(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path, preset="tiny", main_layers=1)
    headers = all_headers(ckpt)
    assert len(shard_files(ckpt)) == 4
    assert any(n.startswith("layers.0.") for n in headers)
    assert not any(n.startswith("layers.1.") for n in headers)
    with pytest.raises(ValueError, match="main_layers"):
        write_checkpoint(tmp_path / "bad", preset="tiny", main_layers=3)


def test_presets_are_consistent() -> None:
    for name, n_layers in (("flash", 43), ("pro", 61), ("tiny", 2)):
        cfg = ModelConfig.from_dict(preset_config(name))
        assert cfg.num_hidden_layers == n_layers
        assert len(cfg.compress_ratios) == n_layers + 1 and cfg.compress_ratios[-1] == 0
    assert preset_config("flash", "base")["expert_dtype"] == "fp8"
    assert PRESETS["flash"]["expert_dtype"] == "fp4"  # preset_config returns copies


# --- the files themselves ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "tiny_base"])
def test_safetensors_reads_every_tensor(name: str, request: pytest.FixtureRequest) -> None:
    ckpt: Path = request.getfixturevalue(name)
    headers = all_headers(ckpt)
    tensors = load_all(ckpt)
    assert tensors.keys() == headers.keys()
    for n, t in tensors.items():
        assert list(t.shape) == headers[n][1]["shape"], n


def test_tiny_values_are_sane(tiny: Path) -> None:
    cfg = Checkpoint(tiny).model_config
    tensors = load_all(tiny)
    for n, t in tensors.items():
        raw = t.view(torch.uint8)
        if t.dtype == torch.float8_e4m3fn:
            assert not ((raw == 0x7F) | (raw == 0xFF)).any(), f"{n}: NaN bytes"
        elif t.dtype == torch.float8_e8m0fnu:
            assert not (raw == 255).any(), f"{n}: NaN scale"
        elif t.is_floating_point():
            assert torch.isfinite(t.float()).all(), n
    scales = torch.cat([t.view(torch.uint8).flatten() for t in tensors.values() if t.dtype == torch.float8_e8m0fnu])
    assert scales.unique().numel() > 3
    assert torch.allclose(tensors["mtp.0.enorm.weight"].float().mean(), torch.tensor(1.0), atol=0.01)
    eids = tensors["layers.0.ffn.gate.tid2eid"]
    assert eids.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
    assert 0 <= eids.min() and eids.max() < cfg.n_routed_experts
    assert (eids[:, 0] != eids[:, 1]).all()


def dequant_fp8(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    scale = s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return w.float() * scale[: w.shape[0], : w.shape[1]]


def dequant_fp4(packed: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    raw = packed.view(torch.uint8).long()
    codes = torch.stack([raw & 0xF, raw >> 4], dim=-1).flatten(-2)
    return torch.tensor(E2M1_LUT)[codes] * s.float().repeat_interleave(32, 1)[:, : codes.shape[-1]]


@pytest.mark.parametrize("name", ["tiny", "tiny_base"])
def test_effective_weights_have_realistic_magnitude(name: str, request: pytest.FixtureRequest) -> None:
    """Dequantised (mapping/README.md#storage-dtypes) linear weights sit near the std ~0.02 of trained ones, so
    an MTP forward on them gives finite, non-trivial activations."""
    t = load_all(request.getfixturevalue(name))
    for lin in ("mtp.0.e_proj", "mtp.0.attn.wo_b", "mtp.0.ffn.shared_experts.w2", "mtp.0.ffn.experts.3.w1"):
        w, s = t[f"{lin}.weight"], t[f"{lin}.scale"]
        dense = dequant_fp4(w, s) if w.dtype == torch.int8 else dequant_fp8(w, s)
        assert 1e-3 < dense.std() < 0.1, lin


def test_base_variant_is_fp8_mixed(tiny_base: Path) -> None:
    assert json.loads((tiny_base / "config.json").read_text())["expert_dtype"] == "fp8"
    t = load_all(tiny_base)
    assert t["mtp.0.ffn.experts.0.w2.weight"].dtype == torch.float8_e4m3fn
    scale = t["mtp.0.ffn.experts.0.w2.scale"]
    assert scale.dtype == torch.float32 and (scale > 0).all()
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
    assert {"mtp.0.emb.tok_emb.weight", "mtp.0.head.weight"} <= t.keys()


def test_dspark_variant(tmp_path: Path) -> None:
    """mapping/README.md#dspark-source-checkpoint: each stage is a V4 block without the MTP-only tensors; stage 0 adds
    the target-feature projection, the last stage the head, Markov and confidence heads."""
    ckpt = write_checkpoint(tmp_path, variant="dspark")
    names = set(all_headers(ckpt))
    first = {"main_proj.weight", "main_proj.scale", "main_norm.weight"}
    last = {
        "norm.weight",
        "hc_head_fn",
        "hc_head_base",
        "hc_head_scale",
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
    }
    for s in range(3):
        stage = {n.removeprefix(f"mtp.{s}.") for n in names if n.startswith(f"mtp.{s}.")}
        assert first <= stage if s == 0 else not first & stage, s
        assert last <= stage if s == 2 else not last & stage, s
        assert len(stage - first - last) == 29 + 6 * 8, s  # one V4 block: 29 + 6E (tiny: E = 8)
        assert not {n for n in stage if n.split(".")[0] in ("enorm", "hnorm", "e_proj", "h_proj", "emb", "head")}, s
    config = json.loads((ckpt / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and "n_mtp_layers" not in config
    assert ModelConfig.from_dict(config).dspark_stages == 3
    load_all(ckpt)


def test_dspark_variant_of_each_preset(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["synth", str(tmp_path / "t"), "--preset", "tiny", "--variant", "dspark", "--sparse"]
    )
    # 6 top-level + 3 stages x (29 + 6 x 8 experts) + 3 (stage 0) + 7 (last stage); embed, top, one file per stage
    assert result.exit_code == 0 and result.output.startswith("synth: 247 tensors in 5 files,"), result.output
    # pro's DSpark release is V4-Pro-0813: 6 top-level + 3 x (29 + 6 x 384) + 3 + 7
    result = CliRunner().invoke(
        cli, ["synth", str(tmp_path / "p"), "--preset", "pro", "--variant", "dspark", "--sparse"]
    )
    assert result.exit_code == 0 and result.output.startswith("synth: 7015 tensors in 5 files,"), result.output
    assert json.loads((tmp_path / "p" / "config.json").read_text())["dspark_target_layer_ids"] == [58, 59, 60]
    # tiny-pro is tiny's Pro-0813 sibling, a DSpark release only
    result = CliRunner().invoke(cli, ["synth", str(tmp_path / "i"), "--preset", "tiny-pro", "--sparse"])
    assert (
        result.exit_code == 2
        and "unknown preset 'tiny-pro' for variant instruct" in result.output
        and not (tmp_path / "i").exists()
    )


# mapping/README.md#dspark-source-checkpoint: the V4-Flash-0731 release
FLASH_0731_DRAFTER_DTYPES = {"BF16": 20, "F32": 27, "F8_E4M3": 25, "F8_E8M0": 2_329, "I8": 2_304}
FLASH_0731_DRAFTER_BYTES = 10_862_838_300


@pytest.mark.slow
def test_dspark_flash_replica_is_the_0731_release(tmp_path: Path) -> None:
    """`synth --variant dspark --sparse --main-layers all` (the dspark variant's preset is the
    release, flash) = the release's census."""
    result = CliRunner().invoke(
        cli, ["synth", str(tmp_path / "c"), "--variant", "dspark", "--main-layers", "all", "--sparse"]
    )
    assert result.exit_code == 0, result.output
    ckpt = tmp_path / "c"
    headers = all_headers(ckpt)
    assert len(headers) == 72_317 and len(shard_files(ckpt)) == 48
    drafter = {n: v for n, v in headers.items() if n.startswith("mtp.")}
    assert len(drafter) == 4_705
    assert {f for f, _ in drafter.values()} == {f"model-000{k}-of-00048.safetensors" for k in (46, 47, 48)}
    assert not [n for n, (f, _) in headers.items() if f >= "model-00046" and not n.startswith("mtp.")]
    assert Counter(e["dtype"] for _, e in drafter.values()) == FLASH_0731_DRAFTER_DTYPES
    assert Counter(int(n.split(".")[1]) for n in drafter) == {0: 1568, 1: 1565, 2: 1572}
    assert sum(entry_bytes(e) for _, e in drafter.values()) == FLASH_0731_DRAFTER_BYTES
    # the main model is Flash's: 69,187 tensors minus its 1,575-tensor MTP block
    assert len(headers) - len(drafter) == 69_187 - 1_575
    config = json.loads((ckpt / "config.json").read_text())
    assert len(config["compress_ratios"]) == 46 and config["compress_ratios"][43:] == [0, 0, 0]
    assert (config["expert_dtype"], config["num_nextn_predict_layers"]) == ("fp4", 1)
    assert {k: config[k] for k in config if k.startswith("dspark_")} == {
        "dspark_block_size": 5,
        "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [40, 41, 42],
        "dspark_markov_rank": 256,
    }


# --- storage formats (mapping/README.md#storage-dtypes) ---------------------------------


def test_fp4_nibble_order() -> None:
    values = [0.5, -6.0, 1.5, 3.0]  # input indices 0, 1, 2, 3 of one row
    codes = torch.tensor([[E2M1_LUT.index(v) for v in values]], dtype=torch.uint8)
    packed = pack_codes(codes, FP4)
    assert packed.dtype == torch.int8 and packed.shape == (1, 2)
    assert packed.view(torch.uint8).tolist() == [[0xF1, 0x53]]  # low nibble = even index
    scale = torch.tensor([[126]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2^-1
    assert dequant_fp4(packed, scale)[0].tolist() == [0.25, -3.0, 0.75, 1.5]


def test_e8m0_meaning() -> None:
    e = torch.tensor([127, 120, 130], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert e.float().tolist() == [1.0, 2.0**-7, 8.0]


# --- determinism and bounded-memory writing ---------------------------------------------


def shard_bytes(ckpt: Path) -> list[bytes]:
    return [f.read_bytes() for f in shard_files(ckpt)]


def test_deterministic(tiny: Path, tmp_path: Path) -> None:
    again = write_checkpoint(tmp_path / "again", main_layers="all")
    assert shard_bytes(again) == shard_bytes(tiny)
    other = write_checkpoint(tmp_path / "other", main_layers="all", seed=1)
    assert all(a != b for a, b in zip(shard_bytes(other), shard_bytes(tiny), strict=True))
    # values depend on (seed, name) only: the MTP shard is the same whatever else is written
    mtp_only = write_checkpoint(tmp_path / "mtp_only", main_layers=0)
    assert shard_bytes(mtp_only)[-1] == shard_bytes(tiny)[-1]


def test_chunked_writes_fill_every_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A missed or misplaced block would leave a hole: all-zero rows."""
    monkeypatch.setattr(synth, "CHUNK_BYTES", 4096)
    t = load_all(write_checkpoint(tmp_path))
    for name in ("embed.weight", "mtp.0.ffn.experts.0.w1.weight", "mtp.0.e_proj.weight"):  # 64, 4, 16 blocks
        assert (t[name].view(torch.uint8) != 0).any(dim=1).all(), name


def test_cli(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["synth", str(tmp_path / "c"), "--preset", "tiny", "--main-layers", "all", "--sparse"]
    )
    assert result.exit_code == 0, result.output
    assert result.output.startswith("synth: 262 tensors in 5 files,")
    bad = CliRunner().invoke(cli, ["synth", str(tmp_path / "d"), "--main-layers", "some"])
    assert bad.exit_code == 2


# --- synth never writes over what a directory already holds -------------------------------
def test_synth_refuses_a_directory_that_is_not_empty(
    tiny_native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`synth` into an existing checkpoint (a typo for a real download) replaced its config,
    index and shards and left the rest: a mix of two checkpoints, exit 0."""
    user = tmp_path / "download"
    shutil.copytree(tiny_native, user)
    before = tree_digest(user)
    code, line = run_one_line(monkeypatch, capsys, "synth", str(user), "--preset", "tiny")
    assert code == 41
    assert line.startswith(f"error: {user}: exists and is not empty")
    assert tree_digest(user) == before


def test_synth_into_an_empty_directory_is_fine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    code, line = run_one_line(monkeypatch, capsys, "synth", str(tmp_path / "empty"), "--preset", "tiny")
    assert (code, line) == (0, "")
    assert (tmp_path / "empty" / "config.json").is_file()


def test_synth_on_a_full_disk_names_the_path_and_exits_42(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A write's ENOSPC carries no file name: the line said only `error: No space left on device`, exit 1."""

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("dsv4.convert.synth.ShardWriter", full_disk)
    out = tmp_path / "synthetic"
    code, line = run_one_line(monkeypatch, capsys, "synth", str(out), "--preset", "tiny")
    assert code == 42
    assert line.startswith(f"error: {out}: No space left on device")


def test_synth_library_still_writes_into_an_existing_directory(tmp_path: Path) -> None:
    """The library function keeps its contract (tests and benchmarks write into tmp dirs)."""
    (tmp_path / "note.txt").write_text("x")
    assert (write_checkpoint(tmp_path) / "config.json").is_file()
