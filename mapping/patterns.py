"""Tensor-name patterns of a mapping table: full names with typed placeholders
(mapping/README.md#placeholders), compiled into anchored regexes and expanded for a binding."""

from __future__ import annotations

import re
from collections.abc import Mapping

# placeholder -> regex of what it matches in a source name. {i}: MTP block, {s}: DSpark
# stage, {e}: routed expert, {j}: main layer; {first} and {last} name stage 0 and stage S-1
# (PINNED: each binds one value, which the planner checks a matched key against).
PLACEHOLDERS = {
    "i": r"\d+",
    "s": r"\d+",
    "first": r"\d+",
    "last": r"\d+",
    "e": r"\d+",
    "j": r"\d+",
    "rest": r"[A-Za-z0-9_.]+",
}
PINNED = {"first", "last"}
DERIVED = {"L": "i"}  # {L} = num_hidden_layers + {i}; needs {i} bound
_FIELD = re.compile(r"\{([^{}]*)\}")


def placeholders(pattern: str) -> list[str]:
    return _FIELD.findall(pattern)


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """Anchored regex for a name pattern; each placeholder becomes a named group and a
    repeated placeholder must match the same text."""
    out, seen, pos = [], set(), 0
    for m in _FIELD.finditer(pattern):
        out.append(re.escape(pattern[pos : m.start()]))
        name = m.group(1)
        out.append(f"(?P={name})" if name in seen else f"(?P<{name}>{PLACEHOLDERS[name]})")
        seen.add(name)
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out) + r"\Z")


def expand(pattern: str, binding: Mapping[str, int | str]) -> str:
    return _FIELD.sub(lambda m: str(binding[m.group(1)]), pattern)


def pin(pattern: str, pins: Mapping[str, int]) -> str:
    """`pattern` with its pinned placeholders ({first}, {last}) replaced by their stage numbers."""
    return _FIELD.sub(lambda m: str(pins[m.group(1)]) if m.group(1) in pins else m.group(0), pattern)
