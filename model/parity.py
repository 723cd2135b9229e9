"""The comparison of the bundled model with the independent native reference: one rule, one
verdict, for `convert-dsv4 smoke --native` (exit 55) and `convert-dsv4 check --native` (exit 85).

The model and the reference compute the same draft in bf16 by different code, so their
numbers differ by rounding. Rounding is harmless except where it flips a discrete choice:
which experts a token routes to, and which token is the argmax. Such a flip is forgiven only
on a near-tie, the same rule for both choices: the reference itself scores the two
candidates within TIE_REL of the largest score of that row (|selection score| for routing,
|logit| for top-1). Anything else is a disagreement and fails.

Routing (model/README.md#moe-routing): both sides log every MoE call's selection scores
(score + correction bias) and chosen experts (`RoutingLog`, installed with `logging_routing`).
Where the model's experts differ from the reference's only on near-ties, the model is run
again with the reference's experts imposed, so that the outputs compared are those of the
same routing; the disagreements and their margins are reported. The verdict itself
(`parity_verdict`) reads only the smoke report: no torch at import.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

SMOKE_TOKENS = 8  # default tokens of smoke and check --smoke (DSpark: context tokens)
TIE_REL = 0.01  # near-tie: the reference's two candidates within 1% of the row's max |score|
MAX_REL_DIFF = 2e-2  # max|diff| / max|value| of hidden states and logits: bf16 rounding, far below a wrong weight
MIN_TOP1 = 1.0  # share of tokens whose top-1 agrees with the reference's, near-ties counted as agreeing


class Routing(NamedTuple):
    """One MoE call: selection scores [T, E] (fp32, on the CPU) and the experts used [T, k]."""

    selection: torch.Tensor
    chosen: torch.Tensor  # what this side would pick on its own
    used: torch.Tensor  # what it ran with (`chosen`, or the imposed experts)


class RoutingLog:
    """Every routing decision of one forward, in call order. MoE code calls it with its
    selection scores and chosen experts and runs with the experts it returns: its own, or,
    with `impose`, those the other log recorded for the same call."""

    def __init__(self, impose: RoutingLog | None = None) -> None:
        self.calls: list[Routing] = []
        self.impose = impose

    def __call__(self, selection: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        used = chosen if self.impose is None else self.impose.calls[len(self.calls)].used.to(chosen.device)
        self.calls.append(Routing(selection.detach().float().cpu(), chosen.detach().cpu(), used.detach().cpu()))
        return used


@contextmanager
def logging_routing(routers: list[Any], log: RoutingLog) -> Iterator[RoutingLog]:
    """Install `log` as the `routing_log` of each of `routers` (mtp.MoE modules, or
    reference objects) for the duration of the block."""
    for r in routers:
        r.routing_log = log
    try:
        yield log
    finally:
        for r in routers:
            r.routing_log = None


def routing_disagreements(mine: RoutingLog, ref: RoutingLog, rel_tie: float = TIE_REL) -> list[dict[str, Any]]:
    """Each (call, token) where `mine` chose other experts than the reference, with the
    margin: how far below the reference's k-th choice the reference scores the expert
    `mine` took instead (the largest such gap), and the tolerance rel_tie * max|selection|
    of that token in the reference. `near_tie` when the margin is within the tolerance."""
    found = []
    for call, (m, r) in enumerate(zip(mine.calls, ref.calls, strict=True)):
        for token in range(r.chosen.shape[0]):
            theirs = r.chosen[token]
            extra = set(m.chosen[token].tolist()) - set(theirs.tolist())
            if not extra:
                continue
            sel = r.selection[token]
            kth = sel[theirs].min()
            margin = max(float(kth - sel[e]) for e in extra)
            tolerance = rel_tie * float(sel.abs().max())
            found.append(
                {
                    "call": call,
                    "token": token,
                    "margin": margin,
                    "tolerance": tolerance,
                    "near_tie": margin <= tolerance,
                }
            )
    return found


def top1_agreement_up_to_ties(logits: torch.Tensor, logits_ref: torch.Tensor, rel_tie: float = TIE_REL) -> float:
    """Share of rows whose top-1 agrees with the reference's, where a disagreement counts
    as agreeing when the reference itself puts the two tokens within rel_tie * max|logit|
    of each other: bf16 implementations on different hardware can order such a near-tie
    either way (seen on random tiny checkpoints: 0.14% logit differences, one flipped token
    in four). A disagreement on a token the reference ranks decisively still fails."""
    tol = rel_tie * logits_ref.abs().max()
    mine = logits.argmax(-1, keepdim=True)
    gap = logits_ref.max(-1, keepdim=True).values - logits_ref.gather(-1, mine)
    return (gap <= tol).float().mean().item()


def agreement_figures(logits: torch.Tensor, native: torch.Tensor, tie_rel: float = TIE_REL) -> dict[str, Any]:
    """How a draft's logits agree with the native draft's on the same inputs: top-1 agreement over
    the rows where the native top-2 margin exceeds tie_rel * max|native logit| (elsewhere either
    order is a near-tie: model/parity.py), None when no row is that decisive; the largest logit
    difference, and the relative RMS of the difference."""
    top2 = native.topk(2, dim=-1).values
    epsilon = tie_rel * native.abs().max().item()
    decisive = (top2[:, 0] - top2[:, 1]) > epsilon
    same = logits.argmax(-1) == native.argmax(-1)
    compared = int(decisive.sum())
    diff = (logits - native).float()
    return {
        "top1_agreement": same[decisive].float().mean().item() if compared else None,
        "rows_compared": compared,
        "rows": native.shape[0],
        "tie_epsilon": epsilon,
        "logits_max_abs_diff": diff.abs().max().item(),
        "logits_max_abs": native.abs().max().item(),
        "logits_rel_rms": (diff.norm() / native.float().norm().clamp_min(1e-30)).item(),
    }


def parity_verdict(
    report: dict[str, Any], min_top1: float = MIN_TOP1, max_rel_diff: float = MAX_REL_DIFF
) -> tuple[bool, str]:
    """(passed, one line saying why) for a smoke report with the reference's figures
    (model/smoke.py): hidden states and logits within max_rel_diff of the reference's
    largest value, top-1 agreement up to near-ties at least min_top1, every routing
    disagreement a near-tie, and (V4.1's drafter) every confidence within max_rel_diff of the
    reference's (an absolute difference: they are probabilities)."""
    hidden = report["hidden_max_abs_diff"] / max(report["hidden_max_abs"], 1e-30)
    logits = report["logits_max_abs_diff"] / max(report["logits_max_abs"], 1e-30)
    top1 = report["top1_agreement_up_to_ties"]
    routing = report["routing_disagreements"]
    decisive = [d for d in routing if not d["near_tie"]]
    said = (
        f"hidden max|diff| {hidden:.2%} of max|h|, logits {logits:.2%} of max|logit|, "
        f"top-1 agreement {report['top1_agreement']:.3f} ({top1:.3f} counting near-ties)"
    )
    if "draft_tokens" in report:
        said += f", draft tokens {report['draft_tokens']} vs the reference's {report['reference_draft_tokens']}"
    confidence = report.get("confidence_max_abs_diff", 0.0)  # V4.1's: probabilities, so an absolute difference
    if "confidence_max_abs_diff" in report:
        said += f", confidence max|diff| {confidence:.2%}"
    if decisive:
        d = max(decisive, key=lambda d: d["margin"])
        said += (
            f", routing differs at {len(decisive)} token(s) beyond a near-tie (MoE call {d['call']}, "
            f"token {d['token']}: margin {d['margin']:.4g} > tolerance {d['tolerance']:.4g})"
        )
    elif routing:
        largest = max(d["margin"] for d in routing)
        said += (
            f", routing differs at {len(routing)} near-tie(s) (largest margin {largest:.4g}, "
            f"within {TIE_REL:.0%} of the token's max score; compared with the reference's routing)"
        )
    passed = (
        math.isfinite(hidden)
        and math.isfinite(logits)
        and hidden <= max_rel_diff
        and logits <= max_rel_diff
        and math.isfinite(confidence)
        and confidence <= max_rel_diff
        and top1 >= min_top1
        and not decisive
    )
    return passed, f"{said} (limits {max_rel_diff:.0%} and top-1 {min_top1:.3f})"
