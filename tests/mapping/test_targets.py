"""The target registry (mapping/targets.py): a target is a small file (mapping/targets/NAME.toml)
plus the tables whose [table] names it. Its runtime versions are stated there once, so a runtime
bump with an unchanged layout is one line of data; an unknown target is refused by name."""

from __future__ import annotations

import ast
import json
import re
import tomllib
from pathlib import Path

import pytest
from inprocess import run_main

from dsv4.mapping.errors import TableError
from dsv4.mapping.table import DRAFTERS, load_table, load_table_file
from dsv4.mapping.targets import (
    LAYOUT_KINDS,
    TABLE_DIR,
    TARGET_DIR,
    _target_file,
    bundled_target,
    default_target,
    installed_tables,
    installed_targets,
    require_target,
    runtimes_by_target,
    serving_targets,
    table_name_for,
    target_rows,
)

PACKAGE = TABLE_DIR.parent


def test_the_installed_targets_are_the_target_files() -> None:
    assert installed_targets() == ["draft", "xpu"] == sorted(p.stem for p in TARGET_DIR.glob("*.toml"))
    assert (default_target(), bundled_target().name, serving_targets()) == ("xpu", "xpu", ["draft"])
    assert {require_target(t).layout_kind for t in installed_targets()} <= set(LAYOUT_KINDS)


@pytest.mark.parametrize("name", ["nope", "../../x", "xpu.toml", str(TARGET_DIR / "xpu.toml"), 5])
def test_an_unknown_target_is_refused_by_name(name: object) -> None:
    with pytest.raises(
        TableError, match=r"no target .* \(installed: draft, xpu\); a target is chosen by name, not path"
    ):
        require_target(name)
    with pytest.raises(TableError, match=r"no target"):
        table_name_for(name, "mtp")  # type: ignore[arg-type]


def test_every_table_names_a_registered_target_and_each_target_has_one_table_per_drafter() -> None:
    for name in installed_tables():
        assert load_table(name).target in installed_targets(), name
    for target in installed_targets():
        tables = require_target(target).tables
        # one table per drafter kind for every family without a table of its own (V4.1 has one)
        assert sorted(load_table(t).drafter for t in tables if load_table(t).family is None) == sorted(DRAFTERS)
        assert all(load_table(t).runtime == require_target(target).runtime for t in tables)


def test_a_family_table_is_chosen_for_its_family_and_the_kind_table_for_the_others() -> None:
    assert table_name_for("draft", "dspark", "v41-dspark") == "draft_dspark_v41"
    assert table_name_for("draft", "dspark", "dspark-0731") == table_name_for("draft", "dspark") == "draft_dspark"
    # the bundled model's V4.1 drafter (smoke, check): `--target xpu` itself refuses V4.1 before any table is read
    assert table_name_for("xpu", "dspark", "v41-dspark") == "xpu_dspark_v41"


def test_each_runtime_version_is_stated_once_in_its_target_file() -> None:
    """Every "vLLM 0.33.0" a table, conversion.json, check or the card quotes comes from
    mapping/targets/NAME.toml: no [table] header and no string of the product code in convert/
    and mapping/ names a runtime version (comments and docstrings may cite the version whose
    line numbers they quote)."""
    runtimes = {(r, v) for t in installed_targets() for r, v in require_target(t).runtimes}
    assert {r for r, _ in runtimes} == {"vLLM", "SGLang"}
    versions = {f"{r} {v}" for r, v in runtimes}
    for name in installed_tables():
        header = tomllib.loads((TABLE_DIR / f"{name}.toml").read_text())["table"]
        assert "runtime" not in header and not any(v in str(header) for v in versions), name
    for path in [*(PACKAGE / "convert").glob("*.py"), *(PACKAGE / "mapping").glob("*.py")]:
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        strings = [
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
        ]
        for _, version in runtimes:
            assert not [s for s in strings if re.search(rf"\b{re.escape(version)}\b", s)], (path, version)


def test_a_table_stating_a_runtime_is_refused(tmp_path: Path) -> None:
    """[table] runtime was each table's copy of the version; it is the target's now."""
    path = tmp_path / "variant.toml"
    path.write_text(
        (TABLE_DIR / "xpu.toml").read_text().replace('drafter = "mtp"', 'drafter = "mtp"\nruntime = "vLLM 9"')
    )
    with pytest.raises(
        TableError, match=r"\[table\] runtime: the runtime versions are the target's.*targets/xpu.toml"
    ) as raised:
        load_table_file(path)
    assert raised.value.kind == "malformed_table"


@pytest.mark.parametrize(
    "text",
    [
        '[target]\nname = "other"\nruntimes = { vLLM = "1" }\nlayout = "native"\n',  # not its file's name
        '[target]\nname = "t"\nruntimes = {}\nlayout = "native"\n',  # no runtime
        '[target]\nname = "t"\nruntimes = { vLLM = "1" }\nlayout = "disk"\n',  # no such layout kind
        '[target]\nname = "t"\nruntimes = { vLLM = "1" }\nlayout = "native"\ncolour = "red"\n',  # unknown key
        '[target]\nname = "t"\nruntimes = { vLLM = 1 }\nlayout = "native"\n',  # a version is a string
        "[target\n",  # not TOML
    ],
)
def test_a_malformed_target_file_is_refused_naming_it(text: str, tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(TableError, match=r"targets/t.toml: ") as raised:
        _target_file(path)
    assert raised.value.kind == "malformed_table"


def test_the_runtime_text_of_a_target() -> None:
    draft, xpu = require_target("draft"), require_target("xpu")
    vllm, sglang = (f"{r} {v}" for r, v in draft.runtimes)
    assert (draft.runtime, draft.runtimes_said) == (f"{vllm}, {sglang}", f"{vllm} and {sglang}")
    assert vllm.startswith("vLLM ") and sglang.startswith("SGLang ")
    assert (xpu.runtime, xpu.runtime_named("vLLM")) == (vllm, vllm)
    with pytest.raises(TableError, match="names no SGLang version"):
        xpu.runtime_named("SGLang")
    assert load_table("xpu").layout.startswith(f"{vllm} DeepSeekV4MTP on XPU")  # the {runtime} of its description


def test_the_cli_can_take_its_targets_listing_and_version_from_the_registry(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the lead wires convert/cli/main.py to: `targets --json` and `--version` as the registry says them."""
    code, out, _ = run_main(monkeypatch, capsys, "targets", "--json")
    assert code == 0 and json.loads(out) == target_rows()
    code, out, _ = run_main(monkeypatch, capsys, "--version")
    assert code == 0
    assert "; ".join(f"target {t}: {r}" for t, r in runtimes_by_target().items()) in out
