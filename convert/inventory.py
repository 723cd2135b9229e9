"""The source inventory: every tensor of a checkpoint, from safetensors headers alone.

A local directory is read by the model layer's checkpoint reader (model/checkpoint.py), a
hub repository by convert/hub_source.py with the same header parser; both give an Inventory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from dsv4.model.checkpoint import CONFIG, Checkpoint
from dsv4.model.config import ModelConfig
from dsv4.model.safetensors_header import TensorBytes


@dataclass(frozen=True)
class Inventory:
    """A checkpoint as headers describe it. `location` is a directory or a hub repo."""

    location: str
    config: dict[str, Any]
    tensors: dict[str, TensorBytes]
    file_sizes: dict[str, int]
    header_bytes: int = 0  # bytes read to build this inventory
    revision: str | None = None  # resolved commit, for hub sources
    config_bytes: bytes = b""  # config.json as read (a draft directory keeps it byte for byte)
    extra: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def model_config(self) -> ModelConfig:
        """`config` validated, once however often planning asks (malformed_config 18,
        unsupported_layout 35, naming the file and the field)."""
        return ModelConfig.from_dict(self.config, f"{self.location}/{CONFIG}")


def read_inventory(path: str | Path) -> Inventory:
    """Open a local checkpoint directory (index + shards, or one model.safetensors),
    reading only config.json, the index and each shard's header."""
    checkpoint = Checkpoint(path)
    config, headers = checkpoint.config, checkpoint.headers
    return Inventory(
        str(checkpoint.root),
        config,
        headers.tensors,
        headers.file_sizes,
        headers.header_bytes,
        config_bytes=checkpoint.config_bytes,
    )
