"""A planned output tensor: the source bytes it is (a copy), or the transform that computes
it from native tensors (a served draft's computed tensor, convert/transforms.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dsv4.model.dtypes import nbytes
from dsv4.model.safetensors_header import TensorBytes


@dataclass(frozen=True)
class Transform:
    """How a computed tensor is made: `name` an entry of convert/transforms.py's TRANSFORMS,
    `args` its parameters as (key, value) pairs, `inputs` the native tensors it reads (each
    whole, with its source bytes), `exact` whether its scheme promises the native values
    back bit for bit, `source_block` the source's FP8 block (config.json's
    quantization_config.weight_block_size: its FP8 weights' scale grid). A name "family.leaf"
    is one output of a computation that makes several tensors of the same inputs (a weight
    and its scale): `computation` is what they share."""

    name: str
    args: tuple[tuple[str, Any], ...]
    inputs: tuple[PlannedTensor, ...]
    exact: bool
    source_block: tuple[int, int]

    @property
    def family(self) -> str:
        return self.name.partition(".")[0]

    @property
    def leaf(self) -> str:
        return self.name.partition(".")[2]

    @property
    def computation(self) -> tuple[str, str, tuple[str, ...]]:
        # the args as JSON: a value may be a list (a QuantizationArgs' block_structure), unhashable
        return self.family, json.dumps(self.args), tuple(t.name for t in self.inputs)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "args": [list(pair) for pair in self.args],
            "inputs": [t.name for t in self.inputs],
            "exact": self.exact,
        }


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    # the source bytes it is made of, in order; a computed tensor's: its inputs', in order
    pieces: tuple[TensorBytes, ...]
    op: str
    rule: str
    transform: Transform | None = None  # None: the tensor is its pieces' bytes

    @property
    def nbytes(self) -> int:
        if self.transform is not None:
            return nbytes(self.dtype, self.shape)
        return sum(p.nbytes for p in self.pieces)
