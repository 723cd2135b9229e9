"""The source inventory: headers only, exact byte ranges, and one distinct error per
malformed checkpoint, each naming the file and the tensor."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4.convert.exit_codes import code_of
from dsv4.convert.inventory import read_inventory
from dsv4.model import errors as model_errors
from dsv4.model.checkpoint import INDEX_NAME

CONFIG = {"model_type": "deepseek_v4"}


def make_checkpoint(
    root: Path, shards: dict[str, dict[str, torch.Tensor]], weight_map: dict[str, str] | None = None
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    for name, tensors in shards.items():
        save_file(tensors, str(root / name))
    if weight_map is None:
        weight_map = {k: name for name, tensors in shards.items() for k in tensors}
    (root / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def two_shards(root: Path) -> Path:
    return make_checkpoint(
        root,
        {
            "model-00001-of-00002.safetensors": {"embed.weight": torch.ones(4, 8, dtype=torch.bfloat16)},
            "model-00002-of-00002.safetensors": {
                "mtp.0.e_proj.weight": torch.zeros(8, 8).to(torch.float8_e4m3fn),
                "mtp.0.e_proj.scale": torch.ones(1, 1).to(torch.float8_e8m0fnu),
            },
        },
    )


def test_byte_ranges_point_at_each_tensors_bytes(tiny_native: Path) -> None:
    inv = read_inventory(tiny_native)
    assert inv.config["model_type"] == "deepseek_v4"
    for name in ["embed.weight", "mtp.0.e_proj.scale", "mtp.0.ffn.experts.3.w2.weight", "layers.0.ffn.gate.tid2eid"]:
        src = inv.tensors[name]
        with open(tiny_native / src.file, "rb") as f:
            f.seek(src.start)
            raw = f.read(src.nbytes)
        with safe_open(str(tiny_native / src.file), "pt") as f:
            expected = f.get_tensor(name)
        assert raw == expected.contiguous().view(torch.uint8).numpy().tobytes()
        assert list(expected.shape) == list(src.shape)


def test_single_file_checkpoint(tmp_path: Path) -> None:
    tmp_path.joinpath("config.json").write_text("{}")
    save_file({"a": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    inv = read_inventory(tmp_path)
    assert inv.tensors["a"].file == "model.safetensors" and inv.tensors["a"].shape == (3,)


def test_reads_headers_only(flash_sparse: Path) -> None:
    inv = read_inventory(flash_sparse)
    assert len(inv.tensors) == 69_187
    header_sizes = []
    for file in inv.file_sizes:
        with open(flash_sparse / file, "rb") as f:
            header_sizes.append(8 + struct.unpack("<Q", f.read(8))[0])
    assert inv.header_bytes == sum(header_sizes)
    assert inv.header_bytes < 10**8 < sum(inv.file_sizes.values())


def test_missing_shard(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    os.remove(root / "model-00002-of-00002.safetensors")
    with pytest.raises(model_errors.CheckpointError, match="model-00002-of-00002.safetensors") as raised:
        read_inventory(root)
    assert raised.value.kind == "missing_shard"


def test_index_key_not_in_named_shard(tmp_path: Path) -> None:
    root = make_checkpoint(
        tmp_path / "c",
        {"a.safetensors": {"x": torch.zeros(2)}, "b.safetensors": {"y": torch.zeros(2)}},
        weight_map={"x": "b.safetensors", "y": "b.safetensors"},
    )
    with pytest.raises(
        model_errors.CheckpointError, match=r"b.safetensors: tensor x is listed in .* but not in the shard.s header"
    ) as raised:
        read_inventory(root)
    assert raised.value.kind == "index_mismatch"


def test_index_key_missing_from_every_shard(tmp_path: Path) -> None:
    root = make_checkpoint(
        tmp_path / "c",
        {"a.safetensors": {"x": torch.zeros(2)}},
        weight_map={"x": "a.safetensors", "ghost": "a.safetensors"},
    )
    with pytest.raises(model_errors.CheckpointError, match="tensor ghost") as raised:
        read_inventory(root)
    assert raised.value.kind == "index_mismatch"


def test_key_in_two_shards(tmp_path: Path) -> None:
    root = make_checkpoint(
        tmp_path / "c",
        {"a.safetensors": {"x": torch.zeros(2)}, "b.safetensors": {"x": torch.zeros(2), "y": torch.zeros(2)}},
        weight_map={"x": "a.safetensors", "y": "b.safetensors"},
    )
    with pytest.raises(
        model_errors.CheckpointError, match="tensor x is in both a.safetensors and b.safetensors"
    ) as raised:
        read_inventory(root)
    assert raised.value.kind == "duplicate_tensor"


def test_truncated_shard(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    shard = root / "model-00001-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(
        model_errors.CheckpointError, match="model-00001-of-00002.safetensors: tensor embed.weight"
    ) as raised:
        read_inventory(root)
    assert raised.value.kind == "truncated_shard"


def rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def test_unknown_dtype(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    rewrite_header(root / "model-00001-of-00002.safetensors", lambda h: h["embed.weight"].update(dtype="F4"))
    with pytest.raises(model_errors.CheckpointError, match="tensor embed.weight: unknown dtype F4") as raised:
        read_inventory(root)
    assert raised.value.kind == "unknown_dtype"


def test_offsets_that_disagree_with_shape(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    rewrite_header(root / "model-00001-of-00002.safetensors", lambda h: h["embed.weight"].update(shape=[4, 9]))
    with pytest.raises(model_errors.CheckpointError, match="tensor embed.weight") as raised:
        read_inventory(root)
    assert raised.value.kind == "malformed_header"


def test_header_not_json(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    shard = root / "model-00001-of-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[8] = ord("#")
    shard.write_bytes(bytes(raw))
    with pytest.raises(
        model_errors.CheckpointError, match="model-00001-of-00002.safetensors: header is not valid JSON"
    ) as raised:
        read_inventory(root)
    assert raised.value.kind == "malformed_header"


@pytest.mark.parametrize("bad", ["../x.safetensors", "/etc/x.safetensors", "sub/x.safetensors", ".."])
def test_shard_names_must_be_plain_files(tmp_path: Path, bad: str) -> None:
    root = two_shards(tmp_path / "c")
    index = json.loads((root / INDEX_NAME).read_text())
    index["weight_map"]["embed.weight"] = bad
    (root / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(model_errors.CheckpointError, match="not a plain file name") as raised:
        read_inventory(root)
    assert raised.value.kind == "unsafe_shard_path"


def test_symlink_leaving_the_directory(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(root / "model-00001-of-00002.safetensors", outside)
    (root / "model-00001-of-00002.safetensors").symlink_to(outside)
    with pytest.raises(model_errors.CheckpointError, match="outside the checkpoint directory") as raised:
        read_inventory(root)
    assert raised.value.kind == "unsafe_shard_path"


def test_missing_config(tmp_path: Path) -> None:
    root = two_shards(tmp_path / "c")
    os.remove(root / "config.json")
    with pytest.raises(model_errors.CheckpointError, match="config.json") as raised:
        read_inventory(root)
    assert raised.value.kind == "missing_config"


def test_each_failure_has_its_own_exit_code() -> None:
    classes = [
        "missing_shard",
        "truncated_shard",
        "index_mismatch",
        "duplicate_tensor",
        "unknown_dtype",
        "unsafe_shard_path",
        "malformed_header",
        "missing_config",
        "source_not_found",
    ]
    codes = [code_of(c) for c in classes]
    assert len(set(codes)) == len(codes)
