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

from pathlib import Path

import torch
from safetensors import safe_open

from dsv4.model.checkpoint import CONFIG, local_weight_map, refuse_full_native
from dsv4.model.config import ModelConfig, config_errors
from dsv4.model.dspark import DSparkDraft
from dsv4.model.dtypes import SAFETENSORS_NAMES
from dsv4.model.errors import CheckpointError, LoadError
from dsv4.model.layout import build_draft_model, draft_layers_present
from dsv4.model.mtp import DeepSeekV4MTP
from dsv4.model.record import LayoutRecord, RecordError
from dsv4.model.strictjson import StrictJSONError, loads, read_record_bytes


def default_device() -> torch.device:
    """The machine's accelerator (xpu or cuda: the one this torch build has), else the cpu."""
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")


def converted_config(root: Path) -> ModelConfig:
    """The validated config.json of converted checkpoint `root`, with the same verdicts as
    plan, convert and check (missing_config, malformed_config, unsupported_layout)."""
    config_path = root / CONFIG
    if not config_path.is_file():
        raise CheckpointError(
            f"{config_path}: no config.json in the converted checkpoint", kind="missing_config", path=str(config_path)
        )
    with config_errors(str(config_path)):
        return ModelConfig.from_file(config_path)


def has_layout_record(root: Path) -> bool:
    """Whether `root`/config.json carries the layout record of a renamed-layout conversion
    (`--target xpu`), so the tensors are the model's parameter names. A draft directory or a
    native checkpoint has none (a malformed record counts as one: the strict loader then
    names what is wrong)."""
    try:
        config = loads(read_record_bytes(root / CONFIG))
        return not isinstance(config, dict) or LayoutRecord.of(config, str(root / CONFIG)) is not None
    except (OSError, StrictJSONError, RecordError):
        return True


def load_state(
    cfg: ModelConfig, state: dict[str, torch.Tensor], device: str | torch.device | None = None
) -> DeepSeekV4MTP | DSparkDraft:
    """The draft model for `cfg` with `state` (the xpu layout's names, e.g. planned in
    memory from a native-named checkpoint) loaded strictly: a missing or extra name is
    missing_key / unexpected_key, a shape or dtype other than the model's
    shape_mismatch / dtype_mismatch."""
    dev = torch.device(device) if device is not None else default_device()
    model = build_draft_model(cfg)
    expected = model.state_dict()
    for name in sorted(set(expected) - set(state)):
        raise LoadError(f"missing tensor {name} (a parameter of the draft model)", kind="missing_key", tensor=name)
    for name in sorted(set(state) - set(expected)):
        raise LoadError(
            f"unexpected tensor {name} (not a parameter of the draft model)", kind="unexpected_key", tensor=name
        )
    for name, want in expected.items():
        got = state[name]
        if tuple(got.shape) != tuple(want.shape):
            raise LoadError(
                f"tensor {name} has shape {list(got.shape)}, the model expects {list(want.shape)}",
                kind="shape_mismatch",
                tensor=name,
            )
        if got.dtype != want.dtype:
            raise LoadError(
                f"tensor {name} has dtype {SAFETENSORS_NAMES[got.dtype]}, the model expects {SAFETENSORS_NAMES[want.dtype]}",
                kind="dtype_mismatch",
                tensor=name,
            )
    model.load_state_dict({k: v.to(dev) for k, v in state.items()}, strict=True, assign=True)
    return model.eval()


def load_converted(path: str | Path, device: str | torch.device | None = None) -> DeepSeekV4MTP | DSparkDraft:
    """Build the draft model for `path`/config.json (DSparkDraft for a DSpark config, mapping/README.md#dspark-v4-flash-0731;
    else DeepSeekV4MTP) and load the converted weights strictly.

    Raises missing_key, unexpected_key, shape_mismatch, dtype_mismatch
    (all LoadError) naming the first offending tensor and its file; a config.json the
    converter would refuse raises the converter's error (missing_config,
    malformed_config, unsupported_layout).
    """
    root = Path(path)
    config_path = root / CONFIG
    cfg = converted_config(root)
    dev = torch.device(device) if device is not None else default_device()

    refuse_full_native(root, "smoke")
    weight_map, index_file = local_weight_map(root)
    if not cfg.is_dspark:  # a DSpark stage missing or extra is a missing or unexpected key below
        with config_errors(str(config_path)):
            cfg.require_draft_blocks(draft_layers_present(cfg, weight_map))
    model = build_draft_model(cfg)
    expected = model.state_dict()
    for name in expected:
        if name not in weight_map:
            raise LoadError(
                f"{root / index_file}: missing tensor {name} (a parameter of the draft model)",
                kind="missing_key",
                path=str(root / index_file),
                tensor=name,
            )

    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)

    # headers first: a bad checkpoint fails before any tensor data is read
    for file, names in sorted(by_file.items()):
        shard = root / file
        if not shard.is_file():
            raise LoadError(f"{shard}: shard named in {index_file} does not exist", kind="load_failed", path=str(shard))
        with safe_open(shard, framework="pt") as f:
            in_file = set(f.keys())
            for name in sorted(in_file - set(names)):
                raise LoadError(
                    f"{shard}: unexpected tensor {name} (not listed in {index_file})",
                    kind="unexpected_key",
                    path=str(shard),
                    tensor=name,
                )
            for name in sorted(names):
                if name not in in_file:
                    raise LoadError(
                        f"{shard}: tensor {name} is listed in {index_file} but absent",
                        kind="missing_key",
                        path=str(shard),
                        tensor=name,
                    )
                if name not in expected:
                    raise LoadError(
                        f"{shard}: unexpected tensor {name} (not a parameter of the draft model)",
                        kind="unexpected_key",
                        path=str(shard),
                        tensor=name,
                    )
                want = expected[name]
                sl = f.get_slice(name)
                dtype, shape = sl.get_dtype(), tuple(sl.get_shape())
                if shape != tuple(want.shape):
                    raise LoadError(
                        f"{shard}: tensor {name} has shape {list(shape)}, the model expects {list(want.shape)}",
                        kind="shape_mismatch",
                        path=str(shard),
                        tensor=name,
                    )
                if dtype != SAFETENSORS_NAMES[want.dtype]:
                    raise LoadError(
                        f"{shard}: tensor {name} has dtype {dtype}, the model expects {SAFETENSORS_NAMES[want.dtype]}",
                        kind="dtype_mismatch",
                        path=str(shard),
                        tensor=name,
                    )

    # safetensors maps each shard privately (copy-on-write) and get_tensor returns a view of
    # that map: on the CPU the parameters ARE those views (no copy; a page is read when the
    # forward first touches it, and a write would copy the page, never reach the file).
    # Any other device gets its one copy, a tensor at a time.
    state: dict[str, torch.Tensor] = {}
    for file, names in sorted(by_file.items()):
        with safe_open(root / file, framework="pt", device="cpu") as f:
            for name in names:
                state[name] = f.get_tensor(name).to(dev)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
