"""Shared test set-up. Triton kernels run in the interpreter on machines without a GPU."""

import os

import torch

if not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from dsv4.convert.pipeline import convert  # noqa: E402
from dsv4.convert.synth import write_checkpoint  # noqa: E402
from dsv4.mapping.table import TABLE_DIR  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def layout_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target layouts model/layout.py caches go to this session's own directory (child
    processes inherit it), never to the user's cache."""
    path = tmp_path_factory.mktemp("xdg-cache")
    os.environ["XDG_CACHE_HOME"] = str(path)
    return path / "dsv4-convert"


@pytest.fixture(scope="session")
def tiny_native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny instruct (FP4 experts) native checkpoint with all its main layers."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "native", preset="tiny", main_layers="all", seed=0)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny instruct native checkpoint without main layers, and its XPU conversion: the
    model and smoke tests read both, neither writes."""
    root = tmp_path_factory.mktemp("tiny-pair")
    native = write_checkpoint(root / "native", preset="tiny", variant="instruct", seed=0)
    convert(native, root / "converted")
    return native, root / "converted"


@pytest.fixture(scope="session")
def tiny_xpu(tiny_native: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_native converted to the XPU layout: tests read it, or break a copy of it."""
    out = tmp_path_factory.mktemp("xpu") / "out"
    convert(tiny_native, out)
    return out


@pytest.fixture
def table_copy(tmp_path: Path) -> Path:
    """A valid table outside the package: loading it would work, so only the name rule refuses it."""
    path = tmp_path / "elsewhere" / "evil.toml"
    path.parent.mkdir()
    shutil.copy(TABLE_DIR / "xpu.toml", path)
    return path


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Base (FP8 experts, F32 scales, MTP emb/head present) native checkpoint."""
    return write_checkpoint(
        tmp_path_factory.mktemp("tiny-base") / "native", preset="tiny", variant="base", main_layers="all", seed=0
    )


@pytest.fixture(scope="session")
def flash_sparse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The full-size Flash replica, all 69,187 tensors, data as file holes (zeros)."""
    return write_checkpoint(tmp_path_factory.mktemp("flash") / "native", preset="flash", main_layers="all", sparse=True)
