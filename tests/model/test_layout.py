"""Start-up: a conversion and a plan import no torch (the target layout comes from a cache
keyed by the model's code and config, model/layout.py; a bad entry, one that does not match its
digest or is no regular file, is rebuilt), and a local plan imports no HTTP stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from child_imports import IMPORTED, imported_by
from inprocess import run_main

from dsv4.model import layout
from dsv4.model.checkpoint import INDEX_NAME
from dsv4.model.config import ModelConfig
from dsv4.model.dtypes import ITEMSIZE, TORCH_DTYPES
from dsv4.model.presets import preset_config


def test_conversion_and_plan_import_no_torch_once_the_layouts_are_cached(tiny_native: Path, tmp_path: Path) -> None:
    imported_by("plan", str(tiny_native))  # fills the cache if this session has not yet
    assert imported_by("plan", str(tiny_native)) == []
    assert imported_by(str(tiny_native), str(tmp_path / "out"), "-q") == []
    assert (tmp_path / "out" / INDEX_NAME).is_file()


def test_a_local_plan_imports_no_http_stack(tiny_native: Path) -> None:
    """issue 20: importing huggingface_hub's HTTP client cost a local `plan` ~0.3 s; only hub
    sources (and a conversion's progress bar) need it."""
    probe = IMPORTED.replace('"httpx")', '"httpx", "httpx2", "huggingface_hub.utils")')
    done = subprocess.run(
        [sys.executable, "-c", probe, "plan", str(tiny_native)], capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout.rsplit("IMPORTED", 1)[1].strip().replace("'", '"')) == []


def test_itemsizes_are_torchs() -> None:
    assert ITEMSIZE == {name: dtype.itemsize for name, dtype in TORCH_DTYPES.items()}


def cfg(**change: object) -> ModelConfig:
    return ModelConfig.from_dict({**preset_config("tiny", "instruct"), **change})


def test_cached_layout_is_the_models(layout_cache: Path) -> None:
    c = cfg()
    built = layout.build_target_layout(c)
    assert layout.target_layout(c) == built  # a miss or a hit: the same
    assert layout.target_layout(c) == built  # a hit
    assert any(layout_cache.glob("layout-*.json"))


def test_layout_cache_key_follows_the_config_and_the_model_code(monkeypatch: pytest.MonkeyPatch) -> None:
    small, big = cfg(), cfg(n_routed_experts=preset_config("tiny", "instruct")["n_routed_experts"] * 2)
    assert layout.target_layout(small) != layout.target_layout(big)
    assert layout.target_layout(big) == layout.build_target_layout(big)
    monkeypatch.setattr(layout, "model_code_sha256", lambda: "other model code")
    monkeypatch.setattr(layout, "build_target_layout", lambda c: {"changed": ("BF16", (1,))})
    assert layout.target_layout(small) == {"changed": ("BF16", (1,))}  # not the old entry


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # torn
        lambda text: "\xff\xfe" + text,  # not UTF-8 JSON
        lambda text: text.replace('"BF16"', "17", 1),  # wrong type
        lambda text: text.replace('"layout": {', '"layout": {"a": ["BF16", [-1]], ', 1),  # bad shape
        lambda text: "[]",  # not an object
        lambda text: text.replace('"layout": {', '"layout": {"a": 1, "a": 2, ', 1),  # duplicate key
    ],
)
def test_a_bad_layout_cache_entry_is_ignored_and_rebuilt(layout_cache: Path, damage) -> None:
    c = cfg(vocab_size=preset_config("tiny", "instruct")["vocab_size"] + 8)
    good = layout.target_layout(c)
    (entry,) = [
        p
        for p in layout_cache.glob("layout-*.json")
        if json.loads(p.read_text())["key"]["config"]["vocab_size"] == c.vocab_size
    ]
    entry.write_bytes(damage(entry.read_text()).encode("utf-8", "surrogateescape"))
    assert layout.target_layout(c) == good
    assert json.loads(entry.read_text())["layout"]  # rewritten whole


def test_an_edited_layout_cache_entry_cannot_fail_a_good_checkpoint(
    tiny_native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = partial(run_main, monkeypatch, capsys)
    c = ModelConfig.from_dict(json.loads((tiny_native / "config.json").read_text()))
    good = layout.target_layout(c)
    entry = layout.cache_entry(c)
    edited = json.loads(entry.read_text())
    name = sorted(edited["layout"])[0]
    edited["layout"][name][1][0] += 1  # one shape changed; the entry still parses, its key still matches
    entry.write_text(json.dumps(edited))
    assert run(tiny_native, tmp_path / "out", "-q")[0] == 0  # not 33: the plan's layout is the model's
    entry.write_text(json.dumps(edited))
    assert run("check", tmp_path / "out", "-q")[0] == 0  # not 78
    assert layout.target_layout(c) == good
    assert json.loads(entry.read_text())["layout"][name][1] == list(good[name][1])  # rewritten from the model


FIFO_READER = """
import json, sys
from dsv4.model import layout
from dsv4.model.config import ModelConfig
from dsv4.model.presets import preset_config
print(len(layout.target_layout(ModelConfig.from_dict(json.loads(sys.argv[1])))))
"""


def test_a_layout_cache_entry_that_is_a_fifo_is_rebuilt_without_waiting(tmp_path: Path) -> None:
    raw = {**preset_config("tiny", "instruct"), "vocab_size": preset_config("tiny", "instruct")["vocab_size"] + 16}
    entry = layout.cache_entry(ModelConfig.from_dict(raw))
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.unlink(missing_ok=True)
    os.mkfifo(entry)  # a reader that opened it plainly would wait for a writer forever
    done = subprocess.run(
        [sys.executable, "-c", FIFO_READER, json.dumps(raw)], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout.strip()) == (
        0,
        str(len(layout.build_target_layout(ModelConfig.from_dict(raw)))),
    ), done.stderr
    assert entry.is_file()  # the FIFO was replaced by a good entry


def test_an_unwritable_cache_costs_only_the_rebuild(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # a file: no directory under it
    assert layout.target_layout(cfg()) == layout.build_target_layout(cfg())


def test_cached_quant_layers_are_the_models_and_a_bad_entry_is_rebuilt(layout_cache: Path) -> None:
    c = cfg(vocab_size=preset_config("tiny", "instruct")["vocab_size"] + 24)
    built = layout.draft_layers(layout.build_draft_model(c))
    assert layout.quant_layers_of(c) == built  # a miss
    (entry,) = [
        p
        for p in layout_cache.glob("quant-layers-*.json")
        if json.loads(p.read_text())["key"]["config"]["vocab_size"] == c.vocab_size
    ]
    assert layout.quant_layers_of(c) == built  # a hit
    edited = json.loads(entry.read_text())
    edited["layers"][0][1] = "model.elsewhere"  # a name changed: the digest no longer matches
    entry.write_text(json.dumps(edited))
    assert layout.quant_layers_of(c) == built
    assert json.loads(entry.read_text())["layers"][0][1] == built[0].name  # rewritten from the model
