"""The model card `batch --push` uploads (convert/batch/card.py) is the target's data: its body is
mapping/targets/NAME.card.md and its serve commands are the target file's [[card.serve]]
entries, so a new runtime on the card or a new target's card is a data edit, not code."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4.convert.batch import card
from dsv4.mapping import targets
from dsv4.mapping.errors import TableError
from dsv4.mapping.table import load_table
from dsv4.mapping.targets import TARGET_DIR, _target_file, require_target

COMMIT = "0123456789abcdef0123456789abcdef01234567"
DRAFT_FILE = (TARGET_DIR / "draft.toml").read_text()
OTHER_RUNTIME = """
[[card.serve]]
runtime = "Other"
mtp = "other-serve $source --draft $repo --steps 1"
dspark = "other-serve $source --draft $repo"
"""


def test_a_runtime_added_to_a_target_file_is_served_on_its_card(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One runtime more in the target file (its version and a serve entry) is one more
    command on the card, after the others, and nothing else of the card changes."""
    path = tmp_path / "draft.toml"
    path.write_text(DRAFT_FILE.replace('SGLang = "0.5.23" }', 'SGLang = "0.5.23", Other = "1.0" }') + OTHER_RUNTIME)
    shipped = card.model_card("dest/mtp-draft", "org/mtp", COMMIT, load_table("draft"))
    monkeypatch.setattr(card, "require_target", lambda name: _target_file(path))
    text = card.model_card("dest/mtp-draft", "org/mtp", COMMIT, load_table("draft"))
    added = "\n\n# Other 1.0\nother-serve org/mtp --draft dest/mtp-draft --steps 1"
    assert added in text and text.replace(added, "", 1) == shipped


def test_the_serve_commands_are_the_target_files_per_drafter() -> None:
    draft = require_target("draft")
    assert [s.runtime for s in draft.card.serve] == ["vLLM", "SGLang"] and draft.card.library_name == "vllm"
    assert require_target("xpu").card.serve == () and require_target("xpu").card.library_name is None
    block = card.serve_commands(draft, "org/spark", "dest/spark-draft", "dspark")
    assert block.startswith(f"# {draft.runtime_named('vLLM')} (XPU, CUDA, ROCm)\nvllm serve org/spark ")
    assert block.endswith("--speculative-algorithm DSPARK --speculative-draft-model-path dest/spark-draft")


def test_a_card_template_naming_an_unknown_field_is_refused_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "xpu.card.md").write_text("# $name\n\n$colour\n")
    monkeypatch.setattr(targets, "TARGET_DIR", tmp_path)
    with pytest.raises(TableError, match=r"targets/xpu.card.md: the card template names 'colour'") as raised:
        card.model_card("dest/x", "org/x", COMMIT, load_table("xpu"))
    assert raised.value.kind == "malformed_table"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('[card]\nbody = "draft.card.md"', "[other]"),  # no [card]
        ('body = "draft.card.md"', 'body = "../draft.card.md"'),  # a template outside targets/
        ('body = "draft.card.md"', 'body = "gone.card.md"'),  # a template that is not there
        ('runtime = "SGLang"', 'runtime = "Other"'),  # a runtime the target has no version of
        ('\ndspark = "python', '\nnot_a_drafter = "python'),  # no command for a DSpark draft
        ('library_name = "vllm"', "library_name = 1"),
    ],
)
def test_a_malformed_card_section_is_refused_naming_the_target_file(old: str, new: str, tmp_path: Path) -> None:
    assert old in DRAFT_FILE
    path = tmp_path / "draft.toml"
    path.write_text(DRAFT_FILE.replace(old, new, 1))
    with pytest.raises(TableError, match=r"^targets/draft.toml: ") as raised:
        _target_file(path)
    assert raised.value.kind == "malformed_table"
