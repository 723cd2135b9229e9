"""The one rule for an output shard size: `--max-shard-size` on the command line and
`options.max_shard_size` in a batch manifest both go through `shard_size`, so the same
value gets the same verdict (and the same reason) in both places."""

from __future__ import annotations

import re
from fractions import Fraction

# Shard byte offsets are 64-bit (safetensors) and TOML integers are signed 64-bit: a larger
# "size" is a typo or an overflow, never a shard.
MAX_SHARD_SIZE = 2**63 - 1
UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
# Hand-written rather than a library: huggingface_hub's parser is private and turns "infGB"
# into an OverflowError; float() would accept inf/nan and round. A number is decimal digits
# with an optional fraction and a short exponent, then an optional unit and "B"; the whole
# text is bounded so no input makes big-integer arithmetic slow.
_SIZE = re.compile(
    r"(?P<sign>[+-]?)(?P<whole>\d*)(?:\.(?P<frac>\d*))?(?:E(?P<exp>[+-]?\d{1,3}))?\s*(?P<unit>[KMGT]I?)?B?"
)
_MAX_TEXT = 40
EXAMPLES = "5GB, 500MB, 2GiB or 1000000"


def shard_size(value: str | int) -> int:
    """Bytes per output shard from `value` (an integer, or text such as "5GB", "2GiB",
    "1.5GB", "1000000"): a whole, positive number of bytes up to MAX_SHARD_SIZE. Raises
    ValueError with a one-line reason otherwise (0, -1, "infGB", "nanGB", "1e400", "1.5")."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not a size like {EXAMPLES}")
    if isinstance(value, str):
        text = value.strip().upper()
        m = _SIZE.fullmatch(text) if len(text) <= _MAX_TEXT else None
        if m is None or not (m["whole"] or m["frac"]):
            raise ValueError(f"{value!r} is not a size like {EXAMPLES}")
        frac = m["frac"] or ""
        size = (
            Fraction(int(m["whole"] + frac or "0"), 10 ** len(frac))
            * Fraction(10) ** int(m["exp"] or 0)
            * UNITS[m["unit"] or ""]
        )
        if size.denominator != 1:
            raise ValueError(f"{value!r} is not a whole number of bytes")
        number = -int(size) if m["sign"] == "-" else int(size)
    else:
        number = value
    if number <= 0:
        raise ValueError(f"{value!r} is not a positive size (a shard holds at least one byte)")
    if number > MAX_SHARD_SIZE:
        raise ValueError(f"{value!r} is larger than any shard can be (at most {MAX_SHARD_SIZE:,} bytes)")
    return number
