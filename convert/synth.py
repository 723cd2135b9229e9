"""Synthetic native DeepSeek V4 checkpoints, laid out like the release (mapping/README.md#native-checkpoint-format).

Every name, dtype and shape comes from `dsv4.model.native`; the values are random but
realistic (finite FP8, spread-out power-of-two scales, norms near 1) so that the MTP
forward on them gives finite, non-trivial logits. Values are a pure function of
(seed, tensor name): writing a subset of the layers does not change the others.

Each shard is written header-first by `ShardWriter` and filled in row blocks of about
`CHUNK_BYTES`, so memory stays bounded at any model size. With `sparse=True` only the
headers are written: the tensor data are file holes that read back as zeros, so a
full-size Flash or Pro replica costs almost no disk (for tests of inventory and planning).

`variant="dspark"` writes a DeepSeek-V4-Flash-0731 release (mapping/README.md#dspark-source-checkpoint): its config
(the four dspark_* fields, one compress ratio per stage, "num_nextn_predict_layers": 1 kept)
and the three-stage DSpark drafter `mtp.{0,1,2}`, one shard per stage after the main model's
(48 shards at Flash size).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch

from dsv4.convert import progress
from dsv4.convert.errors import OutputError
from dsv4.convert.writer import ShardWriter, TensorSpec, shard_name
from dsv4.model import strictjson
from dsv4.model.checkpoint import INDEX_NAME, load_index
from dsv4.model.config import CONFIG, ModelConfig, parse_config
from dsv4.model.dtypes import TORCH_DTYPES, nbytes
from dsv4.model.native import (
    Layout,
    dspark_stage_layout,
    expert_storage,
    main_layer_layout,
    mtp_layout,
    top_level_layout,
    vision_layout,
)
from dsv4.model.presets import Variant, preset_config, with_variant
from dsv4.model.storage import DENSE_LINEAR, ExpertStorage

# what `synth` writes without --preset: tiny, except for the dspark variant, which is the
# V4-Flash-0731 release (the first DSpark release; `--preset pro` is V4-Pro-0813)
DEFAULT_PRESET, DSPARK_DEFAULT_PRESET = "tiny", "flash"
CHUNK_BYTES = 1 << 20  # output bytes generated per write; temporaries stay within ~32x this
SHARD_METADATA = {"format": "pt"}  # what the released shards carry
E8M0_BIAS = 127

Fill = Callable[[tuple[int, ...], torch.Generator], torch.Tensor]


def pack_codes(codes: torch.Tensor, storage: ExpertStorage) -> torch.Tensor:
    """Pack codes (uint8, last dim a multiple of codes_per_byte) along the last dim, as the release
    stores packed experts (mapping/README.md#storage-dtypes): LOW bits = even index (FP4: two per byte)."""
    n, bits = storage.codes_per_byte, 8 // storage.codes_per_byte
    packed = codes[..., 0::n]
    for k in range(1, n):
        packed = packed | (codes[..., k::n] << (k * bits))
    return packed.view(TORCH_DTYPES[storage.weight_dtype])


def shard_layouts(cfg: ModelConfig, main_layers: int) -> list[Layout]:
    """The tensors of each shard, in file order, as the release distributes them: embed,
    a vision tower's tensors (Vision-Exp), one shard per main layer, head/norm/hc_head, then
    everything under mtp.* (one shard per DSpark stage: 0731's shards 46-48)."""
    top = top_level_layout(cfg)
    first = {"embed.weight": top.pop("embed.weight")}
    layers = [main_layer_layout(cfg, j) for j in range(main_layers)]
    vision = [vision_layout(cfg)] if cfg.vision_n_layers > 0 else []
    if cfg.is_dspark:
        return [first, *vision, *layers, top, *(dspark_stage_layout(cfg, s) for s in range(cfg.dspark_stages))]
    mtp: Layout = {}
    for i in range(cfg.num_nextn_predict_layers):
        mtp.update(mtp_layout(cfg, i, with_emb_head=expert_storage(cfg).mtp_emb_head))
    return [first, *layers, top, mtp]


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # manual_seed wants < 2^63


def _gauss(std: float, mean: float = 0.0, dtype: torch.dtype = torch.float32) -> Fill:
    return lambda shape, gen: (torch.randn(shape, generator=gen) * std + mean).to(dtype)


def _pow2_scales(dtype: str, exponents: tuple[int, int]) -> Fill:
    """Power-of-two scales, stored as E8M0 bytes or as values of `dtype` (F32)."""
    lo, hi = exponents
    if dtype == "F8_E8M0":
        return lambda shape, gen: torch.randint(
            lo + E8M0_BIAS, hi + E8M0_BIAS + 1, shape, generator=gen, dtype=torch.uint8
        ).view(torch.float8_e8m0fnu)
    return lambda shape, gen: torch.exp2(torch.randint(lo, hi + 1, shape, generator=gen).float()).to(
        TORCH_DTYPES[dtype]
    )


def _numeric_weights(std: float, dtype: str) -> Fill:
    # clamped into the dtype's finite range: for e4m3 that keeps NaN bytes (0x7F/0xFF) out
    target = TORCH_DTYPES[dtype]
    limit = float((torch.finfo if target.is_floating_point else torch.iinfo)(target).max)
    return lambda shape, gen: (torch.randn(shape, generator=gen) * std).clamp_(-limit, limit).to(target)


def _packed_weights(storage: ExpertStorage) -> Fill:
    assert storage.codebook is not None
    n_codes = len(storage.codebook)
    # uniform codes: every code (e2m1's -0 too) is a finite value
    return lambda shape, gen: pack_codes(
        torch.randint(0, n_codes, (*shape[:-1], storage.codes_per_byte * shape[-1]), generator=gen, dtype=torch.uint8),
        storage,
    )


def _quantized(storage: ExpertStorage, leaf: str, dtype: str) -> Fill:
    """A weight or scale of a linear stored as `storage` says, with its realistic magnitudes."""
    if leaf == "scale":
        return _pow2_scales(dtype, storage.synth_scale_exponents)
    return (
        _packed_weights(storage) if storage.codebook is not None else _numeric_weights(storage.synth_weight_std, dtype)
    )


def _hc_fn(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    # hc_mixes computes (X @ fn.T) / rms(X) over n_hc*H inputs: std 1/sqrt(n_hc*H) keeps the
    # mixing logits ~N(0, 1) at any hidden size, away from sigmoid/softmax saturation
    return torch.randn(shape, generator=gen) * shape[-1] ** -0.5


def _hc_scale(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=gen) * 0.5 + 0.5


def _expert_ids(n_experts: int) -> Fill:
    # each token's k hash-routed experts are distinct, as a real tid2eid table has them
    return lambda shape, gen: torch.rand((shape[0], n_experts), generator=gen).topk(shape[1], dim=-1).indices


def _filler(name: str, dtype: str, cfg: ModelConfig) -> Fill:
    """How to draw tensor `name`'s values, from its dtype and role."""
    leaf = name.rsplit(".", 1)[-1]
    if ".experts." in name:  # a routed expert's weight or scale (not shared_experts')
        return _quantized(expert_storage(cfg), leaf, dtype)
    if dtype == DENSE_LINEAR.weight_dtype or (leaf == "scale" and dtype in ("F8_E8M0", "F32")):
        return _quantized(DENSE_LINEAR, leaf, dtype)  # a dense FP8 linear (its scale as the experts' storage says)
    if dtype == "I64":
        return _expert_ids(cfg.n_routed_experts)
    if dtype == "BF16":
        return _gauss(0.02, 1.0 if name.endswith("norm.weight") else 0.0, torch.bfloat16)
    if dtype != "F32":
        raise ValueError(f"{name}: no synthetic values for dtype {dtype}")
    if leaf.startswith("hc_"):
        if leaf.endswith("_fn"):
            return _hc_fn
        return _hc_scale if leaf.endswith("_scale") else _gauss(0.1)
    if leaf == "attn_sink":
        return _gauss(0.1)
    return _gauss(0.01)  # gate.bias, compressor ape


def _fill_shard(writer: ShardWriter, specs: list[TensorSpec], cfg: ModelConfig, seed: int) -> None:
    """Generate every tensor of one shard, one thread per core: each tensor draws from its own
    generator (seeded by its name), so the bytes do not depend on which thread draws them or
    when; torch's kernels release the GIL, and the writes take turns (one file position)."""
    turn = threading.Lock()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda s: _fill_tensor(writer, turn, s.name, s.dtype, s.shape, cfg, seed), specs))


def _fill_tensor(
    writer: ShardWriter,
    turn: threading.Lock,
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    cfg: ModelConfig,
    seed: int,
) -> None:
    """Generate tensor `name` in row blocks and write each at its offset in the file."""
    fill = _filler(name, dtype, cfg)
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    row_shape = shape[1:]
    row_bytes = nbytes(dtype, row_shape)
    step = max(1, CHUNK_BYTES // row_bytes)
    for r0 in range(0, shape[0], step):
        block = fill((min(step, shape[0] - r0), *row_shape), gen)
        assert block.dtype == TORCH_DTYPES[dtype], f"{name}: drew {block.dtype}, layout says {dtype}"
        with turn:
            writer.write(name, block, at=r0 * row_bytes)


def _resolve_config(preset: str | None, config: dict[str, Any] | None, variant: Variant) -> dict[str, Any]:
    if config is not None:
        return with_variant(config, variant)
    if preset is None:
        raise ValueError("give a preset or a config")
    return preset_config(preset, variant)


def write_checkpoint(
    out_dir: str | Path,
    *,
    preset: str | None = "tiny",
    config: dict[str, Any] | None = None,
    variant: Variant = "instruct",
    main_layers: int | Literal["all"] = 0,
    seed: int = 0,
    sparse: bool = False,
    quiet: bool = True,
    config_where: str = CONFIG,
) -> Path:
    """Write a native checkpoint (config.json, index, shards) into `out_dir` and return it.

    `config` (a full config.json dict) replaces `preset` when given; either way the
    variant sets "expert_dtype". `main_layers` is how many of the main decoder layers
    to write ("all" = num_hidden_layers); the embedding, head and MTP are always written.
    `config_where` names the config in a refusal.
    """
    raw = _resolve_config(preset, config, variant)
    cfg = ModelConfig.from_dict(raw, config_where)
    n_main = cfg.num_hidden_layers if main_layers == "all" else main_layers
    if not isinstance(n_main, int) or not 0 <= n_main <= cfg.num_hidden_layers:
        raise ValueError(f"main_layers must be 0..{cfg.num_hidden_layers} or 'all', not {main_layers!r}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = shard_layouts(cfg, n_main)
    weight_map: dict[str, str] = {}
    total_size = 0
    files = progress.bar(len(shards), "synth", "file", quiet)
    for k, layout in enumerate(shards):
        fname = shard_name(k, len(shards))
        specs = [TensorSpec(name, dtype, shape) for name, (dtype, shape) in layout.items()]
        with ShardWriter(out / fname, specs, SHARD_METADATA) as writer:
            if not sparse:
                _fill_shard(writer, specs, cfg, seed)
        weight_map.update(dict.fromkeys(layout, fname))
        total_size += sum(s.nbytes for s in specs)
        files.update()
    files.close()

    (out / CONFIG).write_text(json.dumps(raw, indent=2) + "\n")
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return out


def synthesize(
    out: Path,
    *,
    preset: str | None,
    config_path: Path | None,
    variant: Variant,
    main_layers: int | str,
    seed: int,
    sparse: bool,
    quiet: bool = True,
) -> dict[str, Any]:
    """`synth`: write a synthetic checkpoint into OUT (new or empty) from a preset or a
    config.json, refused with the converter's verdict if it would refuse the config; returns
    what was written (tensors, files, bytes)."""
    # the dspark variant names a release (V4-Flash-0731); tiny is for tests and asked for by name
    preset = preset or (None if config_path else DSPARK_DEFAULT_PRESET if variant == "dspark" else DEFAULT_PRESET)
    # writing into a directory that holds something would replace part of it (a typo for a
    # real download) and leave a mix of two checkpoints
    if out.is_dir() and any(out.iterdir()):
        raise OutputError(
            f"{out}: exists and is not empty; synth writes only into a new or empty directory, so nothing was changed",
            kind="output_exists",
            path=str(out),
        )
    where = str(config_path) if config_path else f"preset {preset}"  # names the config in a refusal
    config = parse_config(config_path.read_bytes(), where) if config_path else None
    try:
        write_checkpoint(
            out,
            preset=preset,
            config=config,
            variant=variant,
            main_layers=main_layers,
            seed=seed,
            sparse=sparse,
            quiet=quiet,
            config_where=where,
        )
    except OSError as exc:  # a write's ENOSPC or EIO names no file: name OUT
        raise OutputError(
            f"{exc.filename or out}: {exc.strerror or exc}; the synthetic checkpoint in {out} is incomplete",
            kind="write_failed",
            path=str(out),
        ) from None
    raw = (out / INDEX_NAME).read_bytes()
    weight_map = load_index(raw, str(out / INDEX_NAME))
    return {
        "output": str(out),
        "tensors": len(weight_map),
        "files": len(set(weight_map.values())),
        "bytes": strictjson.loads(raw)["metadata"]["total_size"],
    }
