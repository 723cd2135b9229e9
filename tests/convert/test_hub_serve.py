"""`convert-dsv4 org/src OUT --target draft --serve-with org/target` against the local test
hub: the source read by byte ranges (the planned bytes, nothing whole but its small files),
the target a second repo of which only config.json is fetched (its weights never), and the
output the local conversion's, byte for byte, but for the names the launch commands quote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hubserver import FakeHub, hub_env, run_cli
from inprocess import run_main
from quant_configs import serving_target

from dsv4.convert.serving import COMMANDS_FILE, OVERRIDES_FILE
from dsv4.convert.sources.hub import SPECULATIVE_HEADER_BYTES
from dsv4.convert.synth import write_checkpoint
from dsv4.model.checkpoint import INDEX_NAME

SOURCE, TARGET = "org/v4", "org/v4-w4a16"


def test_a_hub_source_beside_a_hub_target_reads_the_planned_bytes_and_only_the_targets_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_checkpoint(tmp_path / "src", preset="tiny", seed=0)
    config = json.loads((src / "config.json").read_text())
    target_config = json.dumps({**config, "quantization_config": serving_target("W4A16", ["lm_head"])}).encode()
    local_target = tmp_path / "target"
    local_target.mkdir()
    (local_target / "config.json").write_bytes(target_config)
    local = tmp_path / "local"
    args = ("--target", "draft", "--serve-with")
    assert run_main(monkeypatch, capsys, src, local, *args, local_target, "-q")[0] == 0
    code, planned, _ = run_main(monkeypatch, capsys, "plan", src, *args, local_target, "--json")
    assert code == 0
    planned_bytes = json.loads(planned)["bytes_to_read"]

    with FakeHub() as hub:
        hub.commit_dir(SOURCE, src)
        weights = b"\0" * (4 << 20)  # a target's weights: never to be fetched
        hub.commit(TARGET, {"config.json": target_config, "model-00001-of-00001.safetensors": weights})
        out = tmp_path / "hub-out"
        r = run_cli("convert", SOURCE, str(out), *args, TARGET, "--json", "-q", env=hub_env(hub, tmp_path / "hf"))
        assert r.returncode == 0, r.stderr
        requests = list(hub.requests)
        served = dict(hub.bytes_served)

    # the target: its model info (the commit), then config.json at it; nothing else
    assert [(q.route, q.path) for q in requests if q.repo == TARGET] == [("info", None), ("resolve", "config.json")]
    assert served[TARGET] == len(target_config)
    # the source: what the plan says it reads, fetched by ranges (no shard read whole)
    assert json.loads(r.stdout)["bytes_read"] == planned_bytes
    shards = {p.name: p.stat().st_size for p in src.glob("*.safetensors")}
    small = sum((src / name).stat().st_size for name in ("config.json", INDEX_NAME))
    headers = sum(min(SPECULATIVE_HEADER_BYTES, size) for size in shards.values())
    assert served[SOURCE] == planned_bytes + headers + small  # each shard's header read, then the planned ranges
    assert all(q.range is not None for q in requests if q.repo == SOURCE and q.path in shards and q.nbytes)

    # the output: the local conversion's tensors, config, index and --hf-overrides value, byte
    # for byte; the launch commands the same but for the target's and OUT's names
    names = ["config.json", INDEX_NAME, OVERRIDES_FILE, *sorted(p.name for p in local.glob("*.safetensors"))]
    assert [(out / n).read_bytes() == (local / n).read_bytes() for n in names] == [True] * len(names)
    commands = (out / COMMANDS_FILE).read_text().replace(TARGET, str(local_target)).replace(str(out), str(local))
    assert commands == (local / COMMANDS_FILE).read_text()
    record = json.loads((out / "conversion.json").read_text())["serve"]["target"]
    assert record["repo"] == TARGET and len(record["commit"]) == 40
