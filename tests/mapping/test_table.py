"""The mapping table is data a reviewer reads in one screen and a machine checks
completely: a bad table is rejected before any checkpoint is read; `--target` and library
callers name an installed table, never a path."""

from __future__ import annotations

from pathlib import Path

import pytest
from inprocess import one_error_line, run_main

from dsv4.mapping import errors as mapping_errors
from dsv4.mapping.errors import TableError
from dsv4.mapping.table import TABLE_DIR, load_table, load_table_file
from dsv4.mapping.targets import installed_targets

SHIPPED = (TABLE_DIR / "xpu.toml").read_text()


def table_with(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "variant.toml"
    path.write_text(text)
    return path


def add_to_section(section: str, line: str, text: str = SHIPPED) -> str:
    head = f"[{section}]\n"
    assert head in text
    return text.replace(head, head + line + "\n", 1)


def test_shipped_table_loads_and_is_versioned() -> None:
    table = load_table("xpu")
    assert (table.name, table.target) == ("xpu", "xpu")
    assert table.version == "1"
    assert {r.op for r in table.rules} == {"copy", "rename", "concat", "stack", "skip", "refuse"}
    assert all(r.reason for r in table.rules if r.op in ("skip", "refuse"))


def test_no_target_mentions_norm_gate() -> None:
    assert not [r for r in load_table().rules if r.target and "norm_gate" in r.target]


def test_gate_bias_goes_to_e_score_correction_bias() -> None:
    (rule,) = [r for r in load_table().rules if r.sources == ("mtp.{i}.ffn.gate.bias",)]
    assert rule.target == "model.layers.{L}.mtp_block.ffn.gate.e_score_correction_bias"


@pytest.mark.parametrize(
    "key",
    [
        "mtp.0.attn.q_norm.weight",
        "mtp.0.attn.kv_norm.weight",
        "mtp.0.attn_norm.weight",
        "mtp.0.ffn_norm.weight",
        "mtp.0.enorm.weight",
        "mtp.0.hnorm.weight",
    ],
)
def test_norm_rules_are_anchored(key: str) -> None:
    """The seed bug class: `.norm.weight` as a substring rule would also catch these."""
    norm_rules = [r for r in load_table().rules if r.sources in (("mtp.{i}.norm.weight",), ("norm.weight",))]
    assert len(norm_rules) == 2
    for r in norm_rules:
        assert not r.source_regexes[0].match(key)
    assert norm_rules[0].source_regexes[0].match("mtp.0.norm.weight") or norm_rules[1].source_regexes[0].match(
        "mtp.0.norm.weight"
    )


# a bad table is refused when loaded: (its text, the refusal's message, its kind)
BAD_TABLES = [
    # vLLM's XPU remap sent ffn.gate.tid2eid into ffn.norm_gate: the MTP block has no
    # tid2eid, so such a rule can never fire: the loader names it as dead
    pytest.param(
        add_to_section("rename", '"mtp.{i}.ffn.gate.tid2eid" = "model.layers.{L}.mtp_block.ffn.norm_gate.tid2eid"'),
        r"\[rename\] model.layers.\{L\}.mtp_block.ffn.norm_gate.tid2eid.*dead rule",
        "dead_rule",
        id="old-buggy-norm-gate-entries-are-rejected",
    ),
    pytest.param(
        add_to_section("skip", '"mtp.{i}.ffn.norm_gate.{rest}" = "old remap"'),
        r"mtp.\{i\}.ffn.norm_gate",
        "dead_rule",
        id="rule-reading-a-norm-gate-source-is-dead",
    ),
    # the block's ffn_norm rule lives in mapping/include/v4_block.toml: this rule writes it elsewhere
    pytest.param(
        add_to_section("rename", '"mtp.{i}.ffn_norm.weight" = "model.layers.{L}.mtp_block.ffn.norm_gate.norm.weight"'),
        r"model.layers.2.mtp_block.ffn.norm_gate.norm.weight is not a parameter",
        "unknown_target",
        id="target-that-is-not-a-parameter",
    ),
    pytest.param(SHIPPED + '\n[morph]\n"a" = "b"\n', "morph", "unknown_op", id="unknown-op"),
    pytest.param(
        SHIPPED.replace('"model.layers.{L}.hnorm.weight"', '"model.layers.{L}.experts.{e}.hnorm.weight"'),
        r"\{e\}",
        "unbound_placeholder",
        id="unbound-placeholder",
    ),
    pytest.param(
        add_to_section("skip", '"mtp.{k}.foo" = "x"'),
        r"unknown placeholder \{k\}",
        "unbound_placeholder",
        id="unknown-placeholder",
    ),
    pytest.param(
        add_to_section("copy", '"norm.weight" = "model.layers.{L}.shared_head.norm.weight"'),
        "shared_head.norm.weight",
        "duplicate_target_rule",
        id="two-rules-writing-one-target",
    ),
    pytest.param(
        add_to_section("skip", '"mtp.{i}.foo" = ""'), "needs a reason", "malformed_table", id="skip-needs-a-reason"
    ),
]


@pytest.mark.parametrize(("text", "message", "kind"), BAD_TABLES)
def test_a_bad_table_is_refused_naming_the_rule(text: str, message: str, kind: str, tmp_path: Path) -> None:
    with pytest.raises(mapping_errors.TableError, match=message) as raised:
        load_table_file(table_with(tmp_path, text))
    assert raised.value.kind == kind


# --- --target is a name, never a path ---------------------------------------------------------
@pytest.mark.parametrize("command", ["plan", "convert"])
def test_target_must_be_an_installed_table_name(
    command: str,
    table_copy: Path,
    tiny_native: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for target in (str(table_copy), "../../x", str(table_copy.with_suffix("")), "xpu.toml"):
        args = ["plan", str(tiny_native)] if command == "plan" else [str(tiny_native), str(tmp_path / "out"), "-q"]
        code, out, err = run_main(monkeypatch, capsys, *args, "--target", target)
        line = one_error_line(err)
        assert code == 2 and "'--target'" in line
        assert all(repr(name) in line for name in installed_targets()), (
            line
        )  # --target names a target; its tables are the plan's choice
        assert out == "" and not (tmp_path / "out").exists()


def test_library_callers_get_a_table_error_listing_the_installed_tables(table_copy: Path) -> None:
    for name in (str(table_copy), str(table_copy.with_suffix("")), "../../x", 5):
        with pytest.raises(
            TableError, match=r"installed: draft, draft_dspark, draft_dspark_v41, xpu, xpu_dspark, xpu_dspark_v41"
        ):  # the draft tables are installed too
            load_table(name)  # type: ignore[arg-type]
