"""scripts/verify_releases.py: the release ranges its table proves (the table itself is
NOTES.md's, made over every release's wheel; the tests have only the pinned and newest ones)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "verify_releases", Path(__file__).parents[2] / "scripts" / "verify_releases.py"
)
assert _SPEC and _SPEC.loader
vrel = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(vrel)


@pytest.mark.parametrize(
    ("results", "proven"),
    [
        ({"0.20.0": "FAIL", "0.20.1": "pass", "0.21.0": "pass"}, "0.20.1-0.21.0"),  # from after the failure
        ({"0.25.1": "-", "0.26.0": "pass", "0.27.0": "pass"}, "0.26.0-0.27.0"),  # from the first with the loader
        ({"0.26.0": "pass", "0.27.0": "FAIL", "0.28.0": "pass"}, "0.28.0"),  # a gap ends the range
        ({"0.33.0": "pass", "0.34.0": "FAIL"}, None),  # the newest failing proves nothing
    ],
)
def test_a_range_runs_from_after_the_newest_release_not_passing_to_the_newest(
    results: dict[str, str], proven: str | None
) -> None:
    assert vrel.proven(results) == proven
