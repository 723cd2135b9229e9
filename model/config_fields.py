"""The checks of one config.json field each (model/config.py's validator and the V4.1
flattening, model/config_v41.py, share them): its JSON type, range and the one-line refusal
naming the file and the field (malformed_config, exit 18; unsupported_layout, 35)."""

from __future__ import annotations

import json
import math
import reprlib
from typing import Any

from dsv4.model.errors import CheckpointError

_SHORT = reprlib.Repr()  # values in messages stay short, however large the JSON value
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 40
_SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxlevel = 4, 4, 3, 2


def malformed(where: str, field: str | None, message: str) -> CheckpointError:
    """A field missing, of the wrong type, out of range or contradicting another (exit 18): one
    line headed by the file, `field` kept for a program to read (DSV4Error.fields)."""
    return CheckpointError(f"{where}: {message}", kind="malformed_config", path=where, field=field)


def unsupported(where: str, field: str, message: str) -> CheckpointError:
    """A well-formed value this tool has no layout for (exit 35), headed by the file."""
    return CheckpointError(f"{where}: {message}", kind="unsupported_layout", path=where, field=field)


def describe(value: Any) -> str:
    """A value as an error message shows it: in JSON spelling, short however large it is,
    with its JSON kind where that is the fault."""
    kind = {
        bool: "a boolean",
        str: "a string",
        list: "a list",
        tuple: "a list",
        dict: "an object",
        type(None): "null",
    }.get(type(value))
    if value is None:
        return "null"
    if type(value) in (bool, str):
        shown = json.dumps(value[:41] if type(value) is str else value)
        shown = shown[:40] + '..."' if len(shown) > 42 else shown
    else:
        shown = _SHORT.repr(value)
    return f"{shown} ({kind})" if kind else shown


def check_int(where: str, field: str, value: Any, low: int, high: int) -> None:
    # bool is a subclass of int in Python; in config.json `true` is not a count
    if type(value) is not int:
        raise malformed(where, field, f"{field} is {describe(value)}; expected an integer in {low}..{high}")
    if not low <= value <= high:
        raise malformed(where, field, f"{field} is {value}; expected an integer in {low}..{high}")


def check_positive_float(
    where: str, field: str, value: Any, *, zero_ok: bool = False, below: float | None = None
) -> None:
    # a JSON integer is a number too (rope_theta is 10000 in the release); one past 2^63 would
    # overflow the float math that uses it
    number = (type(value) is int and abs(value) < 2**63) or (type(value) is float and math.isfinite(value))
    ok = number and (value >= 0 if zero_ok else value > 0) and (below is None or value < below)
    if not ok:
        want = f"a finite number {'>= 0' if zero_ok else '> 0'}" + (f" and < {below:g}" if below is not None else "")
        raise malformed(where, field, f"{field} is {describe(value)}; expected {want}")


def check_int_list(where: str, field: str, value: Any, low: int, high: int, lengths: range) -> None:
    """A JSON list of integers (held as a tuple), its length in `lengths`."""
    if type(value) is not tuple:
        raise malformed(where, field, f"{field} is {describe(value)}; expected a list of integers in {low}..{high}")
    if len(value) not in lengths:
        want = f"{lengths.start}..{lengths.stop - 1}" if len(lengths) > 1 else f"exactly {lengths.start}"
        raise malformed(
            where, field, f"{field} has {len(value)} entr{'y' if len(value) == 1 else 'ies'}; expected {want}"
        )
    for k, item in enumerate(value):
        check_int(where, f"{field}[{k}]", item, low, high)


def require_object(where: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise malformed(where, None, f"the top level is {describe(value)}; expected a JSON object")
