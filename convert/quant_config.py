"""Quantisation layer names: carrying a quantization_config across the conversion, and
checking that every linear of the draft resolves to one scheme (mapping/README.md#quantisation-layer-names).

A compressed-tensors config names modules (`targets`, `ignore`, `re:` regexes, class names
such as "Linear"). Written for the native checkpoint it names `mtp.0.attn.wq_a`,
`mtp.0.ffn.experts.7.w1`, ...; the draft's layers are `model.layers.{L}.attn.fused_wqa_wkv`,
`model.layers.{L}.ffn.experts`, ... Nothing here rewrites pattern text. Instead:

1. every native module feeding a draft layer is resolved against the source config with
   compressed-tensors' own matching functions (ignore first, then the most specific target);
2. which native modules make up which draft layer comes from the conversion plan, i.e. from
   the mapping table's rules (a concat fuses wq_a + wkv, a stack fuses all routed experts),
   and the layers' names from the bundled model's, cached beside its layout: no model is
   built (convert/schemes/base.py `layer_map`);
3. the parts of one draft layer must agree, otherwise no config for the draft can reproduce
   the source's assignment: that is an error, never a silent change;
4. the output config lists each draft layer by its exact name, in the group (or the ignore
   list) its parts resolved to, and is verified by resolving it again the same way.

compressed-tensors is an optional extra (dsv4-convert[quant]) and is imported lazily: a
converter run without it fails only when a source actually holds such a config, and
`check` reports the scheme check as skipped.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache, partial
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from dsv4.convert.errors import CheckError, PlanError
from dsv4.convert.plan import Plan
from dsv4.convert.schemes import deepseek_fp8
from dsv4.convert.schemes.base import INSTALL_HINT, LayerMap, layer_map
from dsv4.model.errors import CheckpointError
from dsv4.model.layout import LayerKind, draft_layers
from dsv4.model.record import LayoutRecord, RecordError

if TYPE_CHECKING:
    from torch import nn

CT_METHOD = "compressed-tensors"
# vLLM's message when a layer's name matches no target (issue #44817: the name was "")
NO_TARGET = "Unable to find matching target for {name} in the compressed-tensors config"
# Parts of a compressed-tensors config that name layers but are not config groups or ignore:
# carrying them would leave native names behind, so a non-empty one is refused.
NAMED_SIBLINGS = ("sparsity_config", "transform_config", "moe_sparsity_config")

Status = Literal["scheme", "ignored", "unmatched", "ambiguous"]


@cache
def _stand_in(kind: LayerKind) -> nn.Module:
    # Class targets are matched on the module's class (its MRO names), nothing else: a
    # 1x1 layer on the meta device stands for every layer of its kind.
    # torch is imported here, not at module level: a conversion imports this module for
    # carried_quantization and should not pay torch's start-up time for it (a config that
    # needs matching imports compressed-tensors, and so torch, anyway)
    from torch import nn

    class FusedMoE(nn.Linear):
        """What compressed-tensors' class matching sees for the routed experts. vLLM's FusedMoE
        takes the scheme of a "Linear" target (`_add_fused_moe_to_target_scheme_map`); deriving
        from Linear gives that, and the class name matches a "FusedMoE" target."""

    stand_in_class: dict[LayerKind, type[nn.Module]] = {"linear": nn.Linear, "moe": FusedMoE, "embedding": nn.Embedding}
    return stand_in_class[kind](1, 1, device="meta")


def compressed_tensors() -> ModuleType | None:
    """compressed-tensors' matching module, or None when the optional extra is not installed."""
    try:
        from compressed_tensors.utils import match
    except ImportError:
        return None
    return match


@dataclass(frozen=True)
class Resolution:
    """What a config gives one layer: a scheme, ignored, nothing, or several schemes at the
    same precedence (`via` names the entries that decided)."""

    status: Status
    group: str | None = None
    scheme: str | None = None  # canonical JSON of the scheme, so equal schemes compare equal
    via: tuple[str, ...] = ()

    @property
    def outcome(self) -> tuple[str, str | None]:
        return self.status, self.scheme

    def describe(self) -> str:
        via = ", ".join(repr(v) for v in self.via)
        if self.status == "scheme":
            return f"{self.group} (via {via})"
        if self.status == "ignored":
            return f"ignored (via {via})"
        if self.status == "ambiguous":
            return f"targets {via} of different schemes"
        return "no scheme (no entry matches)"


class Matcher:
    """A parsed compressed-tensors config, resolved with the library's matching functions.

    Precedence follows compressed-tensors (`match_targets`: exact names, then regexes, then
    classes; the first wins) and vLLM (a name match beats a class match). Two name matches
    with different schemes are ambiguous: the two orders could pick different ones.
    """

    def __init__(self, config: Mapping[str, Any], where: str, error: Callable[..., CheckError | PlanError]) -> None:
        match = compressed_tensors()
        if match is None:
            raise error(
                f"{where}: quantization_config is {CT_METHOD}, "
                f"which needs the compressed-tensors library: {INSTALL_HINT}"
            )
        from compressed_tensors.quantization import QuantizationConfig
        from pydantic import ValidationError

        try:
            parsed = QuantizationConfig.model_validate(dict(config))
        except ValidationError as exc:
            first = exc.errors()[0]
            raise error(
                f"{where}: quantization_config is not a valid {CT_METHOD} config: "
                f"{'.'.join(map(str, first['loc']))}: {first['msg']}"
            ) from None
        self.match = match
        # a target repeated in a later group takes that group, as compressed-tensors' own
        # target -> scheme ordered dict does
        self.target_group: dict[str, str] = {}
        for group, scheme in parsed.config_groups.items():
            for target in scheme.targets:
                self.target_group[target] = group
        self.schemes = {
            g: json.dumps(s.model_dump(mode="json", exclude={"targets"}), sort_keys=True)
            for g, s in parsed.config_groups.items()
        }
        self.ignore: list[str] = list(parsed.ignore or [])

    def resolve(self, name: str, kind: LayerKind) -> Resolution:
        module = _stand_in(kind)
        ignored = [e for e in self.ignore if self.match.is_match(name, module, e)]
        if ignored:
            return Resolution("ignored", via=(ignored[0],))
        matched = self.match.match_targets(name, module, self.target_group)
        if not matched:
            return Resolution("unmatched")
        tier = [t for t in matched if self.match.match_name(name, t)] or matched
        if len({self.schemes[self.target_group[t]] for t in tier}) > 1:
            return Resolution("ambiguous", via=tuple(tier))
        group = self.target_group[matched[0]]
        return Resolution("scheme", group, self.schemes[group], (matched[0],))

    def entries(self) -> list[tuple[str, str]]:
        """(where in the config, entry) for every target and ignore entry."""
        return [(f"config_groups.{g}.targets", t) for t, g in self.target_group.items()] + [
            ("ignore", e) for e in self.ignore
        ]


def _refuse_named_siblings(qc: Mapping[str, Any], where: str) -> None:
    for key in NAMED_SIBLINGS:
        value = qc.get(key)
        if key == "sparsity_config" and isinstance(value, Mapping):
            # llm-compressor writes a dense sparsity_config with no targets: nothing to carry
            value = [*(value.get("targets") or []), *(value.get("ignore") or [])]
        if value:
            raise PlanError(
                f"{where}: quantization_config.{key} names layers too; "
                "carrying it is not supported (refusing rather than leaving native names in it)",
                kind="quant_carry",
                path=str(where),
            )


def rewrite_for_draft(qc: Mapping[str, Any], layers: LayerMap, where: str) -> tuple[dict[str, Any], list[str]]:
    """`qc` (written for native names) with targets and ignore rewritten to the draft's
    quantisation layer names, so each draft layer gets the scheme its native parts had;
    plus the draft linears that no entry matched, which go to `ignore` (no scheme either
    way, but vLLM refuses a linear that matches nothing)."""
    _refuse_named_siblings(qc, where)
    source = Matcher(qc, where, partial(PlanError, kind="quant_carry"))
    expected: dict[str, Resolution] = {}
    for draft, natives in layers.parts.items():
        kind = layers.native_kind(draft)
        found = {n: source.resolve(n, kind) for n in natives}
        for native, res in found.items():
            if res.status == "ambiguous":
                raise PlanError(
                    f"{where}: quantization_config matches {native} with {res.describe()} "
                    f"at the same precedence; which one {draft} should get is undefined",
                    kind="quant_carry",
                    path=str(where),
                )
        outcomes: dict[tuple[str, str | None], str] = {}
        for native, res in found.items():
            outcomes.setdefault(res.outcome, native)
        if len(outcomes) > 1:
            said = "; ".join(f"{n} -> {found[n].describe()}" for n in outcomes.values())
            raise PlanError(
                f"{where}: quantization_config cannot be carried: the draft fuses {len(natives)} native "
                f"modules into {draft}, and they resolve differently ({said}); one layer takes one scheme",
                kind="quant_carry",
                path=str(where),
            )
        expected[draft] = found[natives[0]]

    out = copy.deepcopy(dict(qc))
    targets: dict[str, list[str]] = {g: [] for g in out["config_groups"]}
    ignore: list[str] = []
    added: list[str] = []
    for draft in sorted(expected):
        res = expected[draft]
        if res.status == "scheme":
            assert res.group is not None
            targets[res.group].append(draft)
        elif res.status == "ignored":
            ignore.append(draft)
        elif layers.kinds[draft] != "embedding":
            ignore.append(draft)
            added.append(draft)
    groups = {}
    for group, body in out["config_groups"].items():
        if not targets[group]:
            continue  # the group covers only layers outside the draft (main-model layers)
        groups[group] = targets[group] if isinstance(body, list) else {**body, "targets": targets[group]}
    out["config_groups"] = groups
    out["ignore"] = ignore

    rewritten = Matcher(out, where, partial(PlanError, kind="quant_carry"))
    for draft, res in expected.items():
        want = ("ignored", None) if draft in added else res.outcome
        got = rewritten.resolve(draft, layers.kinds[draft])
        if got.outcome != want:
            raise PlanError(
                f"{where}: rewritten quantization_config gives {draft} "
                f"{got.describe()}, its native parts had {res.describe()}",
                kind="quant_carry",
                path=str(where),
            )
    return out, added


def carried_quantization(plan: Plan) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(quantization_config for the output config.json, record for its dsv4_convert entry).

    Forward: an FP8 block config names no layers and is carried unchanged (its block size
    is what the planned scale shapes were checked against); a compressed-tensors config is
    rewritten to the draft's names and the source kept in the record. Reverse: the source
    config comes back from that record.
    """
    where = f"{plan.location}/config.json"
    qc = plan.config.get("quantization_config")
    if plan.direction == "reverse":
        try:
            record = LayoutRecord.of(plan.config, where)
        except RecordError as exc:
            raise CheckpointError(str(exc), kind="malformed_config", path=where) from None
        note = record.quantization_config if record is not None else None
        return (note["source"] if note else qc), None
    if qc is None:
        return None, None
    method = qc.get("quant_method")
    if method == deepseek_fp8.METHOD:
        deepseek_fp8.refuse_named_layers(
            qc, where, partial(PlanError, kind="quant_carry"), "carrying them to the draft"
        )
        return qc, None
    if method != CT_METHOD:
        raise PlanError(
            f"{where}: quantization_config quant_method {method!r} is not one this "
            f"converter carries (fp8, {CT_METHOD}): its layer names would stay native",
            kind="quant_carry",
            path=str(where),
        )
    out, added = rewrite_for_draft(qc, layer_map(plan), where)
    return out, {
        "source": qc,
        "names": "rewritten from native module names to the draft's quantisation layer names",
        "added_to_ignore": added,
    }


@dataclass(frozen=True)
class QuantSummary:
    """A passed (or, without the library, partly skipped) quantisation check."""

    layers: int
    schemes_checked: bool
    reason: str
    library_missing: bool = False  # a compressed-tensors config, but not the library to check it


def _short(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def check_draft_quantization(model: nn.Module, config: Mapping[str, Any], where: str) -> QuantSummary:
    """Every linear of `model` has a quantisation layer name and, under a compressed-tensors
    `quantization_config` in `config`, resolves to exactly one scheme or is ignored; every
    entry of that config names some layer of the draft. Raises empty_quant_name or
    quant_scheme with a one-line reason; `where` is the config.json path."""
    layers = draft_layers(model)
    qc = config.get("quantization_config")
    ct_config = qc if isinstance(qc, Mapping) and qc.get("quant_method") == CT_METHOD else None
    matcher = (
        Matcher(ct_config, where, partial(CheckError, kind="quant_scheme"))
        if ct_config is not None and compressed_tensors() is not None
        else None
    )

    empty = [layer for layer in layers if not layer.name]
    if empty:
        said = []
        for layer in empty:
            res = matcher.resolve("", layer.kind) if matcher is not None else Resolution("unmatched")
            if res.status == "unmatched":
                said.append(
                    f"module {layer.path} has an empty quantisation layer name: "
                    f"{NO_TARGET.format(name='')} (vLLM issue #44817: built without prefix=)"
                )
            else:
                said.append(
                    f"module {layer.path} has an empty quantisation layer name: only {res.describe()} "
                    "reaches it and no ignore entry can name it (vLLM issue #44817: built without prefix=)"
                )
        raise CheckError(f"{where}: {'; '.join(said)}", kind="empty_quant_name", path=str(where))

    if ct_config is None:
        what = (
            "FP8 block quantisation (checked against the scale shapes under config)"
            if isinstance(qc, Mapping) and qc.get("quant_method") == deepseek_fp8.METHOD
            else "no compressed-tensors quantization_config"
        )
        return QuantSummary(len(layers), False, f"{len(layers)} quantisation layer names, none empty; {what}")
    if matcher is None:
        return QuantSummary(
            len(layers),
            False,
            f"compressed-tensors not installed ({INSTALL_HINT}): "
            f"schemes not checked; {len(layers)} quantisation layer names, none empty",
            library_missing=True,
        )

    # entries naming nothing of the draft first: native names left in explain everything after
    problems = [
        f"{place} entry {entry!r} matches no layer of the draft (native names left unrewritten?)"
        for place, entry in matcher.entries()
        if not any(matcher.match.is_match(layer.name, _stand_in(layer.kind), entry) for layer in layers)
    ]
    outcome: Counter[str] = Counter()
    for layer in layers:
        if layer.kind == "embedding":
            continue  # not a linear: it may take a scheme but need not
        res = matcher.resolve(layer.name, layer.kind)
        if res.status == "unmatched":
            problems.append(f"{layer.name}: {NO_TARGET.format(name=layer.name)} and no ignore entry names it")
        elif res.status == "ambiguous":
            problems.append(f"{layer.name}: matched by {res.describe()}")
        else:
            outcome[res.group or "ignored"] += 1
    if problems:
        raise CheckError(
            f"{where}: {len(problems)} problem(s): {_short(problems)}", kind="quant_scheme", path=str(where)
        )
    counts = ", ".join(f"{n} {g}" for g, n in sorted(outcome.items()))
    return QuantSummary(len(layers), True, f"every linear resolves to exactly one scheme or is ignored ({counts})")
