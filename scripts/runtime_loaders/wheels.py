"""The vLLM and SGLang wheels: where they are cached, fetching them, reading their files."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from dsv4.mapping.targets import require_target, serving_targets

from . import UsageError
from .releases import release

# the runtime releases the draft target says its layouts were verified against: the wheels
# this script runs unless told another release (one statement of each version:
# mapping/targets/draft.toml)
_DRAFT = require_target(serving_targets()[0])
_VERIFIED = dict(_DRAFT.runtimes)
PINNED = {"vllm": _VERIFIED["vLLM"], "sglang": _VERIFIED["SGLang"]}
WHEELS = {package: f"{package}=={version}" for package, version in PINNED.items()}
# the newest release of each runtime a drafter family's range claims (its `until`, else the
# pinned one): the test command fetches it too, and the tests run its loaders beside the pinned
_PACKAGES = {"vLLM": "vllm", "SGLang": "sglang"}
NEWEST = {
    _PACKAGES[runtime]: max(
        (version, *(dict(d.until)[runtime] for d in _DRAFT.drafters if runtime in dict(d.until))), key=release
    )
    for runtime, version in _DRAFT.runtimes
}
WHEELS_ENV = "DSV4_WHEELS"  # the wheel cache, where it is not the default one
DEFAULT_WHEELS = Path.home() / ".cache" / "dsv4-convert" / "wheels"


def wheel_cache() -> Path:
    """The wheel cache: $DSV4_WHEELS where it is set, else DEFAULT_WHEELS. The one rule the
    script, scripts/test.sh (through --fetch-wheels) and the tests follow."""
    return Path(os.environ.get(WHEELS_ENV) or DEFAULT_WHEELS)


def _cached(cache: Path, package: str, version: str) -> list[Path]:
    # a release's wheel, with or without a build tag (vllm-0.20.1-1-cp38-abi3-...whl)
    return sorted(cache.glob(f"{package}-{version}-*.whl"))


def wheels_cached(cache: Path, versions: dict[str, str] | None = None) -> bool:
    """Every wheel of `versions` (package -> release; default PINNED) is in `cache` already."""
    return all(_cached(cache, p, v) for p, v in (versions or PINNED).items())


def wheel_path(cache: Path, package: str, version: str | None = None) -> Path:
    """The cached wheel of `package` at `version` (default its PINNED release), downloaded
    with pip on first use."""
    version = version or PINNED[package]
    found = _cached(cache, package, version)
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        pin = f"{package}=={version}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", pin, "-d", str(cache)]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise UsageError(f"{cache}: pip download --no-deps {pin} failed")
        found = _cached(cache, package, version)
    if not found:
        raise UsageError(f"{cache}: no {package}-{version} wheel after pip download")
    return found[0]


def fetch_wheels(cache: Path, versions: dict[str, str]) -> list[Path]:
    """`--fetch-wheels`: the wheels of `versions` (package -> release) where they differ from
    PINNED, else the pinned ones and NEWEST's, in `cache` (downloaded where missing)."""
    wanted = [versions] if versions != PINNED else [PINNED, NEWEST]
    return [wheel_path(cache, p, v) for p, v in sorted({(p, v) for vs in wanted for p, v in vs.items()})]


@dataclass
class Wheel:
    path: Path

    @property
    def version(self) -> str:
        """The release, from the wheel's file name (PEP 427: name-version[-build]-...)."""
        return self.path.name.split("-")[1]

    @cached_property
    def _zip(self) -> zipfile.ZipFile:  # read the (336 MB) wheel's directory once
        return zipfile.ZipFile(self.path)

    def source(self, member: str) -> str:
        return self._zip.read(member).decode()
