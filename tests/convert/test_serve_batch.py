"""A batch manifest's `serve_with` (convert/batch/manifest.py): every draft made for that serving
target, as `convert --serve-with` makes it; the rerun skips only an output made for the same
target; the pushed card says the same as OUT/serve/ (the target, the route, the commands)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hubserver import FakeHub, hub_env, run_cli

from dsv4.convert.batch.card import card_body
from dsv4.convert.batch.manifest import load_manifest
from dsv4.convert.errors import HubError
from dsv4.convert.pipeline import convert
from dsv4.convert.serving import COMMANDS_FILE, Serving
from dsv4.convert.serving_target import read_serving_target
from dsv4.convert.synth import write_checkpoint
from dsv4.mapping.table import load_table
from dsv4.mapping.targets import require_target

TOKEN = "hf_fakeTokenThatMustNeverBeWritten1234"


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("serve-batch") / "mtp", preset="tiny", seed=3)


def manifest_text(serve: str = "", options: str = "", target: str = "draft") -> str:
    head = f'target = "{target}"\nsources = ["org/mtp"]\n{serve}\n'
    return head + f'[output]\ndir = "out"\n[options]\ncheck = false\n{options}'


def test_serve_with_is_a_manifest_key_checked_as_the_options_are(tmp_path: Path, native: Path) -> None:
    (tmp_path / "target").mkdir()
    manifest = tmp_path / "batch.toml"
    manifest.write_text(manifest_text('serve_with = "target"', 'draft_format = "native"'))
    loaded = load_manifest(manifest)
    assert (loaded.serve_with, loaded.draft_format, loaded.allow_lossy) == (str(tmp_path / "target"), "native", False)
    for text, words in (
        (manifest_text('serve_with = "org/t"', target="xpu"), "serve_with makes drafts to serve beside a target"),
        (manifest_text("", "allow_lossy = true"), "they need serve_with"),
        (manifest_text('serve_with = "org/t"', 'draft_format = "fp8"'), "options.draft_format one of auto, native"),
        (manifest_text("serve_with = 1"), "serve_with is a serving target"),
    ):
        manifest.write_text(text)
        with pytest.raises(HubError) as refused:
            load_manifest(manifest)
        assert refused.value.kind == "bad_manifest" and words in str(refused.value), str(refused.value)


def test_the_card_of_a_served_draft_names_its_target_route_and_commands(native: Path, tmp_path: Path) -> None:
    out = tmp_path / "draft"
    convert(native, out, target="draft", serving=Serving(read_serving_target(native)))
    body = card_body("dest/mtp-draft", "org/mtp", "c0ffee", load_table("draft"), require_target("draft"), out)
    assert f"Beside {native}, the target it was made for (route native: auto: a DeepSeek fp8 target" in body
    assert (
        f"vllm serve {native} --speculative-config "
        """'{"method":"mtp","model":"dest/mtp-draft","num_speculative_tokens":1}'"""
    ) in body
    assert "# where the target is launched with an explicit --quantization, add" in body
    plain = card_body("dest/mtp-draft", "org/mtp", "c0ffee", load_table("draft"), require_target("draft"))
    assert "Beside the target model it was converted from (org/mtp, commit `c0ffee`):" in plain


def test_batch_makes_each_draft_for_the_serving_target_and_pushes_its_serve_files(native: Path, tmp_path: Path) -> None:
    with FakeHub(token=TOKEN) as hub:
        hub.commit_dir("org/mtp", native)
        hub.commit("org/target", {"config.json": (native / "config.json").read_bytes()})
        manifest = tmp_path / "batch.toml"
        manifest.write_text(
            manifest_text('serve_with = "org/target"').replace("[output]\n", '[output]\nrepo = "dest/{name}-draft"\n')
        )
        env = hub_env(hub, tmp_path / "hf", HF_TOKEN=TOKEN)
        r = run_cli("batch", str(manifest), "--push", env=env)
        assert r.returncode == 0, r.stderr
        out = tmp_path / "out" / "mtp-draft"
        report = json.loads((tmp_path / "out" / "batch-report.json").read_text())
        assert report["serve_with"]["repo"] == "org/target"
        assert json.loads((out / "conversion.json").read_text())["serve"]["target"] == report["serve_with"]
        assert "vllm serve org/target " in (out / COMMANDS_FILE).read_text()
        pushed = hub.files("dest/mtp-draft")
        assert pushed[COMMANDS_FILE] == (out / COMMANDS_FILE).read_bytes()  # OUT/serve/ is uploaded with the draft
        assert "Beside org/target, commit `" in pushed["README.md"].decode()
        r = run_cli("batch", str(manifest), env=env)  # made for this target already: skipped
        assert (
            r.returncode == 0 and len(json.loads((tmp_path / "out" / "batch-report.json").read_text())["skipped"]) == 1
        )
