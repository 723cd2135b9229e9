"""Reading the serving target of `--serve-with TARGET` (convert/serving_target.py) through the
command line: a local directory, a config.json or a hub repo, of which only config.json is
fetched (pinned to the commit the hub resolves); every hostile config refused in one line
naming the file and the field, with its documented exit code, before OUT is touched."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from dirhub import DirHub
from hubserver import FakeHub, Fault, hub_env, on, run_cli
from inprocess import run_main

from dsv4.convert.synth import write_checkpoint
from dsv4.model.strictjson import MAX_RECORD_BYTES


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("serve-target") / "native", preset="tiny", seed=0)


def config_text(native: Path) -> str:
    return (native / "config.json").read_text()


def target_with(tmp_path: Path, text: str) -> Path:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(text)
    return target


def plan_beside(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], native: Path, target: object):
    return run_main(monkeypatch, capsys, "plan", native, "--target", "draft", "--serve-with", str(target), "-q")


def edited(native: Path, **fields: object) -> str:
    return json.dumps({**json.loads(config_text(native)), **fields})


# (what the config.json holds, exit code, the reason after "error: TARGET/config.json: ")
HOSTILE = {
    "malformed-json": (lambda n: "{not json", 18, "not valid JSON (Expecting property name enclosed in double quotes"),
    "duplicate-key": (lambda n: config_text(n)[:-2] + ', "hidden_size": 1}', 18, "duplicate key 'hidden_size'"),
    "nan": (lambda n: edited(n, rope_theta="@").replace('"@"', "NaN"), 18, "NaN is not JSON"),
    "not-an-object": (lambda n: "[]", 18, "the top level is [] (a list); expected a JSON object"),
    "layers-a-string": (
        lambda n: edited(n, num_hidden_layers="2"),
        18,
        'num_hidden_layers is "2" (a string); expected an integer in 1..1024',
    ),
    "layers-a-bool": (
        lambda n: edited(n, num_hidden_layers=True),
        18,
        "num_hidden_layers is true (a boolean); expected an integer in 1..1024",
    ),
    "quantization-a-list": (
        lambda n: edited(n, quantization_config=[1]),
        18,
        "quantization_config is [1] (a list); expected an object",
    ),
    "quantization-a-string": (
        lambda n: edited(n, quantization_config="fp8"),
        18,
        'quantization_config is "fp8" (a string); expected an object',
    ),
    "unknown-method": (
        lambda n: edited(n, quantization_config={"quant_method": "gptq"}),
        82,
        "quantization_config.quant_method 'gptq' is not a quantisation method this converter knows",
    ),
    "another-model": (
        lambda n: edited(n, hidden_size=json.loads(config_text(n))["hidden_size"] * 2),
        33,
        "hidden_size is 512, the source's is 256: the runtime builds the draft's layers from the target's config",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_target_config_is_refused_in_one_line_naming_the_file(
    case: str, native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    content, code, reason = HOSTILE[case]
    target = target_with(tmp_path, content(native))
    got, out, err = plan_beside(monkeypatch, capsys, native, target)
    assert (got, out) == (code, "")
    assert err.count("\n") == 1 and err.startswith(f"error: {target / 'config.json'}: {reason}"), err


def test_an_oversized_target_config_is_refused_before_it_is_read(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = target_with(tmp_path, "")
    with open(target / "config.json", "wb") as f:
        f.truncate(MAX_RECORD_BYTES + 1)  # a hole: no byte of it is written, none may be read
    code, _, err = plan_beside(monkeypatch, capsys, native, target)
    assert code == 18
    assert err == (
        f"error: {target / 'config.json'}: {MAX_RECORD_BYTES + 1:,} bytes, over the {MAX_RECORD_BYTES:,}-byte "
        "limit on a record\n"
    )


def test_a_directory_without_config_json_and_a_missing_path_are_refused(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = plan_beside(monkeypatch, capsys, native, tmp_path)
    assert (code, err) == (
        18,
        f"error: {tmp_path / 'config.json'}: no config.json: a serving target is a model directory, its "
        "config.json, or a hub repo\n",
    )
    missing = tmp_path / "no-such-model"
    code, _, err = plan_beside(monkeypatch, capsys, native, missing)
    assert (code, err) == (
        19,
        f"error: {missing}: no such model directory or config.json (nor a hub repo id [hf://]org/name[@revision])\n",
    )


def test_convert_refuses_a_hostile_target_before_out_is_touched(
    native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = target_with(tmp_path, "{not json")
    out = tmp_path / "draft"
    code, _, err = run_main(monkeypatch, capsys, "convert", native, out, "--target", "draft", "--serve-with", target)
    assert code == 18 and "not valid JSON" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no OUT, no lock, no partial directory


@pytest.fixture
def dirhub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DirHub:
    """Hub repo ids resolved against a directory hub, in this process."""
    hub = DirHub(tmp_path / "hub")
    for module in ("dsv4.convert.sources.location", "dsv4.convert.serving_target"):
        monkeypatch.setattr(f"{module}.default_backend", lambda: hub)
    return hub


def test_a_hub_target_is_its_config_json_only_pinned_to_the_commit(
    native: Path, dirhub: DirHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = dirhub.root / "org" / "target"
    repo.mkdir(parents=True)
    (repo / "config.json").write_bytes((native / "config.json").read_bytes())
    (repo / "model.safetensors").write_bytes(b"never read")
    code, out, err = run_main(
        monkeypatch, capsys, "plan", native, "--target", "draft", "--serve-with", "org/target", "--json"
    )
    assert (code, err) == (0, "")
    commit = dirhub.commit_of(repo)
    assert json.loads(out)["serve"]["target"] == {
        "repo": "org/target",
        "commit": commit,
        "config_sha256": hashlib.sha256((native / "config.json").read_bytes()).hexdigest(),
    }
    assert dirhub.requests == {"info": 1, "get": 1}  # the commit, then config.json at it; no other file


def test_a_hub_target_missing_at_that_revision_or_without_config_json_is_refused(
    native: Path, dirhub: DirHub, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = plan_beside(monkeypatch, capsys, native, "org/absent")
    assert (code, err) == (61, "error: hub:org/absent@default branch: repository not found\n")
    repo = dirhub.root / "org" / "weights-only"
    repo.mkdir(parents=True)
    (repo / "model.safetensors").write_bytes(b"")
    code, _, err = plan_beside(monkeypatch, capsys, native, "org/weights-only@v2")
    assert (code, err) == (62, "error: hub:org/weights-only@v2: revision not found\n")
    code, _, err = plan_beside(monkeypatch, capsys, native, "org/weights-only")
    commit = dirhub.commit_of(repo)
    assert (code, err) == (
        18,
        f"error: hub:org/weights-only/config.json@{commit[:12]}: no config.json in the repository\n",
    )


def test_a_gated_hub_target_is_refused_and_a_served_one_costs_two_requests(native: Path, tmp_path: Path) -> None:
    """Through huggingface_hub against the fake hub: a gated repository exits 61 saying so;
    an open one is read as its model info and its config.json, nothing else."""
    with FakeHub() as hub:
        hub.commit("org/target", {"config.json": (native / "config.json").read_bytes(), "model.safetensors": b"x" * 64})
        hub.faults.append(Fault(on("info"), status=403, headers={"X-Error-Code": "GatedRepo"}))
        env = hub_env(hub, tmp_path / "hf")
        gated = run_cli("plan", str(native), "--target", "draft", "--serve-with", "org/target", "-q", env=env)
        assert gated.returncode == 61, gated.stderr
        assert gated.stderr.startswith("error: hub:org/target@default branch: gated repository; accept its terms")
        hub.reset_counters()
        served = run_cli("plan", str(native), "--target", "draft", "--serve-with", "org/target", "-q", env=env)
        assert served.returncode == 0, served.stderr
        assert [(q.route, q.path) for q in hub.requests] == [("info", None), ("resolve", "config.json")]
        assert hub.bytes_served["org/target"] == len((native / "config.json").read_bytes())
