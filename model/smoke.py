"""`convert-dsv4 smoke OUT`: load a converted checkpoint strictly into the bundled model,
run one draft step on a few tokens and check it (model/README.md#smoke-test-and-reference; for a DSpark checkpoint one
drafted block, model/README.md#dspark-forward: `run_dspark_smoke`). With the native checkpoint
it also runs the independent reference and reports the figures model/parity.py judges."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from dsv4.model import kernels
from dsv4.model.config import ModelConfig
from dsv4.model.dspark import DraftBlock, DSparkDraft, target_features
from dsv4.model.dspark_reference import DSparkReference, ReferenceBlock
from dsv4.model.errors import LoadError
from dsv4.model.loader import default_device, load_converted
from dsv4.model.mtp import MoE
from dsv4.model.parity import (
    SMOKE_TOKENS,
    RoutingLog,
    logging_routing,
    routing_disagreements,
    top1_agreement_up_to_ties,
)
from dsv4.model.reference import NativeReference

R = TypeVar("R")


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], R]) -> tuple[R, float]:
    """fn's result and its wall time in ms, the device synchronised on both sides."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, (time.perf_counter() - t0) * 1e3


Loader = Callable[[torch.device], torch.nn.Module]  # how a checkpoint becomes the bundled model


def _moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _rerun_on_near_ties(
    model_routing: RoutingLog, reference_routing: RoutingLog, rerun: Callable[[RoutingLog], R]
) -> tuple[R | None, list[dict[str, Any]]]:
    """Where the model (`model_routing`, its run's log) routes otherwise than the reference:
    when every such place is a near-tie (model/parity.py), `rerun(log)` runs the model again
    with `log` imposing the reference's experts, so that the outputs compared come from the
    same routing. -> (the rerun's output, or None when none was needed; the routing
    disagreements with their margins)."""
    found = routing_disagreements(model_routing, reference_routing)
    if not (found and all(d["near_tie"] for d in found)):
        return None, found
    imposed = RoutingLog(impose=reference_routing)
    out = rerun(imposed)
    return out, found + [d for d in routing_disagreements(imposed, reference_routing) if not d["near_tie"]]


def _routed_as_the_reference(
    model: nn.Module, reference_routing: RoutingLog, run: Callable[[], R]
) -> tuple[R, list[dict[str, Any]]]:
    """`run()` of the model with its routing logged, run again as the reference routes where
    the two differ only on near-ties (_rerun_on_near_ties). -> (output, the routing
    disagreements with their margins)."""
    with logging_routing(_moe_layers(model), RoutingLog()) as log:
        out = run()

    def rerun(imposed: RoutingLog) -> R:
        with logging_routing(_moe_layers(model), imposed):
            return run()

    again, found = _rerun_on_near_ties(log, reference_routing, rerun)
    return (out if again is None else again), found


def smoke_inputs(
    cfg: ModelConfig, tokens: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An MTP step's inputs, seeded: random token ids, positions 0.., random previous hidden states."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen).to(device)
    positions = torch.arange(tokens).to(device)
    prev = torch.randn(tokens, cfg.hc_dim, generator=gen).to(torch.bfloat16).to(device)
    return ids, positions, prev


def draft_logits(load: Loader, device: torch.device, tokens: int = SMOKE_TOKENS, seed: int = 0) -> torch.Tensor:
    """The fp32 logits [T, V] of one MTP step of the model `load` gives, on run_smoke's inputs for `seed`."""
    model = load(device)
    inputs = smoke_inputs(model.config, tokens, seed, device)
    return model.compute_logits(model(*inputs))


def run_smoke(
    out_dir: str | Path,
    device: str | None = None,
    tokens: int = SMOKE_TOKENS,
    reference_dir: str | Path | None = None,
    seed: int = 0,
    load: Loader | None = None,
) -> dict[str, Any]:
    """Load (`load`, default: the strict loader of a converted checkpoint), run forward +
    compute_logits (twice: the first includes kernel compilation), check shapes and
    finiteness, and compare with the native reference when given."""
    dev = torch.device(device) if device else default_device()
    report: dict[str, Any] = {
        "checkpoint": str(out_dir),
        "device": str(dev),
        "kernels": kernels.backend(dev),
        "tokens": tokens,
    }
    load_model = load or (lambda d: load_converted(out_dir, d))
    model, report["load_ms"] = _timed(dev, lambda: load_model(dev))
    cfg = model.config
    ids, positions, prev = smoke_inputs(cfg, tokens, seed, dev)

    model_routing = RoutingLog()  # the warm run's, compared with the reference's below
    for run in ("first", "warm"):
        with logging_routing(_moe_layers(model), model_routing if run == "warm" else RoutingLog()):
            h, report[f"forward_{run}_ms"] = _timed(dev, lambda: model(ids, positions, prev))
        logits, report[f"logits_{run}_ms"] = _timed(dev, lambda h=h: model.compute_logits(h))
    report["hidden_shape"], report["logits_shape"] = list(h.shape), list(logits.shape)
    where = f"{out_dir}"
    if tuple(h.shape) != (tokens, cfg.hc_dim):
        raise LoadError(
            f"{where}: forward returned {list(h.shape)}, expected {[tokens, cfg.hc_dim]}",
            kind="smoke_output",
            path=str(where),
        )
    if tuple(logits.shape) != (tokens, cfg.vocab_size):
        raise LoadError(
            f"{where}: compute_logits returned {list(logits.shape)}, expected {[tokens, cfg.vocab_size]}",
            kind="smoke_output",
            path=str(where),
        )
    if not (torch.isfinite(h).all() and torch.isfinite(logits).all()):
        raise LoadError(
            f"{where}: non-finite values in the draft's hidden states or logits", kind="smoke_output", path=str(where)
        )

    if reference_dir is not None:
        # one side at a time: the model's mapped shards, with the pages its forward made
        # resident, go before the reference maps the native ones (peak: the larger side)
        del model
        gc.collect()
        ref, report["reference_load_ms"] = _timed(dev, lambda: NativeReference(reference_dir, dev))
        with logging_routing([ref], RoutingLog()) as ref_routing:
            h_ref, report["reference_forward_ms"] = _timed(dev, lambda: ref.forward(ids, positions, prev))
        logits_ref, report["reference_logits_ms"] = _timed(dev, lambda: ref.compute_logits(h_ref))
        del ref
        gc.collect()

        def rerun(imposed: RoutingLog) -> tuple[torch.Tensor, torch.Tensor]:
            # one side at a time again: the model comes back only when the routing-aware comparison needs it
            model = load_model(dev)
            with logging_routing(_moe_layers(model), imposed):
                h = model(ids, positions, prev)
            return h, model.compute_logits(h)

        again, report["routing_disagreements"] = _rerun_on_near_ties(model_routing, ref_routing, rerun)
        h, logits = again or (h, logits)
        report["reference"] = str(reference_dir)
        report["hidden_max_abs_diff"] = (h.float() - h_ref.float()).abs().max().item()
        report["hidden_max_abs"] = h_ref.float().abs().max().item()
        report["logits_max_abs_diff"] = (logits - logits_ref).abs().max().item()
        report["logits_max_abs"] = logits_ref.abs().max().item()
        report["top1_agreement"] = (logits.argmax(-1) == logits_ref.argmax(-1)).float().mean().item()
        report["top1_agreement_up_to_ties"] = top1_agreement_up_to_ties(logits, logits_ref)
    return report


FEATURE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # target features: any float the target ran in


def read_target_features(path: str | Path, cfg: ModelConfig) -> torch.Tensor:
    """The target features of a DSpark smoke from safetensors file `path`: tensors `h_{l}` for
    l in dspark_target_layer_ids, each [T_ctx, H] (the same T_ctx), as [T_ctx, T*H] bf16.
    Other tensors in the file are not read. LoadError (missing_key, shape_mismatch,
    dtype_mismatch; a non-finite value) naming the file and the tensor otherwise."""
    ids = cfg.dspark_target_layer_ids
    assert ids is not None
    per_layer: list[torch.Tensor] = []
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            present = set(f.keys())
            for layer in ids:
                name = f"h_{layer}"
                if name not in present:
                    raise LoadError(
                        f"{path}: no tensor {name} (the target features are h_l for dspark_target_layer_ids "
                        f"{list(ids)})",
                        kind="missing_key",
                        path=str(path),
                        tensor=name,
                    )
                t = f.get_tensor(name)
                rows = per_layer[0].shape[0] if per_layer else None  # the first one sets T_ctx
                shape = tuple(t.shape)
                if len(shape) != 2 or shape[1] != cfg.hidden_size or shape[0] == 0 or shape[0] != (rows or shape[0]):
                    want = f"[{rows or 'T_ctx >= 1'}, {cfg.hidden_size}]"
                    raise LoadError(
                        f"{path}: tensor {name} has shape {list(shape)}, expected {want}",
                        kind="shape_mismatch",
                        path=str(path),
                        tensor=name,
                    )
                if t.dtype not in FEATURE_DTYPES:
                    raise LoadError(
                        f"{path}: tensor {name} has dtype {t.dtype}, expected a float (bf16, f16 or f32)",
                        kind="dtype_mismatch",
                        path=str(path),
                        tensor=name,
                    )
                t = t.to(torch.bfloat16)
                if not bool(torch.isfinite(t).all()):  # else the draft's output is non-finite and the checkpoint blamed
                    raise LoadError(
                        f"{path}: tensor {name} holds {int((~torch.isfinite(t)).sum()):,} non-finite value(s) (NaN "
                        "or Inf, in bf16): target features are finite",
                        kind="load_failed",
                        path=str(path),
                        tensor=name,
                    )
                per_layer.append(t)
    except (SafetensorError, OSError) as exc:
        raise LoadError(
            f"{path}: not a readable safetensors file ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})",
            kind="load_failed",
            path=str(path),
        ) from None
    return target_features(per_layer)


def run_dspark_smoke(
    out_dir: str | Path,
    device: str | None = None,
    context_tokens: int = SMOKE_TOKENS,
    features: str | Path | None = None,
    anchor: int | None = None,
    first_position: int = 0,
    reference_dir: str | Path | None = None,
    seed: int = 0,
    load: Loader | None = None,
) -> dict[str, Any]:
    """Load a converted DSpark checkpoint strictly (`load`, as run_smoke) and draft one block (twice: the first run
    includes kernel compilation): target features for a context (random, seeded, or read from
    `features`, see read_target_features) at positions first_position.., an anchor token
    (random, seeded, when None). Checks shapes and finiteness; with `reference_dir` (the
    native checkpoint) compares hidden states, logits and draft tokens with DSparkReference."""
    dev = torch.device(device) if device else default_device()
    report: dict[str, Any] = {
        "checkpoint": str(out_dir),
        "device": str(dev),
        "kernels": kernels.backend(dev),
        "layout": "dspark",
    }
    load_model = load or (lambda d: load_converted(out_dir, d))
    model, report["load_ms"] = _timed(dev, lambda: load_model(dev))
    if not isinstance(model, DSparkDraft):
        raise LoadError(
            f"{out_dir}: not a DSpark checkpoint (its config.json has no dspark_* fields)",
            kind="smoke_output",
            path=str(out_dir),
        )
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    if features is None:
        feats = torch.randn(context_tokens, cfg.dspark_stages * cfg.hidden_size, generator=gen).to(torch.bfloat16)
    else:
        feats = read_target_features(features, cfg)
        report["features"] = str(features)
    if anchor is None:
        anchor = int(torch.randint(0, cfg.vocab_size, (1,), generator=gen))
    if not 0 <= anchor < cfg.vocab_size:
        raise ValueError(f"anchor token {anchor} is not in 0..{cfg.vocab_size - 1}")
    feats = feats.to(dev)
    ctx = (first_position + torch.arange(feats.shape[0])).to(dev)
    ids, positions = model.block_ids(anchor), model.block_positions(ctx)
    report.update(
        context_tokens=feats.shape[0], anchor=anchor, block_positions=positions.tolist(), stages=cfg.dspark_stages
    )

    model_routing = RoutingLog()  # the warm run's, compared with the reference's
    for run in ("first", "warm"):
        with logging_routing(_moe_layers(model), model_routing if run == "warm" else RoutingLog()):
            h, report[f"hidden_{run}_ms"] = _timed(dev, lambda: model.hidden_states(feats, ctx, ids, positions))
        block, report[f"logits_{run}_ms"] = _timed(dev, lambda h=h: model.heads(h, anchor))
    B = cfg.dspark_block_size
    report["hidden_shape"], report["logits_shape"] = list(h.shape), list(block.logits.shape)
    report["draft_tokens"] = block.draft_tokens.tolist()
    if block.confidence is not None:
        report["confidence"] = block.confidence.tolist()
    _require_a_finite_block(out_dir, model, block)

    if reference_dir is not None:
        # one side at a time, as run_smoke: the model's mapped shards go before the reference maps the native ones
        del model
        gc.collect()
        report.update(
            _dspark_compared_alone(
                load_model, dev, reference_dir, (feats, ctx, anchor), (h, block.base_logits), model_routing
            )
        )
        same = [a == b for a, b in zip(report["draft_tokens"], report["reference_draft_tokens"], strict=True)]
        # greedy drafting conditions each token on the one before: after a first disagreement
        # the rest compare different continuations
        report["draft_tokens_agree_to"] = same.index(False) if False in same else B
        report["draft_token_agreement"] = sum(same) / B
    return report


def _dspark_compared_alone(
    load_model: Loader,
    dev: torch.device,
    reference_dir: str | Path,
    inputs: tuple[torch.Tensor, torch.Tensor, int],
    drafted: tuple[torch.Tensor, torch.Tensor],
    model_routing: RoutingLog,
) -> dict[str, Any]:
    """The reference's figures for the model's warm run (`drafted`: its hidden states and base
    logits from `inputs`: features, context positions, anchor; `model_routing` its routing), the
    reference loaded while the model is not: the model is mapped again after it (no data read)
    for the Markov head and, on a near-tie only, the rerun with the reference's experts."""
    feats, ctx, anchor = inputs
    report: dict[str, Any] = {"reference": str(reference_dir)}
    ref, report["reference_load_ms"] = _timed(dev, lambda: DSparkReference(reference_dir, dev))
    with logging_routing(ref.stages, RoutingLog()) as ref_routing:
        out, report["reference_draft_ms"] = _timed(dev, partial(ref.forward, feats, ctx, anchor))
    del ref  # unmapped before the model is mapped again
    gc.collect()
    model = load_model(dev)
    assert isinstance(model, DSparkDraft)
    ids, positions = model.block_ids(anchor), model.block_positions(ctx)

    def rerun(imposed: RoutingLog) -> torch.Tensor:
        with logging_routing(_moe_layers(model), imposed):
            return model.hidden_states(feats, ctx, ids, positions)

    again, routing = _rerun_on_near_ties(model_routing, ref_routing, rerun)
    h, base = drafted if again is None else (again, None)
    report.update(dspark_parity(_teacher_forced(model, h, out, anchor, base), out, routing))
    report["reference_draft_tokens"] = out.draft_tokens.tolist()
    return report


def _require_a_finite_block(out_dir: str | Path, model: DSparkDraft, block: DraftBlock) -> None:
    """smoke_output naming `out_dir` unless the drafted block has the shapes of `model`'s config and
    finite values (V4.1: its confidences too)."""
    h, base, logits, tokens, confidence = block
    cfg, width = model.config, model.hidden_width
    B = cfg.dspark_block_size
    shapes = [tuple(h.shape), tuple(logits.shape), tuple(tokens.shape)]
    want = [(B, width), (B, cfg.vocab_size), (B,)]
    if confidence is not None:
        shapes.append(tuple(confidence.shape))
        want.append((B,))
    if shapes != want:
        raise LoadError(
            f"{out_dir}: the draft returned hidden, logits, tokens (and confidence) of shapes "
            f"{[list(s) for s in shapes]}; expected {[list(s) for s in want]}",
            kind="smoke_output",
            path=str(out_dir),
        )
    values = (h, base, logits) if confidence is None else (h, base, logits, confidence)
    if not all(torch.isfinite(v).all() for v in values):
        raise LoadError(
            f"{out_dir}: non-finite values in the draft's hidden states, logits or confidences",
            kind="smoke_output",
            path=str(out_dir),
        )


def dspark_against_reference(
    model: DSparkDraft, ref: DSparkReference, features: torch.Tensor, context_positions: torch.Tensor, anchor: int
) -> tuple[DraftBlock, ReferenceBlock, list[dict[str, Any]]]:
    """The model's and the reference's drafts of one block, made comparable: the model is
    routed as the reference where the two differ only on near-ties (model/parity.py), and
    its `logits` row k is computed given the reference's draft token k-1 (the anchor for
    k = 0), so that one flipped near-tie does not make every later row compare another
    continuation. `draft_tokens` is the model's own greedy chain. -> (model's block, the
    reference's block, the routing disagreements with their margins)."""
    with logging_routing(ref.stages, RoutingLog()) as ref_routing:
        expected = ref.forward(features, context_positions, anchor)
    ids, positions = model.block_ids(anchor), model.block_positions(context_positions)
    h, routing = _routed_as_the_reference(
        model, ref_routing, lambda: model.hidden_states(features, context_positions, ids, positions)
    )
    return _teacher_forced(model, h, expected, anchor), expected, routing


def _teacher_forced(
    model: DSparkDraft, h: torch.Tensor, expected: ReferenceBlock, anchor: int, base: torch.Tensor | None = None
) -> DraftBlock:
    """The model's block from its hidden states `h` (and their base logits, when computed
    already), its `logits` row k given the reference's draft token k-1 (the anchor for k = 0)."""
    base = model.base_logits(h) if base is None else base
    _, tokens = model.markov_decode(base, anchor)
    prev = torch.tensor([anchor, *expected.draft_tokens.tolist()[:-1]], device=base.device)
    logits = torch.stack([base[k] + model.model.markov_head.bias(prev[k]) for k in range(base.shape[0])])
    return DraftBlock(h, base, logits, tokens, model.confidence(h, prev))


def dspark_parity(mine: DraftBlock, expected: ReferenceBlock, routing: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures model/parity.py's verdict reads, from dspark_against_reference's result (V4.1: the
    largest confidence difference too)."""
    confidence = {}
    if mine.confidence is not None and expected.confidence is not None:
        confidence["confidence_max_abs_diff"] = (mine.confidence - expected.confidence).abs().max().item()
    return {
        **confidence,
        "routing_disagreements": routing,
        "hidden_max_abs_diff": (mine.hidden_states.float() - expected.hidden_states.float()).abs().max().item(),
        "hidden_max_abs": expected.hidden_states.float().abs().max().item(),
        "base_logits_max_abs_diff": (mine.base_logits - expected.base_logits).abs().max().item(),
        "logits_max_abs_diff": (mine.logits - expected.logits).abs().max().item(),
        "logits_max_abs": expected.logits.abs().max().item(),
        "top1_agreement": (mine.logits.argmax(-1) == expected.logits.argmax(-1)).float().mean().item(),
        "top1_agreement_up_to_ties": top1_agreement_up_to_ties(mine.logits, expected.logits),
    }
