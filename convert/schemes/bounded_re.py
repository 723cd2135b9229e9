"""Untrusted regular expressions (a serving target's `re:` entries) matched against the draft's
names in bounded time.

Python's `re` holds the GIL and cannot be interrupted, so a pattern with nested quantifiers can
run for hours on a 60-character name. The matching runs in a short-lived child process that
reports which pattern it is on; the parent waits at most `SECONDS` and, past that, kills the
child and refuses the pattern it was on, naming its field. Only the few hundred draft names
are ever matched, so an honest pattern answers in microseconds.
"""

from __future__ import annotations

import functools
import multiprocessing
import re
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

from dsv4.convert.schemes.base import ErrorFactory

SECONDS = 1.0  # the whole table's budget: honest patterns on the draft's names take microseconds
MAX_PATTERN = 1000  # characters; a layer-name pattern is tens of characters long


def _match_all(patterns: Sequence[str], names: Sequence[str], out: Connection) -> None:
    """The child: for each pattern in turn, say which one it is on, then which names it
    matches (re.match, anchored at the start, as vLLM's is_equal_or_regex_match does)."""
    for i, pattern in enumerate(patterns):
        out.send(i)
        compiled = re.compile(pattern)
        out.send([k for k, name in enumerate(names) if compiled.match(name)])
    out.close()


def _context() -> multiprocessing.context.BaseContext:
    # fork starts in milliseconds and needs nothing re-imported; spawn where fork is absent
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def match_table(
    patterns: Sequence[tuple[str, str]], names: Sequence[str], where: str, error: ErrorFactory
) -> dict[str, frozenset[str]]:
    """For each (field, pattern) the names `re.match(pattern, name)` matches. A pattern over
    `MAX_PATTERN` characters, one that does not compile, or one the child is still on after
    `SECONDS` is refused naming its field."""
    unique: dict[str, str] = {}
    for field, pattern in patterns:
        if len(pattern) > MAX_PATTERN:
            raise error(
                f"{where}: {field} is a {len(pattern)}-character regular expression (at most {MAX_PATTERN} are read)",
                path=where,
                field=field,
            )
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as exc:
            raise error(f"{where}: {field} is not a regular expression: {exc}", path=where, field=field) from None
        unique.setdefault(pattern, field)
    if not unique:
        return {}
    try:
        return dict(zip(unique, _run(tuple(unique), tuple(names)), strict=True))
    except _TooSlow as slow:
        field = unique[slow.pattern]
        raise error(
            f"{where}: {field} took more than {SECONDS:g} s to match the draft's {len(names)} layer names "
            "(a regular expression that backtracks without bound); refused",
            path=where,
            field=field,
        ) from None


class _TooSlow(Exception):
    def __init__(self, pattern: str) -> None:
        self.pattern = pattern


@functools.lru_cache(maxsize=64)  # one plan asks about the same patterns for each route's config
def _run(patterns: tuple[str, ...], names: tuple[str, ...]) -> tuple[frozenset[str], ...]:
    receive, send = _context().Pipe(duplex=False)
    child = _context().Process(target=_match_all, args=(patterns, names, send), daemon=True)
    child.start()
    send.close()
    table: list[frozenset[str]] = []
    on = 0
    start = time.monotonic()
    try:
        while len(table) < len(patterns):
            left = SECONDS - (time.monotonic() - start)
            if left <= 0 or not receive.poll(left):
                raise _TooSlow(patterns[on])
            message = receive.recv()
            if isinstance(message, int):
                on = message
            else:
                table.append(frozenset(names[k] for k in message))
    except EOFError:
        raise _TooSlow(patterns[on]) from None  # the child died on it (out of memory)
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()
    return tuple(table)
