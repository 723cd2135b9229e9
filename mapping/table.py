"""Loading and validating a mapping table (a TOML file in this folder).

A table is data: `copy`, `rename`, `concat`, `stack`, `skip` and `refuse` sections whose
keys and values are full tensor names with typed placeholders. Loading checks the table
against the native format (model/native.py) and the target layout (the bundled model)
before any checkpoint is read, so a rule that can never fire, or that writes something the
model does not have, is an error at once, not a silent gap at serving time.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from dsv4.mapping.errors import DeadRuleError, DuplicateTargetRuleError, TableError, UnboundPlaceholderError, UnknownOpError, UnknownTargetError
from dsv4.mapping.probe import probe_keys

TABLE_DIR = Path(__file__).parent

# placeholder -> regex of what it matches in a source name
PLACEHOLDERS = {"i": r"\d+", "e": r"\d+", "j": r"\d+", "rest": r"[A-Za-z0-9_.]+"}
DERIVED = {"L": "i"}  # {L} = num_hidden_layers + {i}; needs {i} bound
EXPERT_DTYPES = ("fp4", "fp8")
SECTIONS = {"table", "copy", "rename", "concat", "stack", "skip", "refuse"}
STACK_KEYS = {"to", "cat", "view", "when"}
_FIELD = re.compile(r"\{([^{}]*)\}")


def placeholders(pattern: str) -> list[str]:
    return _FIELD.findall(pattern)


@dataclass(frozen=True)
class Rule:
    """One rule. `op` is copy, rename, concat, stack, skip or refuse. `sources` are
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


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """Anchored regex for a name pattern; each placeholder becomes a named group and a
    repeated placeholder must match the same text."""
    out, seen, pos = [], set(), 0
    for m in _FIELD.finditer(pattern):
        out.append(re.escape(pattern[pos:m.start()]))
        name = m.group(1)
        out.append(f"(?P={name})" if name in seen else f"(?P<{name}>{PLACEHOLDERS[name]})")
        seen.add(name)
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out) + r"\Z")


def expand(pattern: str, binding: Mapping[str, int | str]) -> str:
    return _FIELD.sub(lambda m: str(binding[m.group(1)]), pattern)


@dataclass(frozen=True)
class Table:
    name: str
    version: str
    target: str
    layout: str
    rules: tuple[Rule, ...]
    path: str

    def rules_for(self, expert_dtype: str) -> list[Rule]:
        return [r for r in self.rules if r.applies(expert_dtype)]


def _parse(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], list[Rule]]:
    unknown = set(raw) - SECTIONS
    if unknown:
        raise UnknownOpError(f"{where}: unknown section(s) {sorted(unknown)}; a table has {sorted(SECTIONS)}")
    meta = raw.get("table")
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), str) for k in ("name", "version", "target")):
        raise TableError(f"{where}: [table] needs string name, version and target")
    rules: list[Rule] = []
    for src, dst in raw.get("copy", {}).items():
        rules.append(Rule("copy", (src,), dst))
    for src, dst in raw.get("rename", {}).items():
        rules.append(Rule("rename", (src,), dst))
    for dst, srcs in raw.get("concat", {}).items():
        if not (isinstance(srcs, list) and len(srcs) >= 2):
            raise TableError(f"{where}: [concat] {dst}: needs a list of at least two sources")
        rules.append(Rule("concat", tuple(srcs), dst))
    for entry in raw.get("stack", []):
        extra = set(entry) - STACK_KEYS
        if extra:
            raise UnknownOpError(f"{where}: [[stack]] {entry.get('to')}: unknown key(s) {sorted(extra)}")
        rules.append(Rule("stack", tuple(entry["cat"]), entry["to"], entry.get("view"), entry.get("when")))
    for op in ("skip", "refuse"):
        for src, reason in raw.get(op, {}).items():
            if not isinstance(reason, str) or not reason.strip():
                raise TableError(f"{where}: [{op}] {src}: needs a reason")
            rules.append(Rule(op, (src,), reason=reason))
    for r in rules:
        if not all(isinstance(x, str) for x in (*r.sources, r.target or "")):
            raise TableError(f"{where}: {r.label}: names must be strings")
        if r.when is not None and r.when not in EXPERT_DTYPES:
            raise TableError(f"{where}: {r.label}: when = {r.when!r}; expected one of {EXPERT_DTYPES}")
    return meta, rules


def _check_placeholders(rule: Rule, where: str) -> None:
    bound: set[str] = set()
    for src in rule.sources:
        for ph in placeholders(src):
            if ph not in PLACEHOLDERS:
                raise UnboundPlaceholderError(f"{where}: {rule.label}: unknown placeholder {{{ph}}} in {src}")
            bound.add(ph)
    if "rest" in bound and rule.op not in ("skip", "refuse"):
        raise UnboundPlaceholderError(f"{where}: {rule.label}: {{rest}} is for skip and refuse rules only")
    if rule.op == "stack" and not all("e" in placeholders(s) for s in rule.sources):
        raise UnboundPlaceholderError(f"{where}: {rule.label}: every stacked source needs {{e}}")
    if rule.target is None:
        return
    available = bound - {"e"} if rule.op == "stack" else set(bound)
    if rule.op == "copy":
        available |= {"i"}  # a shared tensor is copied into every MTP block
    for ph in placeholders(rule.target):
        need = DERIVED.get(ph, ph)
        if need not in available:
            raise UnboundPlaceholderError(f"{where}: {rule.label}: target placeholder {{{ph}}} is not bound by its source(s) {list(rule.sources)}")
    if rule.op != "copy":
        unused = (bound - {"e"} if rule.op == "stack" else bound) - {DERIVED.get(p, p) for p in placeholders(rule.target)}
        if unused:
            raise UnboundPlaceholderError(f"{where}: {rule.label}: source placeholder(s) {sorted(unused)} do not appear in the target, so two sources would write one parameter")


def validate(table: Table, native_keys: Mapping[str, set[str]], target_keys: Mapping[str, set[str]], bind_target) -> None:
    """Check the table against what the native format allows (`native_keys[expert_dtype]`)
    and the parameters the model has (`target_keys[expert_dtype]`); `bind_target(pattern)`
    expands a target pattern for the probe configuration."""
    where = table.path
    seen: dict[tuple[str, str], Rule] = {}
    for rule in table.rules:
        _check_placeholders(rule, where)
        if rule.op != "refuse":  # refuse rules describe other formats by design
            allowed = set().union(*(native_keys[d] for d in EXPERT_DTYPES if rule.applies(d)))
            for rx, src in zip(rule.source_regexes, rule.sources):
                if not any(rx.match(k) for k in allowed):
                    raise DeadRuleError(f"{where}: {rule.label}: source pattern {src} matches no tensor the native DeepSeek V4 format has: a dead rule")
        if rule.target is None:
            continue
        for dtype in EXPERT_DTYPES:
            if not rule.applies(dtype):
                continue
            prior = seen.get((rule.target, dtype))
            if prior is not None:
                raise DuplicateTargetRuleError(f"{where}: {rule.label} and {prior.label} both write {rule.target}")
            seen[(rule.target, dtype)] = rule
            for name in bind_target(rule.target):
                if name not in target_keys[dtype]:
                    raise UnknownTargetError(f"{where}: {rule.label}: {name} is not a parameter of the {table.target} layout ({dtype} experts)")


def installed_tables() -> list[str]:
    """The names `load_table` accepts: the tables shipped in this package (mapping/*.toml)."""
    return sorted(p.stem for p in TABLE_DIR.glob("*.toml"))


def load_table(name: str = "xpu") -> Table:
    """Load the installed table `name` (mapping/<name>.toml) and validate it completely.

    A name, never a path: the table a conversion records must be one this tool ships, so
    `check` and a later conversion find the same rules (and "../../x" reads nothing)."""
    installed = installed_tables()
    if name not in installed:
        raise TableError(f"no mapping table {name!r} (installed: {', '.join(installed)}); a table is chosen by name, not path")
    return load_table_file(TABLE_DIR / f"{name}.toml")


def load_table_file(path: Path) -> Table:
    """Load and validate the table file at `path`: for writing and testing a new table
    before it is installed beside xpu.toml. Conversions use `load_table(name)`."""
    if not path.is_file():
        raise TableError(f"{path}: no such mapping table")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TableError(f"{path}: not valid TOML ({exc})") from None
    meta, rules = _parse(raw, path.name)
    table = Table(meta["name"], meta["version"], meta["target"], meta.get("layout", ""), tuple(rules), path.name)
    native_keys, target_keys, bindings = probe_keys()
    validate(table, native_keys, target_keys, lambda pattern: sorted({expand(pattern, b) for b in bindings}))
    return table
