"""Loading and validating a mapping table (a TOML file in this folder).

A table is data: `copy`, `rename`, `keep`, `concat`, `stack`, `skip` and `refuse` sections
whose keys and values are full tensor names with typed placeholders. Loading checks the
table against the native format (model/native.py) and its target's layout (the target
registry, mapping/targets.py: the bundled model for `xpu`, the native draft directory for
`draft`) before any checkpoint is read, so a rule that can never fire, or that writes
something the model does not have, is an error at once, not a silent gap at serving time.

Rules several tables share (one V4 block: mapping/include/v4_block.toml) are written once
and pulled in by `[[include]]` with a source and a target prefix. A target (`--target xpu`)
may have one table per drafter kind (`[table] drafter`: "mtp" or "dspark"); the planner picks
the one the checkpoint is (convert/plan.py).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from dsv4.mapping.errors import TableError
from dsv4.mapping.patterns import DERIVED, PINNED, PLACEHOLDERS, compile_pattern, expand, pin, placeholders
from dsv4.mapping.probe import draft_bindings, probe_keys, stage_binding
from dsv4.mapping.targets import DRAFTERS, TABLE_DIR, drafter_families, installed_tables, require_target
from dsv4.model.config import ModelConfig
from dsv4.model.record import TableIdentity
from dsv4.model.storage import expert_dtypes  # what a rule's `when` may name: one storage each

INCLUDE_DIR = TABLE_DIR / "include"

# the block placeholders a table of each drafter kind binds (the other kind's are unbound)
DRAFTER_PLACEHOLDERS = {"mtp": {"i", "L"}, "dspark": {"s", "first", "last"}}
SECTIONS = {"table", "include", "copy", "rename", "keep", "concat", "stack", "skip", "refuse"}
INCLUDE_SECTIONS = {"rename", "keep", "concat", "stack", "skip", "refuse"}  # an include has no [table] of its own
INCLUDE_KEYS = {"file", "source", "target"}
STACK_KEYS = {"to", "cat", "view", "when"}
KEEP_KEYS = {"names"}
# what config.json of an output is: the source's with the dsv4_convert record (and a
# compressed-tensors config renamed to the layout's modules), or the source's bytes unchanged
CONFIG_KINDS = ("record", "source")


@dataclass(frozen=True)
class Rule:
    """One rule. `op` is copy, rename, keep, concat, stack, skip or refuse. `sources` are
    native name patterns (in concatenation order), `target` the parameter pattern
    (None for skip/refuse), `reason` why a key is skipped or refused."""

    op: str
    sources: tuple[str, ...]
    target: str | None = None
    view: str | None = None
    when: str | None = None  # expert_dtype this rule applies to; None = always
    reason: str | None = None

    @property
    def label(self) -> str:
        """How error messages and plans name this rule."""
        return f"[{self.op}] {self.target or self.sources[0]}"

    @cached_property
    def source_regexes(self) -> tuple[re.Pattern[str], ...]:
        return tuple(compile_pattern(p) for p in self.sources)

    def applies(self, expert_dtype: str) -> bool:
        return self.when is None or self.when == expert_dtype


@dataclass(frozen=True)
class Table:
    name: str
    version: str
    target: str
    layout: str
    rules: tuple[Rule, ...]
    path: str
    drafter: str = "mtp"  # the draft model kind this table maps to (DRAFTERS)
    runtime: str = ""  # its target's runtime versions (mapping/targets/TARGET.toml), e.g. "vLLM 0.33.0"
    runtime_class: str = ""  # the runtime's draft model class(es) that read it
    config: str = "record"  # CONFIG_KINDS: what the output's config.json is
    family: str | None = None  # the one drafter family it maps (mapping/targets/draft.toml [[drafter]]), or any

    def rules_for(self, expert_dtype: str) -> list[Rule]:
        return [r for r in self.rules if r.applies(expert_dtype)]

    @property
    def identity(self) -> TableIdentity:
        """What an output records of the table that made it (conversion.json, plan --json)."""
        return TableIdentity(self.name, self.version, self.target, self.drafter, self.runtime, self.runtime_class)


def _parse(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], list[Rule]]:
    unknown = set(raw) - SECTIONS
    if unknown:
        raise TableError(
            f"{where}: unknown section(s) {sorted(unknown)}; a table has {sorted(SECTIONS)}",
            kind="unknown_op",
            path=str(where),
        )
    meta = raw.get("table")
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), str) for k in ("name", "version", "target")):
        raise TableError(
            f"{where}: [table] needs string name, version and target", kind="malformed_table", path=str(where)
        )
    if meta.get("drafter", "mtp") not in DRAFTERS:
        raise TableError(
            f"{where}: [table] drafter = {meta.get('drafter')!r}; expected one of {DRAFTERS}",
            kind="malformed_table",
            path=str(where),
        )
    if meta.get("config", "record") not in CONFIG_KINDS:
        raise TableError(
            f"{where}: [table] config = {meta.get('config')!r}; expected one of {CONFIG_KINDS}",
            kind="malformed_table",
            path=str(where),
        )
    if "runtime" in meta:
        raise TableError(
            f"{where}: [table] runtime: the runtime versions are the target's, stated once in "
            f"mapping/targets/{meta['target']}.toml",
            kind="malformed_table",
            path=str(where),
        )
    if "family" in meta and meta["family"] not in drafter_families()[1]:
        raise TableError(
            f"{where}: [table] family = {meta['family']!r}; expected a drafter family of "
            f"mapping/targets/ ({', '.join(drafter_families()[1])})",
            kind="malformed_table",
            path=str(where),
        )
    for key in ("layout", "runtime_class"):
        if not isinstance(meta.get(key, ""), str):
            raise TableError(f"{where}: [table] {key} must be a string", kind="malformed_table", path=str(where))
    rules = _parse_rules(raw, where)
    for entry in raw.get("include", []):
        rules.extend(_included_rules(entry, where))
    return meta, rules


def _included_rules(entry: Any, where: str) -> list[Rule]:
    """The rules of include file `entry["file"]` (a name in mapping/include/, never a path),
    their source names prefixed with `entry["source"]` and targets with `entry["target"]`."""
    if not isinstance(entry, dict) or set(entry) != INCLUDE_KEYS or not all(isinstance(v, str) for v in entry.values()):
        raise TableError(
            f"{where}: [[include]] needs exactly the strings {sorted(INCLUDE_KEYS)}",
            kind="malformed_table",
            path=str(where),
        )
    installed = sorted(p.stem for p in INCLUDE_DIR.glob("*.toml"))
    if entry["file"] not in installed:
        raise TableError(
            f"{where}: [[include]] file {entry['file']!r} is not an installed "
            f"include (installed: {', '.join(installed)}); named, not a path",
            kind="malformed_table",
            path=str(where),
        )
    path = INCLUDE_DIR / f"{entry['file']}.toml"
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TableError(f"{path}: not valid TOML ({exc})", kind="malformed_table", path=str(path)) from None
    unknown = set(raw) - INCLUDE_SECTIONS
    if unknown:
        raise TableError(
            f"{path.name}: unknown section(s) {sorted(unknown)}; an include has {sorted(INCLUDE_SECTIONS)}",
            kind="unknown_op",
            path=str(path.name),
        )
    return _parse_rules(raw, f"{where} (include {path.name})", entry["source"], entry["target"])


def _parse_rules(raw: dict[str, Any], where: str, src: str = "", dst: str = "") -> list[Rule]:
    """The rules of the op sections of `raw`, source names prefixed with `src` and target
    names with `dst` (an include's prefixes; empty for a table's own rules)."""

    def names(value: Any, prefix: str) -> Any:
        # a non-string stays as it is for the type check below to name
        return prefix + value if isinstance(value, str) else value

    rules: list[Rule] = []
    for s, d in raw.get("copy", {}).items():
        rules.append(Rule("copy", (names(s, src),), names(d, dst)))
    for s, d in raw.get("rename", {}).items():
        rules.append(Rule("rename", (names(s, src),), names(d, dst)))
    keep = raw.get("keep", {})
    if keep:
        if not isinstance(keep, dict) or set(keep) != KEEP_KEYS or not isinstance(keep["names"], list):
            raise TableError(
                f"{where}: [keep] needs exactly names = [a list of tensor names]",
                kind="malformed_table",
                path=str(where),
            )
        if src != dst:  # a kept tensor keeps its name: an include's two prefixes must agree
            raise TableError(
                f"{where}: [keep] in an include whose source prefix {src!r} is "
                f"not its target prefix {dst!r}: a kept tensor keeps its name",
                kind="malformed_table",
                path=str(where),
            )
        rules.extend(Rule("keep", (names(n, src),), names(n, src)) for n in keep["names"])
    for d, srcs in raw.get("concat", {}).items():
        if not (isinstance(srcs, list) and len(srcs) >= 2):
            raise TableError(
                f"{where}: [concat] {d}: needs a list of at least two sources", kind="malformed_table", path=str(where)
            )
        rules.append(Rule("concat", tuple(names(x, src) for x in srcs), names(d, dst)))
    for entry in raw.get("stack", []):
        extra = set(entry) - STACK_KEYS
        if extra:
            raise TableError(
                f"{where}: [[stack]] {entry.get('to')}: unknown key(s) {sorted(extra)}",
                kind="unknown_op",
                path=str(where),
            )
        rules.append(
            Rule(
                "stack",
                tuple(names(x, src) for x in entry["cat"]),
                names(entry["to"], dst),
                entry.get("view"),
                entry.get("when"),
            )
        )
    for op in ("skip", "refuse"):
        for s, reason in raw.get(op, {}).items():
            if not isinstance(reason, str) or not reason.strip():
                raise TableError(f"{where}: [{op}] {s}: needs a reason", kind="malformed_table", path=str(where))
            rules.append(Rule(op, (names(s, src),), reason=reason))
    for r in rules:
        if not all(isinstance(x, str) for x in (*r.sources, r.target or "")):
            raise TableError(f"{where}: {r.label}: names must be strings", kind="malformed_table", path=str(where))
        if r.when is not None and r.when not in expert_dtypes():
            raise TableError(
                f"{where}: {r.label}: when = {r.when!r}; expected one of {expert_dtypes()}",
                kind="malformed_table",
                path=str(where),
            )
    return rules


def _check_placeholders(rule: Rule, where: str) -> None:
    bound: set[str] = set()
    for src in rule.sources:
        for ph in placeholders(src):
            if ph not in PLACEHOLDERS:
                raise TableError(
                    f"{where}: {rule.label}: unknown placeholder {{{ph}}} in {src}",
                    kind="unbound_placeholder",
                    path=str(where),
                )
            bound.add(ph)
    if "rest" in bound and rule.op not in ("skip", "refuse"):
        raise TableError(
            f"{where}: {rule.label}: {{rest}} is for skip and refuse rules only",
            kind="unbound_placeholder",
            path=str(where),
        )
    if rule.op == "stack" and not all("e" in placeholders(s) for s in rule.sources):
        raise TableError(
            f"{where}: {rule.label}: every stacked source needs {{e}}", kind="unbound_placeholder", path=str(where)
        )
    if rule.target is None:
        return
    available = bound - {"e"} if rule.op == "stack" else set(bound)
    if rule.op == "copy":
        available |= {"i"}  # a shared tensor is copied into every MTP block
    for ph in placeholders(rule.target):
        need = DERIVED.get(ph, ph)
        if need not in available:
            raise TableError(
                f"{where}: {rule.label}: target placeholder {{{ph}}} "
                f"is not bound by its source(s) {list(rule.sources)}",
                kind="unbound_placeholder",
                path=str(where),
            )
    if rule.op != "copy":
        # a pinned placeholder ({first}, {last}) binds one stage: it may name no target part
        unused = (
            (bound - {"e"} if rule.op == "stack" else bound)
            - PINNED
            - {DERIVED.get(p, p) for p in placeholders(rule.target)}
        )
        if unused:
            raise TableError(
                f"{where}: {rule.label}: source placeholder(s) {sorted(unused)} do "
                "not appear in the target, so two sources would write one parameter",
                kind="unbound_placeholder",
                path=str(where),
            )


def rule_bindings(rule: Rule, cfg: ModelConfig) -> list[dict[str, int]]:
    """The values a rule's placeholders take for `cfg`: one binding per draft block for a
    per-block rule ({i}, {L}, {s}), one for a rule naming the first or last stage, one empty
    binding for fixed names; each times every expert {e} when the rule moves one tensor per
    expert (a stack binds {e} itself, inside one parameter)."""
    used = {ph for pattern in (*rule.sources, rule.target or "") for ph in placeholders(pattern)}
    if used & {"i", "L", "s"}:
        out = draft_bindings(cfg)
    elif used & PINNED:
        out = [stage_binding(cfg)]
    else:
        out = [{}]
    if "e" in used and rule.op != "stack":
        out = [{**b, "e": e} for b in out for e in range(cfg.draft_routed_experts)]
    return out


def validate(
    table: Table,
    native_keys: Mapping[str, set[str]],
    target_keys: Mapping[str, set[str]],
    bind_target: Callable[[Rule, str], list[str]],
    pins: Mapping[str, int],
) -> None:
    """Check the table against what the native format allows (`native_keys[expert_dtype]`)
    and the parameters its target's layout has (`target_keys[expert_dtype]`);
    `bind_target(rule, expert_dtype)` expands a rule's target for the probe configuration,
    and `pins` are its {first} and {last} stages (so a rule naming a tensor of the wrong
    stage is dead)."""
    where = table.path
    seen: dict[tuple[str, str], Rule] = {}
    foreign = set().union(*DRAFTER_PLACEHOLDERS.values()) - DRAFTER_PLACEHOLDERS[table.drafter]
    for rule in table.rules:
        _check_placeholders(rule, where)
        wrong = sorted({ph for p in (*rule.sources, rule.target or "") for ph in placeholders(p)} & foreign)
        if wrong:
            raise TableError(
                f"{where}: {rule.label}: placeholder {{{wrong[0]}}} belongs to the other drafter kind; "
                f"a {table.drafter} table binds {sorted(DRAFTER_PLACEHOLDERS[table.drafter])}",
                kind="unbound_placeholder",
                path=str(where),
            )
        applies = [d for d in native_keys if rule.applies(d)]
        if rule.op != "refuse" and applies:  # refuse rules describe other formats by design
            allowed = set().union(*(native_keys[d] for d in applies))
            for src in rule.sources:
                rx = compile_pattern(pin(src, pins))
                if not any(rx.match(k) for k in allowed):
                    raise TableError(
                        f"{where}: {rule.label}: source pattern {src} matches no "
                        "tensor the native DeepSeek V4 format has: a dead rule",
                        kind="dead_rule",
                        path=str(where),
                    )
        if rule.target is None:
            continue
        for dtype in target_keys:  # the probe's expert dtypes
            if not rule.applies(dtype):
                continue
            prior = seen.get((rule.target, dtype))
            if prior is not None:
                raise TableError(
                    f"{where}: {rule.label} and {prior.label} both write {rule.target}",
                    kind="duplicate_target_rule",
                    path=str(where),
                )
            seen[(rule.target, dtype)] = rule
            for name in bind_target(rule, dtype):
                if name not in target_keys[dtype]:
                    raise TableError(
                        f"{where}: {rule.label}: {name} is not a parameter "
                        f"of the {table.target} layout ({dtype} experts)",
                        kind="unknown_target",
                        path=str(where),
                    )


def load_table(name: str = "xpu") -> Table:
    """Load the installed table `name` (mapping/<name>.toml) and validate it completely.

    A name, never a path: the table a conversion records must be one this tool ships, so
    `check` and a later conversion find the same rules (and "../../x" reads nothing)."""
    installed = installed_tables()
    if name not in installed:
        raise TableError(
            f"no mapping table {name!r} (installed: {', '.join(installed)}); a table is chosen by name, not path",
            kind="malformed_table",
        )
    return load_table_file(TABLE_DIR / f"{name}.toml")


def load_table_file(path: Path) -> Table:
    """Load and validate the table file at `path`: for writing and testing a new table
    before it is installed beside xpu.toml. Conversions use `load_table(name)`."""
    if not path.is_file():
        raise TableError(f"{path}: no such mapping table", kind="malformed_table", path=str(path))
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TableError(f"{path}: not valid TOML ({exc})", kind="malformed_table", path=str(path)) from None
    meta, rules = _parse(raw, path.name)
    runtime = require_target(meta["target"]).runtime
    table = Table(
        meta["name"],
        meta["version"],
        meta["target"],
        meta.get("layout", "").replace("{runtime}", runtime),  # a description may quote the target's runtime
        tuple(rules),
        path.name,
        meta.get("drafter", "mtp"),
        runtime,
        meta.get("runtime_class", ""),
        meta.get("config", "record"),
        meta.get("family"),
    )
    native_keys, target_keys, cfgs, pins = probe_keys(table.drafter, table.target, table.family)
    validate(
        table,
        native_keys,
        target_keys,
        lambda rule, dtype: sorted({expand(rule.target or "", b) for b in rule_bindings(rule, cfgs[dtype])}),
        pins,
    )
    return table
