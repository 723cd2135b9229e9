"""The planner: (inventory, table) -> Plan, a pure function with no I/O.

A Plan lists every output tensor with the source byte ranges it is made of, in write
order, and every skipped source key with its reason. Every operation in a table moves
bytes (a row-major concat along dim 0 or a stack is its parts back to back), so a planned
tensor is simply a list of byte ranges: the executor needs no knowledge of the ops. A draft
made to serve beside a quantised target (convert/routes.py) also has computed tensors: those
carry a `Transform` (convert/transforms.py computes it from its inputs, each read whole).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from dsv4.convert.choose import Direction, drafter_family
from dsv4.convert.errors import PlanError
from dsv4.convert.planned import PlannedTensor
from dsv4.convert.sources.inventory import Inventory
from dsv4.mapping.errors import TableError
from dsv4.mapping.patterns import PINNED, expand
from dsv4.mapping.probe import stage_binding
from dsv4.mapping.table import Rule, Table, rule_bindings
from dsv4.mapping.targets import require_target
from dsv4.model import native
from dsv4.model.checkpoint import CONFIG
from dsv4.model.config import ModelConfig
from dsv4.model.dtypes import ITEMSIZE, nbytes
from dsv4.model.errors import CheckpointError
from dsv4.model.layout import TARGET_LAYER, draft_layers_present
from dsv4.model.record import Identified, TableIdentity
from dsv4.model.safetensors_header import TensorBytes
from dsv4.model.storage import dense_block_scale

NATIVE_BLOCK = re.compile(r"(mtp\.\d+)\.")  # a native draft block's prefix


@dataclass(frozen=True)
class Plan(Identified):
    direction: Direction
    location: str  # the source's: a directory, or hub:org/name (its inventory's location)
    config: dict[str, Any]  # the source's config.json, as read
    model_config: ModelConfig  # the same, validated (model/config.py): what the layout was planned for
    identity: TableIdentity  # the table's, its target "native" for a reverse plan
    tensors: tuple[PlannedTensor, ...]
    skipped: dict[str, str] = field(default_factory=dict)  # source key -> reason
    revision: str | None = None
    config_kind: str = "record"  # the table's [table] config: what the output's config.json is
    config_bytes: bytes = b""  # the source's config.json as read (config_kind "source" writes it unchanged)
    drafter_family: str | None = None  # the drafter family the source holds (mapping/drafters.py)

    @property
    def bytes_to_write(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def bytes_to_read(self) -> int:
        # every copied byte is read once from the source (a shared tensor copied into
        # several blocks is read once per copy); a computation's inputs once for all the
        # tensors it makes
        copied = sum(t.nbytes for t in self.tensors if t.transform is None)
        computations = {t.transform.computation: t.pieces for t in self.tensors if t.transform is not None}
        return copied + sum(p.nbytes for pieces in computations.values() for p in pieces)

    @property
    def files_needed(self) -> list[str]:
        return sorted({p.file for t in self.tensors for p in t.pieces})

    def summary(self) -> dict[str, Any]:
        ops = Counter(t.op for t in self.tensors)
        reasons = Counter(self.skipped.values())
        return {
            "direction": self.direction,
            "source": self.location,
            "revision": self.revision,
            **self.identity.to_json(),
            "drafter_family": self.drafter_family,
            "tensors_out": len(self.tensors),
            "source_keys_consumed": sum(len({p.name for p in t.pieces}) for t in self.tensors),
            "source_keys_skipped": len(self.skipped),
            "bytes_to_read": self.bytes_to_read,
            "bytes_to_write": self.bytes_to_write,
            "files_to_read": self.files_needed,
            "ops": dict(sorted(ops.items())),
            "skip_reasons": dict(reasons.most_common()),
        }

    def to_json(self) -> dict[str, Any]:
        out = self.summary()
        out["tensors"] = [
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "op": t.op,
                "rule": t.rule,
                "pieces": [{**asdict(p), "shape": list(p.shape)} for p in t.pieces],  # as JSON reads back
                **({"transform": t.transform.to_json()} if t.transform is not None else {}),
            }
            for t in self.tensors
        ]
        out["skipped"] = self.skipped
        return out


def _refuse(inv: Inventory, table: Table) -> None:
    for rule in table.rules:
        if rule.op != "refuse":
            continue
        rx = rule.source_regexes[0]
        refused = [key for key in inv.tensors if rx.match(key)]
        if refused:
            key = min(refused)  # the same key in every run, without sorting all 69,187
            raise CheckpointError(
                f"{inv.tensors[key].file}: tensor {key}: {rule.reason}; refusing to convert",
                kind="unsupported_layout",
                path=str(inv.tensors[key].file),
                tensor=key,
            )


def _bounds(cfg: ModelConfig) -> dict[str, tuple[int, str]]:
    """placeholder -> (its limit, the config field the limit comes from)"""
    out = {
        "i": (cfg.num_nextn_predict_layers, "num_nextn_predict_layers"),
        "e": (cfg.draft_routed_experts, cfg.draft_experts_field),  # V4.1: dspark_n_routed_experts
        "j": (cfg.num_hidden_layers, "num_hidden_layers"),
    }
    if cfg.is_dspark:
        out["s"] = (cfg.dspark_stages, "DSpark stages (len(dspark_target_layer_ids))")
    return out


def _by_first_component(rules: list[Rule]) -> dict[str, list[tuple[Rule, re.Pattern[str]]]]:
    """Rules indexed by the literal first name component of each source pattern ("*" when
    that component is a placeholder), so each key is matched against a handful of rules:
    a full Flash checkpoint has 69,187 keys."""
    index: dict[str, list[tuple[Rule, re.Pattern[str]]]] = {}
    for r in rules:
        for pattern, rx in zip(r.sources, r.source_regexes, strict=True):
            head = pattern.split(".", 1)[0]
            index.setdefault("*" if "{" in head else head, []).append((r, rx))
    return index


def _classify(inv: Inventory, rules: list[Rule], cfg: ModelConfig) -> dict[str, str]:
    """Check that every key is covered by exactly one rule, in range; return the skips."""
    skipped: dict[str, str] = {}
    bounds = _bounds(cfg)
    index = _by_first_component(rules)
    anywhere = index.get("*", [])
    by_head = {head: candidates + anywhere for head, candidates in index.items() if head != "*"}
    for key, src in inv.tensors.items():
        hits = [(r, m) for r, rx in by_head.get(key.split(".", 1)[0], anywhere) if (m := rx.match(key))]
        if not hits:
            raise PlanError(
                f"{src.file}: tensor {key}: no rule of the mapping table covers it (unknown key; refusing to drop it "
                "silently)",
                kind="uncovered_key",
                path=str(src.file),
                tensor=key,
            )
        if len(hits) > 1 and len({r.label for r, _ in hits}) > 1:
            raise TableError(
                f"tensor {key} is matched by several rules: {sorted({r.label for r, _ in hits})}",
                kind="malformed_table",
            )
        rule, m = hits[0]
        groups = m.groupdict()
        for ph, (limit, what) in bounds.items():
            value = groups.get(ph)
            if value is not None and int(value) >= limit:
                raise CheckpointError(
                    f"{src.file}: tensor {key}: index {value} but config.json has {what} = {limit} (keys and config "
                    "disagree)",
                    kind="unsupported_layout",
                    path=str(src.file),
                    tensor=key,
                )
        if PINNED & groups.keys():
            for ph, want in stage_binding(cfg).items():
                if groups.get(ph) is not None and int(groups[ph]) != want:
                    raise CheckpointError(
                        f"{src.file}: tensor {key}: only the {ph} stage mtp.{want} holds this tensor, not stage "
                        f"{groups[ph]} (mapping/README.md#dspark-source-checkpoint)",
                        kind="unsupported_layout",
                        path=str(src.file),
                        tensor=key,
                    )
        if rule.op == "skip":
            skipped[key] = rule.reason or ""
    return skipped


def _source_names(rule: Rule, binding: dict[str, int], cfg: ModelConfig) -> list[str]:
    if rule.op == "stack":
        return [expand(s, {**binding, "e": e}) for e in range(cfg.draft_routed_experts) for s in rule.sources]
    return [expand(s, binding) for s in rule.sources]


def _combined_shape(rule: Rule, parts: list[tuple[int, ...]], cfg: ModelConfig, target: str) -> tuple[int, ...]:
    if rule.op in ("copy", "rename", "keep"):
        return parts[0]
    per_row = parts[0][1:]
    if any(p[1:] != per_row for p in parts):
        raise PlanError(
            f"{target}: sources {[list(p) for p in parts]} cannot be concatenated along dim 0",
            kind="layout_mismatch",
            path=str(target),
        )
    if rule.op == "concat":
        return (sum(p[0] for p in parts), *per_row)
    k = len(rule.sources)
    rows = sum(p[0] for p in parts[:k])
    return (cfg.draft_routed_experts, rows, *per_row)


def _write_order(tensors: list[PlannedTensor]) -> tuple[PlannedTensor, ...]:
    # follow the source files front to back, so reads move forward through each shard
    return tuple(sorted(tensors, key=lambda t: (t.pieces[0].file, t.pieces[0].start)))


def _require_stages(inv: Inventory, cfg: ModelConfig, stages: set[int]) -> None:
    """Refuse (35) a DSpark checkpoint lacking a stage 0..S-1 (one beyond S fails _classify)."""
    missing = sorted(set(range(cfg.dspark_stages)) - stages)
    if missing:
        raise CheckpointError(
            f"{inv.location}/{CONFIG}: {cfg.dspark_stages} DSpark stages (len(dspark_target_layer_ids)) but the "
            f"tensors hold stage(s) {sorted(stages)}: stage {missing[0]} is missing (keys and config disagree)",
            kind="unsupported_layout",
        )


def _refuse_unconfigured(inv: Inventory, rule: Rule, binding: dict[str, int], target: str) -> None:
    """A rule binding for a tensor the config's layout lacks (a Vision-Exp router's gate.bias_vl
    elsewhere): refused (33) where the checkpoint holds a source of it all the same."""
    held = [n for n in _source_names(rule, binding, inv.model_config) if n in inv.tensors]
    if held:
        src = inv.tensors[held[0]]
        raise PlanError(
            f"{src.file}: tensor {held[0]}: not a tensor of the {target} layout for this config.json (keys and config "
            "disagree)",
            kind="layout_mismatch",
            path=str(src.file),
            tensor=held[0],
        )


def _source_pieces(
    inv: Inventory,
    rule: Rule,
    binding: dict[str, int],
    target: str,
    expected_src: dict[str, tuple[str, tuple[int, ...]]],
    consumed: Counter[str],
) -> tuple[list[TensorBytes], str]:
    """The source tensors parameter `target` is made of (counted in `consumed`), each of the
    dtype and shape config.json implies, and their one dtype."""
    pieces, dtypes = [], set()
    variant = native.variant_of(inv.model_config)
    for name in _source_names(rule, binding, inv.model_config):
        src = inv.tensors.get(name)
        if src is None:
            raise PlanError(
                f"{target}: its source tensor {name} is not in the checkpoint ({rule.label})",
                kind="missing_source",
                path=str(target),
                tensor=name,
            )
        want = expected_src[name]
        if (src.dtype, src.shape) != want:
            grid = f", weight_block_size {list(inv.model_config.weight_block_size)}" if dense_block_scale(name) else ""
            raise PlanError(
                f"{src.file}: tensor {name}: {src.dtype}{list(src.shape)} but config.json ({variant}{grid}) "
                f"implies {want[0]}{list(want[1])}",
                kind="layout_mismatch",
                path=str(src.file),
                tensor=name,
            )
        pieces.append(src)
        dtypes.add(src.dtype)
        consumed[name] += 1
    if len(dtypes) != 1:
        raise PlanError(
            f"{target}: sources of one parameter have different dtypes {sorted(dtypes)}",
            kind="layout_mismatch",
            path=str(target),
        )
    return pieces, dtypes.pop()


def plan_conversion(inv: Inventory, table: Table) -> Plan:
    """Forward: a native checkpoint -> the table's target layout."""
    _refuse(inv, table)
    cfg = inv.model_config
    rules = [r for r in table.rules_for(cfg.expert_dtype) if r.op != "refuse"]
    skipped = _classify(inv, rules, cfg)
    blocks = {m.group(1) for key in inv.tensors if (m := NATIVE_BLOCK.match(key))}  # beyond the config: _classify
    if cfg.is_dspark:
        _require_stages(inv, cfg, {int(b.removeprefix("mtp.")) for b in blocks})
    else:
        cfg.require_draft_blocks(sorted(blocks), f"{inv.location}/{CONFIG}")
    expected_src = native.draft_layout(cfg, with_emb_head=True)
    layout = require_target(table.target).layout(cfg)
    consumed: Counter[str] = Counter()
    out: dict[str, PlannedTensor] = {}
    for rule in rules:
        if rule.target is None:
            continue
        for binding in rule_bindings(rule, cfg):
            target = expand(rule.target, binding)
            if target not in layout:
                _refuse_unconfigured(inv, rule, binding, table.target)
                continue  # a tensor only some releases have (Vision-Exp's gate.bias_vl), not this one
            pieces, src_dtype = _source_pieces(inv, rule, binding, target, expected_src, consumed)
            shapes = [p.shape for p in pieces]
            dtype = rule.view or src_dtype
            if ITEMSIZE[dtype] != ITEMSIZE[src_dtype]:
                raise TableError(
                    f"{rule.label}: view {dtype} would change the element size of {src_dtype}",
                    kind="malformed_table",
                    path=str(rule.label),
                )
            shape = _combined_shape(rule, shapes, cfg, target)
            if target in out:
                raise PlanError(
                    f"{target}: produced twice ({out[target].rule} and {rule.label})",
                    kind="duplicate_target",
                    path=str(target),
                )
            want_t = layout.get(target)
            if want_t is None:
                raise PlanError(
                    f"{target}: not a tensor of the {table.target} layout for this config",
                    kind="layout_mismatch",
                    path=str(target),
                )
            if (dtype, shape) != want_t:
                raise PlanError(
                    f"{target}: would be {dtype}{list(shape)} but the model expects {want_t[0]}{list(want_t[1])} "
                    f"(sources {pieces[0].name}...)",
                    kind="layout_mismatch",
                    path=str(target),
                )
            out[target] = PlannedTensor(target, dtype, shape, tuple(pieces), rule.op, rule.label)
    missing = sorted(set(layout) - set(out))
    if missing:
        raise PlanError(
            f"{missing[0]}: no rule of table {table.name} v{table.version} produces this parameter ({len(missing)} "
            "missing)",
            kind="missing_source",
            path=str(missing[0]),
        )
    once = {n for r in rules if r.op == "copy" for b in rule_bindings(r, cfg) for n in _source_names(r, b, cfg)}
    twice = sorted(n for n, c in consumed.items() if c > 1 and n not in once)
    if twice:
        raise PlanError(f"tensor {twice[0]} is consumed by more than one rule", kind="plan_failed")
    return _plan("forward", inv, table, table.identity, _write_order(list(out.values())), skipped)


def _plan(
    direction: Direction,
    inv: Inventory,
    table: Table,
    identity: TableIdentity,
    tensors: tuple[PlannedTensor, ...],
    skipped: dict[str, str],
) -> Plan:
    return Plan(
        direction,
        inv.location,
        inv.config,
        inv.model_config,
        identity,
        tensors,
        skipped,
        inv.revision,
        table.config,
        inv.config_bytes,
        drafter_family(inv, table.target, direction),
    )


def plan_reverse(inv: Inventory, table: Table) -> Plan:
    """Reverse: a checkpoint in the table's target layout -> native names (only the tensors
    the draft uses). Fused parameters are split back at the native sizes."""
    cfg = inv.model_config
    if cfg.is_dspark:  # stages are model.layers.{s}, s < S
        _require_stages(inv, cfg, {int(m.group(1)) for key in inv.tensors if (m := TARGET_LAYER.match(key))})
    else:
        cfg.require_draft_blocks(draft_layers_present(cfg, inv.tensors), f"{inv.location}/{CONFIG}")
    layout = require_target(table.target).layout(cfg)
    expected_src = native.draft_layout(cfg, with_emb_head=False)
    out: dict[str, PlannedTensor] = {}
    for key, src in inv.tensors.items():
        if key not in layout:
            raise PlanError(
                f"{src.file}: tensor {key}: not a parameter of the {table.target} layout",
                kind="uncovered_key",
                path=str(src.file),
                tensor=key,
            )
        if (src.dtype, src.shape) != layout[key]:
            raise PlanError(
                f"{src.file}: tensor {key}: {src.dtype}{list(src.shape)} but the model expects "
                f"{layout[key][0]}{list(layout[key][1])}",
                kind="layout_mismatch",
                path=str(src.file),
                tensor=key,
            )
    for rule in table.rules_for(cfg.expert_dtype):
        if rule.target is None:
            continue
        for binding in rule_bindings(rule, cfg):
            target = expand(rule.target, binding)
            fused: TensorBytes | None = inv.tensors.get(target)
            if fused is None:
                raise PlanError(
                    f"{target}: parameter missing from the {table.target} checkpoint",
                    kind="missing_source",
                    path=str(target),
                )
            at = fused.start
            for name in _source_names(rule, binding, cfg):
                dtype, shape = expected_src[name]
                n = nbytes(dtype, shape)
                if name not in out:  # a shared tensor copied into every block comes back once
                    out[name] = PlannedTensor(
                        name,
                        dtype,
                        shape,
                        (TensorBytes(target, fused.file, dtype, shape, at, at + n),),
                        f"split-{rule.op}",
                        rule.label,
                    )
                at += n
            if at != fused.end:
                raise PlanError(
                    f"{fused.file}: tensor {target}: {fused.nbytes} bytes but its native parts add up to "
                    f"{at - fused.start}",
                    kind="layout_mismatch",
                    path=str(fused.file),
                    tensor=target,
                )
    reverse = dataclasses.replace(table.identity, target="native")
    return _plan("reverse", inv, table, reverse, _write_order(list(out.values())), {})
