"""The files of a safetensors checkpoint directory: their names, and the one reader of
model.safetensors.index.json (the converter's inventory, `check` and the model's loader all
read indexes through `load_index`)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from huggingface_hub.constants import CONFIG_NAME, SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE

from dsv4.model import strictjson
from dsv4.model.errors import CheckpointError, DSV4Error

INDEX_NAME = SAFETENSORS_INDEX_FILE  # model.safetensors.index.json
SINGLE_FILE = SAFETENSORS_SINGLE_FILE  # model.safetensors: a checkpoint of one file, no index
CONFIG = CONFIG_NAME  # config.json


def json_kind(value: Any) -> str:
    """What a JSON value is, for a message: 'an object', 'a list', 'null', ..."""
    if value is None:
        return "null"
    kinds = (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (list, "a list"),
        (dict, "an object"),
    )
    return next(kind for t, kind in kinds if isinstance(value, t))


def check_shard_name(name: str, index_file: str) -> None:
    """Index entries name plain files inside the checkpoint, nothing else."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or os.path.isabs(name)
    ):
        raise CheckpointError(
            f"{index_file}: shard name {name!r} is not a plain file name inside the checkpoint",
            kind="unsafe_shard_path",
            path=str(index_file),
        )


def load_index(raw: bytes, index_file: str) -> dict[str, str]:
    """The weight map of a model.safetensors.index.json, every field the tool reads
    checked: weight_map maps tensor names to plain shard file names; metadata, when
    present, is an object and its total_size a non-negative integer."""
    try:
        index = strictjson.loads(raw)
    except strictjson.StrictJSONError as exc:
        raise CheckpointError(
            f"{index_file}: not valid JSON ({exc})", kind="malformed_header", path=str(index_file)
        ) from None
    if not isinstance(index, dict):
        raise CheckpointError(
            f"{index_file}: not a safetensors index: the top level is {json_kind(index)}, not an object",
            kind="malformed_header",
            path=str(index_file),
        )
    if "weight_map" not in index:
        raise CheckpointError(
            f"{index_file}: not a safetensors index: no weight_map", kind="malformed_header", path=str(index_file)
        )
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index_file}: weight_map is {json_kind(weight_map)}, not an object",
            kind="malformed_header",
            path=str(index_file),
        )
    if not weight_map:
        raise CheckpointError(
            f"{index_file}: weight_map lists no tensor", kind="malformed_header", path=str(index_file)
        )
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(
                f"{index_file}: weight_map[{name!r}] is {json_kind(shard)}, not a shard file name",
                kind="malformed_header",
                path=str(index_file),
            )
    metadata = index.get("metadata", {})
    if not isinstance(metadata, dict):
        raise CheckpointError(
            f"{index_file}: metadata is {json_kind(metadata)}, not an object",
            kind="malformed_header",
            path=str(index_file),
        )
    if "total_size" in metadata and not (type(metadata["total_size"]) is int and metadata["total_size"] >= 0):
        raise CheckpointError(
            f"{index_file}: metadata.total_size is {metadata['total_size']!r}, not a non-negative integer",
            kind="malformed_header",
            path=str(index_file),
        )
    for shard in sorted(set(weight_map.values())):
        check_shard_name(shard, index_file)
    return weight_map


def local_weight_map(root: Path) -> tuple[dict[str, str], str]:
    """tensor name -> shard file of the checkpoint directory `root`, and the file that says
    so: the index, or the one model.safetensors (whose header lists its tensors)."""
    index = root / INDEX_NAME
    if index.is_file():
        return load_index(strictjson.read_record_bytes(index), str(index)), INDEX_NAME
    single = root / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open  # a one-file checkpoint only; imports torch

        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE), SINGLE_FILE
    raise CheckpointError(f"{root}: neither {INDEX_NAME} nor {SINGLE_FILE} found", kind="missing_shard", path=str(root))


MAIN_LAYER = "layers."  # the main model's decoder layers: only a full native checkpoint has them


def is_full_native(tensor_names: Iterable[str]) -> bool:
    """A full native checkpoint (main-model `layers.*` tensors), as opposed to a converted
    one or a draft-only directory (`mtp.*` with embed and head)."""
    return any(name.startswith(MAIN_LAYER) for name in tensor_names)


def refuse_full_native(root: Path, command: str) -> None:
    """unsupported_layout naming the command that takes `root`, when the converted
    checkpoint `command` was given is a full native one. Anything else wrong with `root`
    is left to the command's own checks."""
    try:
        weight_map, _ = local_weight_map(root)
    except (DSV4Error, OSError):
        return
    if is_full_native(weight_map):
        raise CheckpointError(
            f"{root}: is a native DeepSeek V4 checkpoint (the main model's layers.* tensors), not a converted one: "
            f"convert it first (convert-dsv4 {root} OUT --target xpu), then run convert-dsv4 {command} OUT --native {root}",
            kind="unsupported_layout",
            path=str(root),
        )
