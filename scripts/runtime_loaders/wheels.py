"""The pinned vLLM and SGLang wheels: where they are cached, fetching them, reading their files."""

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

# the runtime releases the draft target says its layouts were verified against: the wheels
# this script runs (one statement of each version: mapping/targets/draft.toml)
_VERIFIED = dict(require_target(serving_targets()[0]).runtimes)
WHEELS = {"vllm": f"vllm=={_VERIFIED['vLLM']}", "sglang": f"sglang=={_VERIFIED['SGLang']}"}
WHEELS_ENV = "DSV4_WHEELS"  # the wheel cache, where it is not the default one
DEFAULT_WHEELS = Path.home() / ".cache" / "dsv4-convert" / "wheels"


def wheel_cache() -> Path:
    """The wheel cache: $DSV4_WHEELS where it is set, else DEFAULT_WHEELS. The one rule the
    script, scripts/test.sh (through --fetch-wheels) and the tests follow."""
    return Path(os.environ.get(WHEELS_ENV) or DEFAULT_WHEELS)


def wheels_cached(cache: Path) -> bool:
    """Every pinned wheel is in `cache` already."""
    return all(sorted(cache.glob(f"{p}-{pin.split('==')[1]}-*.whl")) for p, pin in WHEELS.items())


def wheel_path(cache: Path, package: str) -> Path:
    """The cached wheel of `package` (WHEELS' pin), downloaded with pip on first use."""
    pin = WHEELS[package]
    version = pin.split("==")[1]
    found = sorted(cache.glob(f"{package}-{version}-*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", pin, "-d", str(cache)]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise UsageError(f"{cache}: pip download --no-deps {pin} failed")
        found = sorted(cache.glob(f"{package}-{version}-*.whl"))
    if not found:
        raise UsageError(f"{cache}: no {package}-{version} wheel after pip download")
    return found[0]


@dataclass
class Wheel:
    path: Path

    @cached_property
    def _zip(self) -> zipfile.ZipFile:  # read the (336 MB) wheel's directory once
        return zipfile.ZipFile(self.path)

    def source(self, member: str) -> str:
        return self._zip.read(member).decode()
