"""A safetensors checkpoint directory, read once and strictly: config.json (validated by
ModelConfig, every refusal naming the file and the field), model.safetensors.index.json,
each shard's header (model/safetensors_header.py) and the tensors themselves. The
converter's inventory, `check`, the model's loader and both references read checkpoint
directories through `Checkpoint`; the hub reader reuses its index and shard merge."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE

from dsv4.model import strictjson
from dsv4.model.config import CONFIG, ModelConfig, parse_config
from dsv4.model.errors import CheckpointError, DSV4Error, LoadError
from dsv4.model.safetensors_header import TensorBytes, json_kind, read_header

if TYPE_CHECKING:
    import torch

INDEX_NAME = SAFETENSORS_INDEX_FILE  # model.safetensors.index.json
SINGLE_FILE = SAFETENSORS_SINGLE_FILE  # model.safetensors: a checkpoint of one file, no index


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


def not_a_regular_file(path: Path) -> str | None:
    """The refusal for a `path` that exists but is no regular file (a directory, a FIFO...),
    so that it is not reported as missing; None for a regular file or nothing there."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a fifo"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    kind = next((name for test, name in kinds if test(mode)), "not a file")
    return f"{path}: is {kind}, not a regular file"


def read_local_header(path: Path) -> tuple[dict[str, TensorBytes], int]:
    """The tensors of one local shard and the bytes before its data section."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        return read_header(f.read(8), f.read, path.name, size)


def merge_shards(
    location: str, weight_map: Mapping[str, str] | None, shards: Iterable[tuple[str, dict[str, TensorBytes]]]
) -> dict[str, TensorBytes]:
    """Union of per-shard tensors, checked against the index's weight map."""
    tensors: dict[str, TensorBytes] = {}
    for file, found in shards:
        for name, src in found.items():
            if name in tensors:
                raise CheckpointError(
                    f"{location}: tensor {name} is in both {tensors[name].file} and {file}",
                    kind="duplicate_tensor",
                    path=str(location),
                    tensor=name,
                )
            if weight_map is not None and name not in weight_map:
                raise CheckpointError(
                    f"{file}: tensor {name} is not listed in {INDEX_NAME}",
                    kind="index_mismatch",
                    path=str(file),
                    tensor=name,
                )
            if weight_map is not None and weight_map[name] != file:
                raise CheckpointError(
                    f"{file}: tensor {name} is listed in {INDEX_NAME} under {weight_map[name]}",
                    kind="index_mismatch",
                    path=str(file),
                    tensor=name,
                )
            tensors[name] = src
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors:
                raise CheckpointError(
                    f"{file}: tensor {name} is listed in {INDEX_NAME} but not in the shard's header",
                    kind="index_mismatch",
                    path=str(file),
                    tensor=name,
                )
    return tensors


@dataclass(frozen=True)
class ShardHeaders:
    """What a checkpoint's index and shard headers say, checked against each other."""

    index_file: str  # the file that lists the tensors: the index, or the one model.safetensors
    tensors: dict[str, TensorBytes]
    file_sizes: dict[str, int]
    header_bytes: int  # bytes read before the data sections: what reading the headers cost


class Checkpoint:
    """The checkpoint directory `root`. Each part is read on first use and once: the
    config (`config_bytes`, `config`, `model_config`), the index and headers (`headers`,
    no tensor byte read) and the tensors (`load_tensors`)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.config_path = self.root / CONFIG

    @cached_property
    def config_bytes(self) -> bytes:
        """config.json byte for byte (a draft directory keeps it so); missing_config
        when it is absent, no regular file, or unreadable."""
        path = self.config_path
        if (odd := not_a_regular_file(path)) is not None:
            raise CheckpointError(odd, kind="missing_config", path=str(path))
        if not path.is_file():
            raise CheckpointError(
                f"{path}: no config.json in the checkpoint directory", kind="missing_config", path=str(path)
            )
        try:
            return strictjson.read_record_bytes(path)
        except OSError as exc:
            raise CheckpointError(
                f"{path}: cannot be read ({exc.strerror})", kind="missing_config", path=str(path)
            ) from None

    @cached_property
    def config(self) -> dict[str, Any]:
        """config.json's fields: a strict JSON object (malformed_config otherwise)."""
        return parse_config(self.config_bytes, str(self.config_path))

    @cached_property
    def model_config(self) -> ModelConfig:
        """config.json validated: malformed_config (18) or unsupported_layout (35),
        naming the file and the field."""
        return ModelConfig.from_dict(self.config, str(self.config_path))

    @cached_property
    def weight_map(self) -> dict[str, str] | None:
        """The index's tensor -> shard map; None for a one-file checkpoint (no index)."""
        index_path, single = self.root / INDEX_NAME, self.root / SINGLE_FILE
        if (odd := not_a_regular_file(index_path if os.path.lexists(index_path) else single)) is not None:
            raise CheckpointError(odd, kind="missing_shard")
        if index_path.is_file():
            return load_index(strictjson.read_record_bytes(index_path), INDEX_NAME)
        if single.is_file():
            return None
        raise CheckpointError(
            f"{self.root}: neither {INDEX_NAME} nor {SINGLE_FILE} found", kind="missing_shard", path=str(self.root)
        )

    @cached_property
    def headers(self) -> ShardHeaders:
        """Every shard's header, each tiling its file, merged and checked against the index.
        A shard must exist and resolve to a file inside the directory (a symlink may not
        lead elsewhere)."""
        weight_map = self.weight_map
        files = [SINGLE_FILE] if weight_map is None else sorted(set(weight_map.values()))
        real_root = self.root.resolve()
        shards, sizes, header_bytes = [], {}, 0
        for file in files:
            shard = self.root / file
            if (odd := not_a_regular_file(shard)) is not None:
                raise CheckpointError(odd, kind="missing_shard")
            if not shard.is_file():
                named = sorted(n for n, f in (weight_map or {}).items() if f == file)
                what = f" for {named[0]}" + (f" and {len(named) - 1} more tensors" if len(named) > 1 else "")
                raise CheckpointError(
                    f"{shard}: named in {INDEX_NAME}{what if named else ''} but does not exist",
                    kind="missing_shard",
                    path=str(shard),
                )
            if shard.resolve().parent != real_root:
                raise CheckpointError(
                    f"{shard}: resolves to {shard.resolve()}, outside the checkpoint directory",
                    kind="unsafe_shard_path",
                    path=str(shard),
                )
            found, data_start = read_local_header(shard)
            shards.append((file, found))
            sizes[file] = shard.stat().st_size
            header_bytes += data_start
        tensors = merge_shards(str(self.root), weight_map, shards)
        return ShardHeaders(SINGLE_FILE if weight_map is None else INDEX_NAME, tensors, sizes, header_bytes)

    def load_tensors(self, names: Iterable[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The tensors `names` (listed in `headers`: missing_key otherwise), read through
        safetensors. On the CPU each is a view of safetensors' private (copy-on-write) map of
        its shard: loading reads and copies nothing, a page is read when first touched, and a
        write would copy the page, never reach the file. Any other device gets its one copy,
        a tensor at a time."""
        from safetensors import safe_open  # imports torch: only the commands that load tensors

        listed = self.headers.tensors
        by_file: dict[str, list[str]] = {}
        for name in names:
            if name not in listed:
                raise LoadError(
                    f"{self.root / self.headers.index_file}: no tensor {name} in the checkpoint",
                    kind="missing_key",
                    path=str(self.root / self.headers.index_file),
                    tensor=name,
                )
            by_file.setdefault(listed[name].file, []).append(name)
        state: dict[str, torch.Tensor] = {}
        for file, in_file in sorted(by_file.items()):
            with safe_open(self.root / file, framework="pt", device="cpu") as f:
                for name in in_file:
                    state[name] = f.get_tensor(name).to(device)
        return state


def local_weight_map(root: Path) -> tuple[dict[str, str], str]:
    """tensor name -> shard file of the checkpoint directory `root`, and the file that says
    so: the index, or the one model.safetensors (whose header lists its tensors)."""
    checkpoint = Checkpoint(root)
    if checkpoint.weight_map is not None:
        return checkpoint.weight_map, INDEX_NAME
    return {name: src.file for name, src in checkpoint.headers.tensors.items()}, SINGLE_FILE


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
            f"convert it first (convert-dsv4 {root} OUT --target xpu), then run convert-dsv4 {command} OUT --native "
            f"{root}",
            kind="unsupported_layout",
            path=str(root),
        )
