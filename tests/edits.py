"""Editing a small converted checkpoint in place for tests that break one thing: the
tensors or config.json changed, and the bookkeeping (index, conversion.json) resealed so that
only the change a test made is wrong."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SHARD = "model-00001-of-00001.safetensors"  # a tiny conversion fits one shard
INDEX = "model.safetensors.index.json"
RECORD = "conversion.json"


def raw_tensor_bytes(path: Path) -> dict[str, tuple[str, bytes]]:
    """name -> (dtype, bytes) straight from a safetensors file, independent of the code under test."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    return {
        k: (v["dtype"], data[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]]) for k, v in header.items()
    }


def reseal(out: Path) -> None:
    """Rewrite the index and conversion.json from the shards as they now are, so that only
    the change a test made is wrong, not the bookkeeping around it."""
    record = json.loads((out / "conversion.json").read_text())
    weight_map, tensors, total = {}, {}, 0
    for shard in sorted(out.glob("model-*.safetensors")):
        for name, (_, data) in raw_tensor_bytes(shard).items():
            weight_map[name] = shard.name
            tensors[name] = {"file": shard.name, "nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            total += len(data)
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    record["tensors"] = tensors
    (out / "conversion.json").write_text(json.dumps(record))


def edit_tensors(out: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(out / SHARD)
    edit(tensors)
    save_file(tensors, out / SHARD, metadata={"format": "pt"})
    reseal(out)


def edit_config(out: Path, edit: Callable[[dict], None]) -> None:
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under `root` and its sha256: what a test compares to say nothing was changed."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def replace_by_special_file(path: Path, kind: str) -> None:
    """`path` replaced by a FIFO (kind "fifo": a read blocks) or a link to /dev/zero (endless)."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")  # endless: read whole, it fills memory
