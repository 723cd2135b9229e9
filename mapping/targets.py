"""The target registry: what `--target NAME` is, read from mapping/targets/NAME.toml and the
`[table]` headers of the tables that name it (mapping/README.md#targets).

A target is its name, the runtime versions its layouts were verified against (stated once,
in its file: conversion.json's `runtime`, `targets`, `--version`, check's messages and the
model card all quote them from here), its layout kind, and its tables, one per drafter kind
(their `[table]` headers give each drafter's version and runtime class). The layout kind is
what code knows about a layout (LAYOUT_KINDS): where its tensor list comes from, how it
names a draft block and an FP8 scale's weight, and whether a runtime loads it from disk. Its
`[card]` is the model card `batch --push` uploads: a body template beside the file and, for a
layout runtimes load, the serve commands per runtime and drafter kind. So a runtime bump is one
line of a target file, and a new target with a known layout kind, or a new runtime serving one,
is data: a target file, its card template and its tables, no code.

Reading it costs the small TOML files alone (no validation, no torch: `--help` lists them).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from string import Template
from typing import Any, NamedTuple

from dsv4.mapping.errors import TableError
from dsv4.model import native
from dsv4.model.config import ModelConfig
from dsv4.model.layout import target_layout
from dsv4.model.native import Layout

TABLE_DIR = Path(__file__).parent
TARGET_DIR = TABLE_DIR / "targets"
TARGET_KEYS = {"name", "runtimes", "layout", "default"}
CARD_KEYS = {"body", "library_name", "serve"}
DRAFTER_KEYS = {"name", "title", "kind", "since", "until", "platforms", "note", "refuse"}
DRAFTERS = ("mtp", "dspark")  # the drafter kinds: a table's `drafter`, a serve entry's commands


@dataclass(frozen=True)
class LayoutKind:
    """What follows from a target's layout, for every target that has it. `block` finds a
    draft block's number in a tensor name; an FP8 scale's name ends with `scale_suffix`, its
    weight's is the same stem with `weight_suffix`; `native_names`: the tensors keep the
    checkpoint's own names, which runtimes load from disk as a draft model."""

    provider: Callable[[ModelConfig], Layout]
    block: re.Pattern[str]
    scale_suffix: str
    weight_suffix: str
    native_names: bool


LAYOUT_KINDS = {
    # the bundled draft model's parameters: no runtime reads them from disk (mapping/README.md#versions-and-loaders)
    "bundled": LayoutKind(target_layout, re.compile(r"model\.layers\.(\d+)\."), "_scale_inv", "", False),
    # a standalone draft directory: native names, which vLLM and SGLang load as a draft model
    "native": LayoutKind(native.standalone_draft_layout, re.compile(r"mtp\.(\d+)\."), ".scale", ".weight", True),
}


class TableHeader(NamedTuple):
    """A table's [table] section, as far as choosing and listing tables needs it."""

    target: str
    drafter: str
    version: str
    runtime: str  # its target's runtime versions, e.g. "vLLM 0.33.0"
    runtime_class: str  # the runtime's model class that loads it, e.g. "DeepSeekV4MTP"
    family: str | None = None  # the one drafter family it maps ([[drafter]] name); None: the kind's others


@dataclass(frozen=True)
class ServeCommand:
    """How one runtime serves a draft of this target: its command line per drafter kind, a
    string.Template over $source (the target model's repo) and $repo (the draft's)."""

    runtime: str  # a key of the target's runtimes
    platforms: str  # what the card's comment adds after the runtime's version ("" for none)
    commands: tuple[tuple[str, str], ...]  # (drafter kind, command template)
    launch: str = ""  # what $launch becomes where the draft has a launch overrides file ($overrides)
    routes: tuple[str, ...] | None = None  # the serving routes the command serves (None: every one)
    note: str = ""  # a comment after the command where the draft has a quantisation method ($quantization)

    def command(self, drafter: str) -> str:
        return dict(self.commands)[drafter]


@dataclass(frozen=True)
class Card:
    """A target's model card: the body template's file name (beside the target file), the hub's
    `library_name` (None: no runtime loads the layout) and the serve commands the body quotes."""

    body: str
    library_name: str | None
    serve: tuple[ServeCommand, ...]

    def template(self) -> str:
        """The body template's text (read when a card is made, not at start-up)."""
        return (TARGET_DIR / self.body).read_text(encoding="utf-8")


@dataclass(frozen=True)
class Drafter:
    """One drafter family a checkpoint may hold (a [[drafter]] entry of the target file whose
    runtimes serve drafts: mapping/targets/draft.toml; mapping/drafters.py tells them apart)."""

    name: str
    title: str  # what plan and check call it
    kind: str  # one of DRAFTERS: the table it converts with and the serve command it takes
    since: tuple[tuple[str, str], ...]  # (runtime, oldest release serving it); absent: the verified one only
    platforms: tuple[tuple[str, str], ...]  # (runtime, its platforms) where fewer than the card's
    note: str  # what a user serving it must know ("" for none)
    # why it does not convert yet, a Template over the runtimes: to any target, or (target, why) per target
    refuse: str | tuple[tuple[str, str], ...]
    # (runtime, newest release serving it) where newer than the verified one
    until: tuple[tuple[str, str], ...] = ()

    def releases(self, target: Target, runtime: str) -> str:
        """The releases of `runtime` serving this drafter: "vLLM 0.20.1-0.34.0" (`until`, else
        the version `target` was verified against), or one version alone."""
        version = dict(target.runtimes)[runtime]
        first, last = dict(self.since).get(runtime, version), dict(self.until).get(runtime, version)
        return f"{runtime} {first}-{last}" if first != last else f"{runtime} {last}"

    def refusal(self, target: Target) -> str | None:
        """Why this drafter does not convert to `target` yet (its runtimes' versions filled in),
        None where it converts."""
        why = (self.refuse or None) if isinstance(self.refuse, str) else dict(self.refuse).get(target.name)
        if why is None:
            return None
        try:
            return Template(why).substitute(dict(target.runtimes))
        except (KeyError, ValueError) as exc:  # a runtime the target has not, or a lone $
            raise TableError(
                f"{TARGET_DIR.name}: drafter {self.name!r}: its refusal for {target.name!r} names {exc} "
                f"(it may name ${', $'.join(dict(target.runtimes))})",
                kind="malformed_table",
            ) from None


@dataclass(frozen=True)
class Target:
    """One installed target (mapping/targets/NAME.toml)."""

    name: str
    runtimes: tuple[tuple[str, str], ...]  # (runtime, verified version), in the file's order
    layout_kind: str  # a key of LAYOUT_KINDS
    default: bool
    card: Card
    drafters: tuple[Drafter, ...] = ()  # the families its runtimes serve (a target that serves drafts)

    @property
    def runtime(self) -> str:
        """The runtime versions as conversion.json records them: "vLLM 0.33.0, SGLang 0.5.23"."""
        return ", ".join(f"{name} {version}" for name, version in self.runtimes)

    @property
    def runtimes_said(self) -> str:
        """The runtime versions in a sentence: "vLLM 0.33.0 and SGLang 0.5.23"."""
        return " and ".join(f"{name} {version}" for name, version in self.runtimes)

    def runtime_named(self, name: str) -> str:
        """One runtime with its version ("vLLM 0.33.0"); TableError if the target has none of that name."""
        for runtime, version in self.runtimes:
            if runtime == name:
                return f"{runtime} {version}"
        raise TableError(f"target {self.name!r} names no {name} version", kind="malformed_table")

    @property
    def kind(self) -> LayoutKind:
        return LAYOUT_KINDS[self.layout_kind]

    def layout(self, cfg: ModelConfig) -> Layout:
        """name -> (safetensors dtype, shape) of every tensor a table of this target writes for `cfg`."""
        return self.kind.provider(cfg)

    def weight_of_scale(self, name: str) -> str | None:
        """The weight an FP8 block scale `name` belongs to, in this layout's names (None: not a scale)."""
        kind = self.kind
        return name.removesuffix(kind.scale_suffix) + kind.weight_suffix if name.endswith(kind.scale_suffix) else None

    @property
    def tables(self) -> list[str]:
        """Its installed tables, one per drafter kind."""
        return [name for name, head in _table_headers().items() if head.target == self.name]


def _target_file(path: Path) -> Target:
    where = f"{TARGET_DIR.name}/{path.name}"
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TableError(f"{where}: not valid TOML ({exc})", kind="malformed_table", path=where) from None
    meta = raw.get("target")
    runtimes = meta.get("runtimes") if isinstance(meta, dict) else None
    if not (
        isinstance(meta, dict)
        and {"target", "card"} <= set(raw) <= {"target", "card", "drafter"}
        and set(meta) <= TARGET_KEYS
        and meta.get("name") == path.stem
        and isinstance(runtimes, dict)
        and runtimes
        and all(isinstance(v, str) and v for v in runtimes.values())
        and meta.get("layout") in LAYOUT_KINDS
        and isinstance(meta.get("default", False), bool)
    ):
        raise TableError(
            f'{where}: needs exactly [target] with name = {path.stem!r}, runtimes = {{ RUNTIME = "VERSION", ... }}, '
            f"layout (one of {sorted(LAYOUT_KINDS)}) and optionally default = true; [card]; optionally [[drafter]]",
            kind="malformed_table",
            path=where,
        )
    card = _card(raw["card"], runtimes, where)
    drafters = tuple(_drafter(d, runtimes, where) for d in _entries(raw.get("drafter", []), where))
    return Target(meta["name"], tuple(runtimes.items()), meta["layout"], meta.get("default", False), card, drafters)


def _entries(raw: Any, where: str) -> list[dict[str, Any]]:
    if not (isinstance(raw, list) and all(isinstance(d, dict) for d in raw)):
        raise TableError(f"{where}: [[drafter]] entries are tables", kind="malformed_table", path=where)
    return raw


def _string_map(value: Any, keys: set[str] | None) -> bool:
    return isinstance(value, dict) and all(
        isinstance(v, str) and v and (keys is None or k in keys) for k, v in value.items()
    )


def _drafter(raw: dict[str, Any], runtimes: dict[str, str], where: str) -> Drafter:
    """A [[drafter]] entry: name, title, kind (one of DRAFTERS), optionally since, until and
    platforms (runtime -> text), note, and refuse (target -> why)."""
    if not (
        set(raw) <= DRAFTER_KEYS
        and all(isinstance(raw.get(k), str) and raw[k] for k in ("name", "title"))
        and raw.get("kind") in DRAFTERS
        and isinstance(raw.get("note", ""), str)
        and all(_string_map(raw.get(k, {}), set(runtimes)) for k in ("since", "until", "platforms"))
        and (isinstance(raw.get("refuse"), str) or _string_map(raw.get("refuse", {}), None))
    ):
        raise TableError(
            f"{where}: a [[drafter]] entry needs name, title and kind (one of {', '.join(DRAFTERS)}), optionally "
            f'since, until and platforms ({{ RUNTIME = "..." }}, RUNTIME one of {sorted(runtimes)}), note, and refuse '
            f'("why", or {{ TARGET = "why" }}): {raw.get("name", raw)!r}',
            kind="malformed_table",
            path=where,
        )
    return Drafter(
        raw["name"],
        raw["title"],
        raw["kind"],
        tuple(raw.get("since", {}).items()),
        tuple(raw.get("platforms", {}).items()),
        raw.get("note", ""),
        raw["refuse"] if isinstance(raw.get("refuse"), str) else tuple(raw.get("refuse", {}).items()),
        tuple(raw.get("until", {}).items()),
    )


def _card(raw: Any, runtimes: dict[str, str], where: str) -> Card:
    """[card] of a target file: body = "FILE" beside it, optionally library_name and
    [[card.serve]] entries (runtime, optionally platforms, one command per drafter kind)."""
    serve = raw.get("serve", []) if isinstance(raw, dict) else None
    entry_keys = {"runtime", "platforms", "launch", "routes", "note", *DRAFTERS}
    if not (
        isinstance(raw, dict)
        and set(raw) <= CARD_KEYS
        and isinstance(raw.get("body"), str)
        and (TARGET_DIR / raw["body"]).parent == TARGET_DIR
        and (TARGET_DIR / raw["body"]).is_file()
        and isinstance(raw.get("library_name", ""), str)
        and isinstance(serve, list)
        and all(
            isinstance(s, dict)
            and set(s) <= entry_keys
            and s.get("runtime") in runtimes
            and all(isinstance(s.get(k, ""), str) for k in ("platforms", "launch", "note"))
            and isinstance(s.get("routes", []), list)
            and all(isinstance(r, str) for r in s.get("routes", []))
            and all(isinstance(s.get(d), str) for d in DRAFTERS)
            for s in serve
        )
    ):
        raise TableError(
            f'{where}: [card] needs body = "FILE" (an existing file beside it), optionally library_name, and '
            f"[[card.serve]] entries of runtime (one of {sorted(runtimes)}), optionally platforms, launch, note "
            f"(strings) and routes (a list of strings), and a command for each of {', '.join(DRAFTERS)}",
            kind="malformed_table",
            path=where,
        )
    commands = tuple(
        ServeCommand(
            s["runtime"],
            s.get("platforms", ""),
            tuple((d, s[d]) for d in DRAFTERS),
            s.get("launch", ""),
            tuple(s["routes"]) if "routes" in s else None,
            s.get("note", ""),
        )
        for s in serve
    )
    return Card(raw["body"], raw.get("library_name"), commands)


@cache
def _targets() -> dict[str, Target]:
    return {p.stem: _target_file(p) for p in sorted(TARGET_DIR.glob("*.toml"))}


def installed_tables() -> list[str]:
    """The names `load_table` accepts: the tables shipped in this package (mapping/*.toml)."""
    return sorted(p.stem for p in TABLE_DIR.glob("*.toml"))


@cache
def _table_headers() -> dict[str, TableHeader]:
    """table name -> its header, from the [table] sections alone: no validation, so the
    CLI can list the targets at start-up for the cost of reading a few small files."""
    out = {}
    for name in installed_tables():
        meta = tomllib.loads((TABLE_DIR / f"{name}.toml").read_text()).get("table", {})
        target = _targets().get(meta.get("target"))
        out[name] = TableHeader(
            meta.get("target"),
            meta.get("drafter", "mtp"),
            meta.get("version"),
            target.runtime if target is not None else "",
            meta.get("runtime_class", ""),
            meta.get("family"),
        )
    return out


def table_headers() -> dict[str, TableHeader]:
    """Every installed table's header, by table name (`convert-dsv4 targets`)."""
    return dict(_table_headers())


def installed_targets() -> list[str]:
    """The names `--target` accepts (mapping/targets/*.toml)."""
    return sorted(_targets())


def require_target(target: Any) -> Target:
    """The installed target `target`, or TableError listing the installed targets."""
    found = _targets().get(target) if isinstance(target, str) else None
    if found is None:
        raise TableError(
            f"no target {target!r} (installed: {', '.join(installed_targets())}); a target is chosen by name, not path",
            kind="malformed_table",
        )
    return found


def default_target() -> str:
    """`--target`'s default: the target whose file says `default = true`."""
    (name,) = [t.name for t in _targets().values() if t.default]
    return name


def drafter_families() -> tuple[Target, dict[str, Drafter]]:
    """The target whose runtimes serve drafts (the one whose file lists [[drafter]] entries) and
    its drafter families by name; TableError where a refusal names no installed target."""
    (home,) = [t for t in _targets().values() if t.drafters]
    families = {d.name: d for d in home.drafters}
    for d in home.drafters:
        unknown = sorted(set(() if isinstance(d.refuse, str) else dict(d.refuse)) - set(_targets()))
        if unknown or len(families) != len(home.drafters):
            raise TableError(
                f"{TARGET_DIR.name}/{home.name}.toml: drafter {d.name!r}: "
                + (f"refuse names no installed target {unknown[0]!r}" if unknown else "named twice"),
                kind="malformed_table",
            )
    return home, families


def bundled_target() -> Target:
    """The target whose layout is the bundled model's (what `smoke` and `check` map a
    native-named checkpoint into, in memory)."""
    (target,) = [t for t in _targets().values() if t.layout_kind == "bundled"]
    return target


def serving_targets() -> list[str]:
    """The targets a runtime loads from disk as a draft model (native names)."""
    return [t.name for t in _targets().values() if t.kind.native_names]


def tables_of_target(target: str) -> list[str]:
    """The installed tables of `target`, one per drafter kind."""
    return require_target(target).tables


def table_name_for(target: str, drafter: str, family: str | None = None) -> str:
    """The installed table that maps a `drafter` ("mtp", "dspark") checkpoint of drafter family
    `family` to `target`: the table of that family where one is installed (V4.1's), else the one
    of the kind that names no family."""
    require_target(target)
    of_kind = {n: head for n, head in _table_headers().items() if (head.target, head.drafter) == (target, drafter)}
    names = [n for n, h in of_kind.items() if h.family == family] or [n for n, h in of_kind.items() if h.family is None]
    if len(names) != 1:
        have = ", ".join(f"{n} ({h.target}, {h.drafter})" for n, h in _table_headers().items())
        raise TableError(
            f"target {target!r} has {'no' if not names else 'more than one'} "
            f"table for {drafter} drafters (installed: {have})",
            kind="malformed_table",
        )
    return names[0]


def target_rows() -> list[dict[str, Any]]:
    """`convert-dsv4 targets`: one row per installed table, by target then table name; a
    target serving drafters names, per table, the families it converts and their releases."""
    headers = _table_headers()
    return [
        {
            "target": h.target,
            "table": name,
            "drafter": h.drafter,
            "table_version": h.version,
            "runtime": h.runtime,
            "runtime_class": h.runtime_class,
            "family": h.family,  # the one drafter family the table maps (null: its kind's others)
            **({"families": fams} if (fams := _table_families(h, headers)) else {}),
        }
        for name, h in sorted(headers.items(), key=lambda item: (item[1].target, item[0]))
    ]


def _table_families(h: TableHeader, headers: dict[str, TableHeader]) -> dict[str, str]:
    """The drafter families table `h` converts (its own family where it names one, else those of its kind
    no table of their own maps) that its target serves, with the runtime releases serving each one's
    draft ("vLLM 0.20.0-0.34.0, SGLang 0.5.12-0.5.23": Drafter.releases)."""
    own = {o.family for o in headers.values() if (o.target, o.drafter) == (h.target, h.drafter) and o.family}
    target = require_target(h.target)
    return {
        d.name: ", ".join(d.releases(target, runtime) for runtime, _ in target.runtimes)
        for d in target.drafters
        if d.kind == h.drafter and d.refusal(target) is None and (d.name == h.family if h.family else d.name not in own)
    }


def runtimes_by_target() -> dict[str, str]:
    """`--version`: each installed target's runtime versions."""
    return {name: target.runtime for name, target in sorted(_targets().items())}
