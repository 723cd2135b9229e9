"""The hub protocol (convert/hub_protocol.py): a second backend is one module. tests/dirhub.py
serves repositories from a directory; a conversion read through it is the conversion of the
same checkpoint read from disk, through the same mechanics (pinned commit, checked ranged
reads, the inventory's checks, --verify-source); every request is the directory hub's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dirhub import DirHub

from dsv4.convert.errors import HubError
from dsv4.convert.hub import resolve_commit
from dsv4.convert.location import open_source
from dsv4.convert.pipeline import convert, plan_source, run_plan
from dsv4.convert.source import HubSpec
from dsv4.convert.synth import write_checkpoint
from dsv4.model.record import CONVERSION_RECORD

REPO = "org/tiny"


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dirhub")
    write_checkpoint(root / REPO, preset="tiny", main_layers="all", seed=0)
    return root


@pytest.mark.parametrize("verify", [False, True])
def test_a_directory_hub_plans_and_converts_through_the_protocol(hub_root: Path, tmp_path: Path, verify: bool) -> None:
    """Fails before the protocol: open_source took no backend, and the hub reader called
    huggingface_hub directly."""
    backend = DirHub(hub_root)
    local = tmp_path / "local"
    convert(hub_root / REPO, local)
    # with `verify`, whole files are checked against the digests the backend lists
    with open_source(HubSpec(REPO, None, verify_files=verify), backend=backend) as source:
        plan = plan_source(source, "xpu")
        result = run_plan(plan, source, tmp_path / "hub")
    assert result.status == "converted"
    names = sorted(p.name for p in local.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "hub").iterdir())
    for name in names:
        if name != CONVERSION_RECORD:  # it names the source
            assert (local / name).read_bytes() == (tmp_path / "hub" / name).read_bytes(), name
    record = json.loads((tmp_path / "hub" / CONVERSION_RECORD).read_text())
    commit = resolve_commit(HubSpec(REPO, None), backend)
    assert (record["source"]["location"], record["source"]["revision"]) == (f"hub:{REPO}", commit)
    assert backend.requests["info"] == 2 and backend.requests["get"] > 2


def test_a_directory_hub_refuses_in_one_line_with_the_kind_it_names(hub_root: Path) -> None:
    backend = DirHub(hub_root)
    with pytest.raises(HubError, match=r"^hub:org/missing@default branch: repository not found$") as raised:
        open_source(HubSpec("org/missing", None, explicit=True), backend=backend)
    assert raised.value.kind == "repo_not_found"
    with pytest.raises(HubError, match=r"^hub:org/tiny@v2: revision not found$") as raised:
        open_source(HubSpec(REPO, "v2", explicit=True), backend=backend)
    assert raised.value.kind == "revision_not_found"
