"""A draft for a serving target is written with the safety of every output: OUT/serve/ is
written into the partial directory before publish, so a run interrupted while writing it
leaves no OUT (nothing that looks complete), and the rerun that finishes it is byte-identical
to a run that was never interrupted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from unittest.mock import patch

import pytest
from edits import tree_digest
from quant_configs import serving_target

from dsv4.convert import pipeline
from dsv4.convert.pipeline import convert
from dsv4.convert.serving import OVERRIDES_FILE, Serving, write_serve_files
from dsv4.convert.serving_target import read_serving_target
from dsv4.convert.synth import write_checkpoint


def test_an_interrupt_while_writing_serve_files_leaves_no_out_and_the_rerun_is_byte_identical(
    tmp_path: Path,
) -> None:
    native = write_checkpoint(tmp_path / "native", preset="tiny", seed=0)
    target = tmp_path / "w4a16"
    target.mkdir()
    config = json.loads((native / "config.json").read_text())
    config["quantization_config"] = serving_target("W4A16", ["lm_head"])
    (target / "config.json").write_text(json.dumps(config))
    serving = Serving(read_serving_target(target))
    out = tmp_path / "out"

    def interrupted(files: dict[str, bytes], partial_dir: Path) -> None:
        write_serve_files(dict(list(files.items())[:1]), partial_dir)  # one file written, then Ctrl-C
        raise KeyboardInterrupt

    with patch.object(pipeline, "write_serve_files", interrupted), pytest.raises(KeyboardInterrupt):
        convert(native, out, target="draft", serving=serving)
    assert not out.exists()  # the partial directory is a hidden sibling; nothing looks complete
    assert convert(native, out, target="draft", serving=serving).status == "resumed"
    assert (out / OVERRIDES_FILE).is_file()
    resumed = tree_digest(out)
    # the same conversion, never interrupted, into the same OUT (its launch commands name OUT)
    shutil.rmtree(out)
    assert convert(native, out, target="draft", serving=serving).status == "converted"
    assert tree_digest(out) == resumed
