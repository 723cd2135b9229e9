"""The bundled draft model's layout: the parameters the xpu target's tables write
(`target_layout`). Which layout a target has is the target registry's word
(mapping/targets.py); this is the layout of the bundled model.

The model is the single source of truth for target names, shapes and dtypes: the model is
instantiated on the meta device (no memory, any size) and its state_dict is read off.
The converter's plan and `check` compare against this; nothing hand-copies it.

Building the model needs torch (about a second of imports), while planning and table
validation need only the names, dtypes and shapes. So each layout is cached on disk, in
$XDG_CACHE_HOME/dsv4-convert (~/.cache/dsv4-convert), keyed by everything it is a
function of: the tool version, the bytes of the model's code and the whole config. A
cache entry that is missing, unreadable, malformed or for another key is ignored and
rebuilt; a cache directory that cannot be written only costs the rebuild.

Why the cache is safe to trust: an entry is read only if it is a regular file of bounded
size (strictjson.read_record_bytes: a FIFO or a device cannot hang or flood a command),
and only if it carries the sha256 of its own key and layout, written with it: an entry
torn, truncated, bit-flipped or edited in any field (one shape changed) does not match
its digest and is rebuilt from the model, so it can never make a good checkpoint fail
`convert` (33) or `check` (78). What the digest does not stop is someone who rewrites an
entry and its digest on purpose; the cache lives in the user's own directory, and whoever
may write there may as well edit the installed code, so that is no weaker than the tool
itself. The alternative, a hand-written copy of the layout as pure data, would be a second
statement of what the model already states, the very drift the layout exists to prevent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

from dsv4 import __version__
from dsv4.model.config import ModelConfig
from dsv4.model.memory import refuse_unless_torch_fits
from dsv4.model.native import Layout
from dsv4.model.strictjson import StrictJSONError, json_bytes, loads, read_record_bytes, write_record

if TYPE_CHECKING:
    from torch import nn

PACKAGE = Path(__file__).resolve().parent.parent
# the code the model's parameters are a function of: the model package (the native
# format and the dtype names live in it too)
MODEL_CODE = ("model",)
CACHE_FORMAT = 2  # 2: entries carry the sha256 of their key and layout
T = TypeVar("T")
TARGET_LAYER = re.compile(r"model\.layers\.(\d+)\.")  # a target-layout layer's number L


def target_layout(cfg: ModelConfig) -> Layout:
    """name -> (safetensors dtype, shape) of every parameter of the draft model for `cfg`."""
    return _cached(cfg, "layout", "layout", lambda: build_target_layout(cfg), _encode_layout, _decode_layout)


def cache_entry(cfg: ModelConfig, kind: str = "layout") -> Path:
    """The cache file that holds (or will hold) `kind` ("layout", "quant-layers") for `cfg`."""
    key = _cache_key(cfg)
    return cache_dir() / f"{kind}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]}.json"


def build_target_layout(cfg: ModelConfig) -> Layout:
    """The layout read off the model on the meta device (what the cache holds)."""
    from dsv4.model.dtypes import SAFETENSORS_NAMES  # start-up time: only a cache miss pays for torch

    model = build_draft_model(cfg)
    return {name: (SAFETENSORS_NAMES[t.dtype], tuple(t.shape)) for name, t in model.state_dict().items()}


def build_draft_model(cfg: ModelConfig) -> nn.Module:
    """The bundled draft model `cfg` describes, on the meta device (names, shapes, dtypes and
    module classes; no memory): the DSpark drafter (mapping/README.md#dspark-v4-flash-0731)
    for a DSpark config (DeepSeek V4.1's too), else the MTP draft (mapping/README.md#xpu-mtp-layout). The
    layout, the strict loader and the quantisation names all read this one model."""
    refuse_unless_torch_fits("building the draft model's layout")
    import torch  # start-up time: only what builds the model pays for torch

    from dsv4.model.dspark import DSparkDraft
    from dsv4.model.mtp import DeepSeekV4MTP

    with torch.device("meta"):
        return DSparkDraft(cfg) if cfg.is_dspark else DeepSeekV4MTP(cfg)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4-convert"


@cache
def model_code_sha256() -> str:
    """One digest over the model code's files (paths and bytes), read once per process."""
    digest = hashlib.sha256()
    for part in MODEL_CODE:
        root = PACKAGE / part
        for f in sorted(root.glob("*.py")) if root.is_dir() else [root]:
            digest.update(f"{f.relative_to(PACKAGE)}\0{f.stat().st_size}\0".encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()


def _cache_key(cfg: ModelConfig) -> dict[str, Any]:
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}
    return {"format": CACHE_FORMAT, "tool_version": __version__, "model_code": model_code_sha256(), "config": config}


def _digest(key: dict[str, Any], layout: Any) -> str:
    """The sha256 an entry carries: over its key and layout, as the record writer serialises them."""
    return hashlib.sha256(json_bytes({"key": key, "layout": layout})).hexdigest()


def _cached(
    cfg: ModelConfig,
    kind: str,
    field: str,
    build: Callable[[], T],
    encode: Callable[[T], Any],
    decode: Callable[[Any], T | None],
) -> T:
    """What `build` makes for `cfg`, from its cache entry (file `kind`-*.json, the value in
    `field`) when that entry is for this key, carries the digest of its key and value and
    `decode`s (None: malformed); else built and written back. Every entry, the layout and the
    quantisation layers alike, is held to this one rule."""
    key, path = _cache_key(cfg), cache_entry(cfg, kind)
    try:
        entry = loads(read_record_bytes(path))  # a regular file of bounded size, or OSError
        if entry["key"] == key and entry["sha256"] == _digest(key, entry[field]):
            value = decode(entry[field])
            if value:
                return value
    except (OSError, UnicodeDecodeError, StrictJSONError, KeyError, TypeError, ValueError, AttributeError):
        pass  # absent, not a regular file, corrupt or edited: rebuilt (and rewritten) below
    value = build()
    encoded = encode(value)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_record(path, {"key": key, field: encoded, "sha256": _digest(key, encoded)})
    except OSError:
        pass  # a read-only or full cache directory: the next run rebuilds it
    return value


def _encode_layout(layout: Layout) -> dict[str, list[Any]]:
    return {k: [d, list(sh)] for k, (d, sh) in layout.items()}


def _decode_layout(entry: dict[str, Any]) -> Layout | None:
    layout = {}
    for name, (dtype, shape) in entry.items():
        if not (isinstance(dtype, str) and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            return None
        layout[name] = (dtype, tuple(shape))
    return layout


def draft_layers_present(cfg: ModelConfig, names: Iterable[str]) -> list[str]:
    """The target-layout draft layers ("model.layers.{L}", L >= num_hidden_layers) `names` hold."""
    layers = {int(m.group(1)) for name in names if (m := TARGET_LAYER.match(name))}
    return [f"model.layers.{L}" for L in sorted(layers) if L >= cfg.num_hidden_layers]


# --- the quantisation layers, cached beside the layout --------------------------------------
LayerKind = Literal["linear", "moe", "embedding"]


@dataclass(frozen=True)
class DraftLayer:
    """One linear-like module of the bundled draft model (mapping/README.md#quantisation-layer-names)."""

    path: str  # module path in the model
    name: str  # quantisation layer name, vLLM's prefix ("" when built without one)
    kind: LayerKind


def draft_layers(model: nn.Module) -> list[DraftLayer]:
    """Every linear-like module of `model` with its quantisation layer name. A plain torch
    Linear or Embedding carries no name at all: it is listed with "" (the seed bug's shape)."""
    from torch import nn  # start-up time: only what reads a built model pays for torch

    from dsv4.model.mtp import Experts
    from dsv4.model.quantized import Embedding, QuantLayer

    out = []
    for path, mod in model.named_modules():
        if not isinstance(mod, (QuantLayer, nn.Linear, nn.Embedding)):
            continue
        name = mod.quant_name if isinstance(mod, QuantLayer) else ""
        kind: LayerKind = (
            "embedding"
            if isinstance(mod, (Embedding, nn.Embedding))
            else "moe"
            if isinstance(mod, Experts)
            else "linear"
        )
        out.append(DraftLayer(path, name, kind))
    return out


def quant_layers_of(cfg: ModelConfig) -> list[DraftLayer]:
    """`draft_layers` of the draft model for `cfg`, cached beside its layout (the same key and
    digest rule): a conversion that carries a quantization_config names the draft's layers
    without building the model a second time."""
    return _cached(
        cfg,
        "quant-layers",
        "layers",
        lambda: draft_layers(build_draft_model(cfg)),
        lambda layers: [list(dataclasses.astuple(layer)) for layer in layers],
        _decode_quant_layers,
    )


def _decode_quant_layers(rows: list[Any]) -> list[DraftLayer] | None:
    layers = [DraftLayer(p, n, k) for p, n, k in rows]
    valid = all(isinstance(x.path, str) and isinstance(x.name, str) and x.kind in get_args(LayerKind) for x in layers)
    return layers if valid else None
