"""A header-first safetensors writer.

safetensors' own `save_file` needs every tensor in memory at once. Writing the final
header first and then each tensor's bytes at their final offset lets a converter (or the
synthetic checkpoint writer) stream any amount of data with bounded memory, resume
a partly written file, and leave unwritten regions as file holes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4.model.dtypes import ITEMSIZE, nbytes, tensor_bytes

if TYPE_CHECKING:
    import torch

HEADER_ALIGN = 8  # safetensors pads its header so tensor data start 8-byte aligned


def shard_name(k: int, n: int) -> str:
    """File name of shard k (0-based) of n, as the released checkpoints name theirs."""
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors dtype name, e.g. "F8_E4M3"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


def encode_header(specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """The bytes before the tensor data (length prefix + padded JSON) and each tensor's
    offset relative to the start of the data section, in the order given."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offsets: dict[str, int] = {}
    pos = 0
    for spec in specs:
        if spec.dtype not in ITEMSIZE:
            raise ValueError(f"{spec.name}: unknown dtype {spec.dtype}")
        if spec.name in offsets:
            raise ValueError(f"{spec.name}: listed twice")
        offsets[spec.name] = pos
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [pos, pos + spec.nbytes]}
        pos += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % HEADER_ALIGN)
    return struct.pack("<Q", len(raw)) + raw, offsets


def _as_bytes(data: bytes | bytearray | memoryview | torch.Tensor) -> memoryview:
    # a byte buffer as it is, anything else is a tensor (not isinstance(torch.Tensor): the
    # converter writes buffers only and should not import torch for this test)
    return memoryview(data).cast("B") if isinstance(data, (bytes, bytearray, memoryview)) else tensor_bytes(data)


class ShardWriter:
    """One output safetensors file. The constructor writes the final header and sets the
    file's final length; `write` fills tensor bytes at their final offsets in any order.
    With resume=True an existing file with exactly this header is reopened (`resumed`)."""

    def __init__(
        self,
        path: str | Path,
        specs: Sequence[TensorSpec],
        metadata: dict[str, str] | None = None,
        *,
        resume: bool = False,
    ):
        self.path = Path(path)
        self.specs = {s.name: s for s in specs}
        head, rel = encode_header(specs, metadata)
        self.data_start = len(head)
        self.offsets = {name: self.data_start + off for name, off in rel.items()}
        self.size = self.data_start + sum(s.nbytes for s in specs)
        self.resumed = False
        if resume and self.path.exists():
            self._file = open(self.path, "r+b")
            self.resumed = self._file.read(len(head)) == head and os.fstat(self._file.fileno()).st_size == self.size
            if not self.resumed:  # torn while its header was written: start the file again
                self._file.close()
        if not self.resumed:
            self._file = open(self.path, "wb")
            self._file.write(head)
            self._file.truncate(self.size)

    def write(self, name: str, data: bytes | bytearray | memoryview | torch.Tensor, at: int = 0) -> int:
        """Write raw bytes at byte offset `at` within tensor `name`; returns bytes written."""
        view = _as_bytes(data)
        spec = self.specs[name]
        if at < 0 or at + len(view) > spec.nbytes:
            raise ValueError(
                f"{self.path.name}: write of {len(view)} bytes at {at} overruns tensor {name} ({spec.nbytes} bytes)"
            )
        self._file.seek(self.offsets[name] + at)
        self._file.write(view)
        return len(view)

    def start_writeback(self, name: str, at: int, n: int) -> None:
        """Have the kernel start writing these bytes of tensor `name` to disk now, without
        waiting (POSIX_FADV_DONTNEED starts writeback of dirty pages, then drops the clean
        ones from the cache): disk writes overlap the reads still to come, so `sync` finds
        little left, and the output does not fill the page cache. Bytes are unchanged."""
        self._file.flush()
        os.posix_fadvise(self._file.fileno(), self.offsets[name] + at, n, os.POSIX_FADV_DONTNEED)

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
