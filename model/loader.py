"""Strict loading of a converted checkpoint into the bundled draft model.

The converted checkpoint's keys ARE the model's parameter names (mapping/README.md#versions-and-loaders): there is
no remap here, and anything other than an exact match of names, shapes and dtypes is an
error naming the tensor and its file. Silent drops are how vLLM users got 0% draft
acceptance with no load-time error; this loader refuses them.

Every header is checked before any data is read. On the CPU the parameters are then views
of the memory-mapped shards: loading reads no tensor data and copies nothing, and a forward
reads only the pages it touches (the head, the experts some token routes to, a few rows of
the embedding).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from dsv4.model.checkpoint import Checkpoint, refuse_full_native
from dsv4.model.config import ModelConfig
from dsv4.model.dspark import DSparkDraft
from dsv4.model.dtypes import SAFETENSORS_NAMES
from dsv4.model.errors import DSV4Error, LoadError
from dsv4.model.layout import build_draft_model, draft_layers_present
from dsv4.model.mtp import DeepSeekV4MTP, Experts
from dsv4.model.quantized import DecodedExperts, holding
from dsv4.model.record import LayoutRecord, RecordError


def default_device() -> torch.device:
    """The machine's accelerator (xpu or cuda: the one this torch build has), else the cpu."""
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")


def converted_config(root: Path) -> ModelConfig:
    """The validated config.json of converted checkpoint `root`, with the same verdicts as
    plan, convert and check (missing_config, malformed_config, unsupported_layout)."""
    return Checkpoint(root).model_config


def has_layout_record(root: Path) -> bool:
    """Whether `root`/config.json carries the layout record of a renamed-layout conversion
    (`--target xpu`), so the tensors are the model's parameter names. A draft directory or a
    native checkpoint has none (a malformed record counts as one: the strict loader then
    names what is wrong)."""
    checkpoint = Checkpoint(root)
    try:
        return LayoutRecord.of(checkpoint.config, str(checkpoint.config_path)) is not None
    except (DSV4Error, RecordError):
        return True


def _require_parameters(
    expected: Mapping[str, torch.Tensor],
    found: Mapping[str, tuple[str, tuple[int, ...]]],
    index: str | None = None,
    file_of: Mapping[str, str] | None = None,
) -> None:
    """The strict loader's one rule, for tensors on disk (`found` from their headers, `index`
    the file that lists them, `file_of` each one's shard) or in memory: exactly the model's
    parameter names, shapes and dtypes. Each refusal is one line naming the tensor, and its
    file when it has one."""

    def at(where: str | None) -> str:
        return f"{where}: " if where else ""

    for name in expected:
        if name not in found:
            raise LoadError(
                f"{at(index)}missing tensor {name} (a parameter of the draft model)",
                kind="missing_key",
                path=index,
                tensor=name,
            )
    for name, (dtype, shape) in sorted(found.items()):
        file = file_of[name] if file_of is not None else None
        if name not in expected:
            raise LoadError(
                f"{at(file)}unexpected tensor {name} (not a parameter of the draft model)",
                kind="unexpected_key",
                path=file,
                tensor=name,
            )
        want_dtype, want_shape = SAFETENSORS_NAMES[expected[name].dtype], tuple(expected[name].shape)
        if shape != want_shape:
            raise LoadError(
                f"{at(file)}tensor {name} has shape {list(shape)}, the model expects {list(want_shape)}",
                kind="shape_mismatch",
                path=file,
                tensor=name,
            )
        if dtype != want_dtype:
            raise LoadError(
                f"{at(file)}tensor {name} has dtype {dtype}, the model expects {want_dtype}",
                kind="dtype_mismatch",
                path=file,
                tensor=name,
            )


def draft_model_holding(
    cfg: ModelConfig, holds: Mapping[str, str], decoded_experts: Callable[[str], DecodedExperts]
) -> tuple[torch.nn.Module, dict[str, str]]:
    """The draft model for `cfg` (on the meta device) with each quantisation layer at module path `path`
    of `holds` rebuilt to keep its weights as the container `holds[path]` names (model/storage.py
    HeldLinear.container) where the model has one for that layer, else as bf16 (a linear: its weight is
    then the caller's decoding) or as `decoded_experts(path)` (routed experts, decoded one at a time);
    and the container each layer got ("decoded" for the latter). A routed-experts layer's container is
    its `routed_experts` child."""
    model = build_draft_model(cfg)
    kept: dict[str, str] = {}
    for path, container in holds.items():
        module = model.get_submodule(path)
        experts = isinstance(module, Experts)
        where = f"{path}.routed_experts" if experts else path
        rebuilt = holding(model.get_submodule(where), container)
        if rebuilt is None:
            container = "decoded" if experts else "bf16"
            rebuilt = decoded_experts(path) if experts else holding(module, "bf16")
        kept[path] = container
        model.set_submodule(where, rebuilt)
    return model, kept


def load_state(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    device: str | torch.device | None = None,
    model: torch.nn.Module | None = None,
) -> DeepSeekV4MTP | DSparkDraft:
    """The draft model for `cfg` (`model` when the caller built it, draft_model_holding) with `state` (the
    xpu layout's names, e.g. planned in memory from a native-named checkpoint) loaded strictly: a missing
    or extra name is missing_key / unexpected_key, a shape or dtype other than the model's
    shape_mismatch / dtype_mismatch."""
    dev = torch.device(device) if device is not None else default_device()
    model = model if model is not None else build_draft_model(cfg)
    _require_parameters(model.state_dict(), {n: (SAFETENSORS_NAMES[t.dtype], tuple(t.shape)) for n, t in state.items()})
    model.load_state_dict({k: v.to(dev) for k, v in state.items()}, strict=True, assign=True)
    return model.eval()


def load_converted(path: str | Path, device: str | torch.device | None = None) -> DeepSeekV4MTP | DSparkDraft:
    """Build the draft model for `path`/config.json (DSparkDraft for a DSpark config,
    mapping/README.md#dspark-v4-flash-0731; else DeepSeekV4MTP) and load the converted
    weights strictly.

    Raises missing_key, unexpected_key, shape_mismatch, dtype_mismatch
    (all LoadError) naming the first offending tensor and its file; a config.json, index or
    header the converter would refuse raises the converter's error (the one reader,
    model/checkpoint.py: missing_config, malformed_config, unsupported_layout,
    malformed_header, index_mismatch, ...).
    """
    checkpoint = Checkpoint(path)
    root = checkpoint.root
    cfg = checkpoint.model_config
    dev = torch.device(device) if device is not None else default_device()

    refuse_full_native(root, "smoke")
    headers = checkpoint.headers  # the one header reader: every header is checked before any data is read
    if not cfg.is_dspark:  # a DSpark stage missing or extra is a missing or unexpected key below
        cfg.require_draft_blocks(draft_layers_present(cfg, headers.tensors), str(checkpoint.config_path))
    model = build_draft_model(cfg)
    expected = model.state_dict()
    _require_parameters(
        expected,
        {name: (src.dtype, src.shape) for name, src in headers.tensors.items()},
        str(root / headers.index_file),
        {name: str(root / src.file) for name, src in headers.tensors.items()},
    )
    model.load_state_dict(checkpoint.load_tensors(expected, dev), strict=True, assign=True)
    return model.eval()
