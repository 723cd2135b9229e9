"""Importing torch under an address-space limit (`ulimit -v`, a batch scheduler's memory cap).

Loading torch maps its shared libraries (about 450 MiB for the CPU build, several GiB for a
CUDA one) before any Python code of ours can react; below that, the import dies inside C:
OpenBLAS prints its own line and calls exit(1), glibc aborts for lack of thread-local
storage. No handler runs, so the commands that need torch check the limit first and
refuse in one line (OutOfMemoryError) when it cannot even hold torch's libraries.
"""

from __future__ import annotations

import importlib.util
import resource
from pathlib import Path

from dsv4.model.errors import OutOfMemoryError

MiB = 1 << 20
# beyond torch's libraries: the interpreter, torch's Python modules and first allocations
# (torch 2.13 CPU: 624 MiB of address space at import, with 447 MiB of libraries)
IMPORT_HEADROOM = 256 * MiB


def torch_libraries_bytes() -> int:
    """The size of the shared libraries torch loads at import, found without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return 0
    return sum(f.stat().st_size for f in (Path(spec.origin).parent / "lib").glob("*.so*") if f.is_file())


def refuse_unless_torch_fits(what: str) -> None:
    """OutOfMemoryError when the address-space limit cannot hold torch's libraries and the
    import's headroom, so `what` (a command) would die inside the import."""
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit == resource.RLIM_INFINITY:
        return
    libraries = torch_libraries_bytes()
    if limit < libraries + IMPORT_HEADROOM:
        raise OutOfMemoryError(
            f"{what}: not enough memory: the address-space limit (ulimit -v) is {limit // MiB:,} MiB, "
            f"and loading torch alone needs more than {(libraries + IMPORT_HEADROOM) // MiB:,} MiB "
            f"(its libraries are {libraries // MiB:,} MiB); raise the limit"
        )
