"""`convert-dsv4 batch` (convert/batch/run.py) against a local fake hub: failures isolated and
reported, reruns idempotent without fetching, a fixed repo picked up, pushes made once
through huggingface_hub, shards covering the manifest exactly once, the token kept secret;
`target = "draft"` for both drafters, and the model card (convert/batch/card.py) every push
carries: ready-to-serve for a draft directory, who reads it for the xpu layout.

The manifest: its forms, its errors naming the file and the key (an uninstalled target, a bad
output template, a local directory where a hub repository belongs); property-based
(tests/fuzzing.py), random and mutated manifests load soundly or are refused with the tool's own
one-line error."""

from __future__ import annotations

import json
import math
import os
import sys
import tomllib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dspark_fixtures import write_half_dspark
from fuzzing import FUZZ, mutate_text, one_line_own_error, outcome
from hubserver import FakeHub, Fault, hub_env, on, run_cli
from huggingface_hub import ModelCard
from hypothesis import given
from hypothesis import strategies as st
from inprocess import held_by_a_thread, run_main, run_one_line

from dsv4.convert.batch.manifest import Manifest, ManifestEntry, load_manifest, select_shard, shard_from_env
from dsv4.convert.batch.run import run_check
from dsv4.convert.errors import CheckError, HubError
from dsv4.convert.pipeline import convert
from dsv4.convert.sizes import MAX_SHARD_SIZE
from dsv4.convert.synth import write_checkpoint
from dsv4.model.record import CONVERSION_RECORD

TOKEN = "hf_fakeTokenThatMustNeverBeWritten1234"
REPOS = ("org/alpha", "org/beta", "org/gamma")  # gamma starts broken (a half DSpark checkpoint: exit 35)


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("native")
    for name, seed in (("alpha", 0), ("beta", 1), ("gamma", 2)):
        write_checkpoint(root / name, preset="tiny", main_layers="all", seed=seed)
        convert(root / name, root / f"{name}-converted")
    write_half_dspark(root / "broken", seed=2)  # a DSpark drafter whose config.json lacks the dspark_* fields
    return root


@pytest.fixture
def hub(native: Path) -> Iterator[FakeHub]:
    with FakeHub(token=TOKEN) as h:
        for repo in REPOS:
            name = repo.split("/")[1]
            h.commit_dir(repo, native / ("broken" if name == "gamma" else name))
        yield h


def write_manifest(
    path: Path,
    *,
    repo_template: str | None = None,
    sources: tuple[str, ...] = REPOS,
    check: bool = False,
    target: str = "xpu",
) -> Path:
    output = 'dir = "out"\nname = "{name}-{target}"\n' + (f'repo = "{repo_template}"\n' if repo_template else "")
    path.write_text(
        f'target = "{target}"\nsources = {json.dumps(list(sources))}\n\n[output]\n{output}\n[options]\ncheck = '
        f"{str(check).lower()}\n"
    )
    return path


def source_bytes(hub: FakeHub, repo: str) -> int:
    """File bytes the hub sent for a source repo; any file request at all counts as one."""
    return hub.bytes_served.get(repo, 0) + sum(1 for q in hub.requests if q.repo == repo and q.route == "resolve")


def report_of(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.mark.slow
def test_batch_isolates_failures_reruns_idempotently_and_picks_up_a_fix(
    native: Path, hub: FakeHub, tmp_path: Path
) -> None:
    manifest = write_manifest(tmp_path / "batch.toml", check=True)
    report = tmp_path / "out" / "batch-report.json"
    env = hub_env(hub, tmp_path / "hf")

    r = run_cli("batch", str(manifest), env=env)
    assert r.returncode == 66, r.stderr  # batch_failed: some repo failed
    rep = report_of(report)
    assert [e["repo"] for e in rep["converted"]] == ["org/alpha", "org/beta"]
    assert [(e["repo"], e["exit_code"]) for e in rep["failed"]] == [("org/gamma", 35)]
    assert "refusing to convert" in rep["failed"][0]["reason"]
    assert [p["repo"] for p in rep["planned"]] == list(REPOS) and rep["skipped"] == []
    assert all(e["check"] != "disabled" for e in rep["converted"])  # checked where the checker is installed
    assert rep["bytes_fetched"] >= sum(e["bytes_fetched"] for e in rep["converted"]) > 0
    for name in ("alpha", "beta"):
        out = tmp_path / "out" / f"{name}-xpu"
        for f in ("config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors"):
            assert (out / f).read_bytes() == (native / f"{name}-converted" / f).read_bytes()
    assert not (tmp_path / "out" / "gamma-xpu").exists()

    hub.reset_counters()
    r = run_cli("batch", str(manifest), env=env)
    assert r.returncode == 66, r.stderr
    rep = report_of(report)
    assert [e["repo"] for e in rep["skipped"]] == ["org/alpha", "org/beta"] and rep["converted"] == []
    assert all("already records source commit" in e["reason"] and "table xpu v" in e["reason"] for e in rep["skipped"])
    assert source_bytes(hub, "org/alpha") == source_bytes(hub, "org/beta") == 0

    fixed = hub.commit_dir("org/gamma", native / "gamma", "fix the layout")
    hub.reset_counters()
    r = run_cli("batch", str(manifest), env=env)
    assert r.returncode == 0, r.stderr
    rep = report_of(report)
    assert [(e["repo"], e["commit"]) for e in rep["converted"]] == [("org/gamma", fixed)]
    assert [e["repo"] for e in rep["skipped"]] == ["org/alpha", "org/beta"] and rep["failed"] == []
    assert source_bytes(hub, "org/alpha") == source_bytes(hub, "org/beta") == 0
    assert json.loads((tmp_path / "out" / "gamma-xpu" / CONVERSION_RECORD).read_text())["source"]["revision"] == fixed


def test_push_uploads_through_the_hub_once_and_never_writes_the_token(
    native: Path, hub: FakeHub, tmp_path: Path
) -> None:
    manifest = write_manifest(tmp_path / "batch.toml", repo_template="dest/{name}-{target}", sources=REPOS[:2])
    report = tmp_path / "out" / "batch-report.json"
    runs = []

    # without a token the fake hub refuses writes: the push fails, and only the push
    runs.append(r := run_cli("batch", str(manifest), "--push", env=hub_env(hub, tmp_path / "hf")))
    assert r.returncode == 66, r.stderr
    assert {(e["repo"], e["error"], e["kind"]) for e in report_of(report)["failed"]} == {
        ("org/alpha", "HubError", "push_failed"),
        ("org/beta", "HubError", "push_failed"),
    }
    assert hub.pushed == []

    env = hub_env(hub, tmp_path / "hf", HF_TOKEN=TOKEN)
    runs.append(r := run_cli("batch", str(manifest), "--push", env=env))
    assert r.returncode == 0, r.stderr
    rep = report_of(report)
    assert [e["conversion"] for e in rep["converted"]] == ["reused", "reused"]  # converted by the first run
    assert sorted(p["repo"] for p in hub.pushed) == ["dest/alpha-xpu", "dest/beta-xpu"]
    for p, e in zip(sorted(hub.pushed, key=lambda p: p["repo"]), rep["converted"], strict=True):
        assert e["commit"][:12] in p["message"] and "table xpu v1" in p["message"] and e["pushed"]["commit"] == p["oid"]
        assert {"conversion.json", "model-00001-of-00001.safetensors"} <= set(p["files"])
    shard = "model-00001-of-00001.safetensors"
    assert hub.files("dest/alpha-xpu")[shard] == (native / "alpha-converted" / shard).read_bytes()
    assert all(q.authorized for q in hub.requests if q.route in ("create", "preupload", "commit") and q.status == 200)
    # an xpu repo's card says what reads it: no runtime loads this layout from disk
    card = ModelCard(hub.files("dest/alpha-xpu")["README.md"].decode())
    assert (card.data.base_model, card.data.library_name) == ("org/alpha", None) and "target-xpu" in card.data.tags
    assert (
        "`convert-dsv4 check`" in card.text
        and "No runtime loads this layout from disk" in card.text
        and "--target draft" in card.text
    )
    assert "vllm serve" not in card.text and not (tmp_path / "out" / "alpha-xpu" / "README.md").exists()

    # the skip must come from the target repo's record: the local outputs are gone
    for name in ("alpha", "beta"):
        for f in (tmp_path / "out" / f"{name}-xpu").iterdir():
            f.unlink()
    hub.reset_counters()
    pushed_before = len(hub.pushed)
    runs.append(r := run_cli("batch", str(manifest), "--push", env=env))
    assert r.returncode == 0, r.stderr
    rep = report_of(report)
    assert [e["repo"] for e in rep["skipped"]] == ["org/alpha", "org/beta"]
    assert all(e["reason"].startswith("hub:dest/") for e in rep["skipped"])
    assert len(hub.pushed) == pushed_before and source_bytes(hub, "org/alpha") == source_bytes(hub, "org/beta") == 0

    written = [run.stdout + run.stderr for run in runs] + [
        p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file()
    ]
    assert not [w for w in written if TOKEN in w]


def test_two_shards_cover_every_repo_exactly_once(hub: FakeHub, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "batch.toml")
    base = hub_env(hub, tmp_path / "hf")
    runs = [
        run_cli("batch", str(manifest), "--num-shards", "2", "--shard-index", "0", env=base),
        run_cli("batch", str(manifest), env={**base, "JOB_COMPLETION_INDEX": "1", "DSV4_NUM_SHARDS": "2"}),
    ]
    assert sorted(r.returncode for r in runs) == [0, 66]  # the broken repo fails in exactly one shard
    planned = [
        p["repo"] for k in (0, 1) for p in report_of(tmp_path / "out" / f"batch-report-{k}-of-2.json")["planned"]
    ]
    assert sorted(planned) == sorted(REPOS) and len(planned) == len(set(planned))


def _sources(n: int) -> list[ManifestEntry]:
    return [ManifestEntry(f"org/m{k:03d}", None, Path(f"m{k}"), None) for k in range(n)]


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8])
def test_select_shard_partitions_deterministically(count: int) -> None:
    sources = _sources(11)
    shards = [select_shard(sources, count, k) for k in range(count)]
    assert sorted(s.key for shard in shards for s in shard) == sorted(s.key for s in sources)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert shards == [
        select_shard(list(reversed(sources)), count, k) for k in range(count)
    ]  # manifest order does not matter


@pytest.mark.parametrize(
    ("options", "env", "expected"),
    [
        ((None, None), {}, (1, 0)),
        ((4, 2), {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2"}, (4, 2)),  # options win
        (
            (None, None),
            {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_COUNT": "3"},
            (3, 1),
        ),
        (
            (None, None),
            {
                "SLURM_ARRAY_TASK_ID": "7",
                "SLURM_ARRAY_TASK_MIN": "1",
                "SLURM_ARRAY_TASK_STEP": "3",
                "SLURM_ARRAY_TASK_COUNT": "4",
            },
            (4, 2),
        ),
        ((3, None), {"JOB_COMPLETION_INDEX": "2"}, (3, 2)),
        ((None, None), {"JOB_COMPLETION_INDEX": "1", "DSV4_NUM_SHARDS": "2"}, (2, 1)),
    ],
)
def test_shard_from_env(options: tuple[int | None, int | None], env: dict[str, str], expected: tuple[int, int]) -> None:
    assert shard_from_env(*options, env=env) == expected


@pytest.mark.parametrize(
    ("options", "env", "words"),
    [
        ((None, None), {"JOB_COMPLETION_INDEX": "0"}, "DSV4_NUM_SHARDS"),
        ((2, None), {}, "--shard-index"),
        ((None, None), {"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "2"}, "SLURM_ARRAY_TASK_ID"),
        ((2, 2), {}, "outside 0..1"),
        # a variable set to what cannot split the manifest: named, never a ZeroDivisionError
        (
            (None, None),
            {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_STEP": "0", "SLURM_ARRAY_TASK_COUNT": "2"},
            "SLURM_ARRAY_TASK_STEP='0' is not a positive integer",
        ),
        (
            (None, None),
            {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "0"},
            "SLURM_ARRAY_TASK_COUNT='0' is not a positive integer",
        ),
        (
            (None, None),
            {
                "SLURM_ARRAY_TASK_ID": "2",
                "SLURM_ARRAY_TASK_MIN": "1",
                "SLURM_ARRAY_TASK_STEP": "2",
                "SLURM_ARRAY_TASK_COUNT": "2",
            },
            "SLURM_ARRAY_TASK_ID=2 is not in the array",
        ),
        (
            (None, None),
            {"JOB_COMPLETION_INDEX": "0", "DSV4_NUM_SHARDS": "abc"},
            "DSV4_NUM_SHARDS='abc' is not a positive integer",
        ),
        (
            (None, None),
            {"JOB_COMPLETION_INDEX": "-1", "DSV4_NUM_SHARDS": "2"},
            "JOB_COMPLETION_INDEX='-1' is not a non-negative integer",
        ),
    ],
)
def test_shard_from_env_refuses_what_it_cannot_split_on(
    options: tuple[int | None, int | None], env: dict[str, str], words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        shard_from_env(*options, env=env)


@pytest.mark.parametrize(("var", "value"), [("DSV4_NUM_SHARDS", "abc"), ("DSV4_NUM_SHARDS", "0")])
def test_the_batch_command_names_the_variable_it_cannot_use(
    var: str, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(var, value)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")
    code, _, err = run_main(monkeypatch, capsys, "batch", write_manifest(tmp_path / "batch.toml"))
    assert code == 2 and err.startswith(f"error: {var}={value!r} is not a positive integer") and err.count("\n") == 1


def test_manifest_forms_and_outputs(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text(
        'sources = ["org/a", "org/b@v2", {repo = "org/c", revision = "abc123"}]\n'
        '[output]\nname = "{org}-{name}-{revision}"\nrepo = "me/{name}-{target}"\nprivate = true\n'
        "[options]\nmax_shard_size = 1_000_000\n"
    )
    m = load_manifest(path)
    assert [(s.repo, s.revision) for s in m.sources] == [("org/a", None), ("org/b", "v2"), ("org/c", "abc123")]
    assert [s.output for s in m.sources] == [
        tmp_path / "converted" / n for n in ("org-a-main", "org-b-v2", "org-c-abc123")
    ]
    assert [s.push_repo for s in m.sources] == ["me/a-xpu", "me/b-xpu", "me/c-xpu"]
    assert (m.target, m.private, m.max_shard_size, m.check) == ("xpu", True, 1_000_000, True)
    assert load_manifest(path, tmp_path / "elsewhere").sources[0].output == tmp_path / "elsewhere" / "org-a-main"


def test_a_manifest_without_target_takes_the_registry_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default is the target file saying `default = true` (mapping.targets.default_target), not a literal."""
    path = tmp_path / "m.toml"
    path.write_text('sources = ["org/a"]\n[output]\nrepo = "me/{name}-{target}"\n')
    monkeypatch.setattr("dsv4.convert.batch.manifest.default_target", lambda: "draft")
    m = load_manifest(path)
    assert (m.target, m.sources[0].push_repo) == ("draft", "me/a-draft")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('sources = ["org/a"]\ncolour = "red"\n', "unknown key 'colour'"),
        ("sources = []\n", "non-empty"),
        ('sources = ["org/a", "org/a"]\n', "listed twice"),
        ('sources = ["not a repo"]\n', "sources[0]"),
        ('sources = ["org/a"]\n[output]\nname = "{nmae}"\n', "placeholders are"),
        ('sources = ["org/a@v1", "org/a@v2"]\n', "tell them apart in the template"),
        ('sources = ["org/a"]\n[output]\nrepo = "{name}"\n', "not a repo id"),
        # was "5GB", refused until issue 19 item 7: the manifest follows --max-shard-size's rule
        ('sources = ["org/a"]\n[options]\nmax_shard_size = "infGB"\n', "max_shard_size"),
        ('sources = ["org/a"]\n[options]\nmax_shard_size = 1.5\n', "max_shard_size"),
        ("sources = [", "not valid TOML"),
    ],
)
def test_manifest_errors_name_file_and_key(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "m.toml"
    path.write_text(text)
    with pytest.raises(HubError) as err:
        load_manifest(path)
    assert err.value.kind == "bad_manifest"
    assert words in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("value", "size"), [('"5GB"', 5 * 10**9), ('"2GiB"', 2 * 2**30), ("1_000_000", 1_000_000)])
def test_manifest_max_shard_size_follows_the_options_rule(tmp_path: Path, value: str, size: int) -> None:
    """options.max_shard_size takes what --max-shard-size takes (convert/sizes.py), as docs/batch.md says."""
    path = tmp_path / "m.toml"
    path.write_text(f'sources = ["org/a"]\n[options]\nmax_shard_size = {value}\n')
    assert load_manifest(path).max_shard_size == size


def test_push_without_a_target_repo_template_is_refused_before_any_work(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "batch.toml", sources=("org/a",))
    r = run_cli(
        "batch",
        str(manifest),
        "--push",
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )
    assert r.returncode == 64 and "output.repo" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_run_check_uses_the_checker_where_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Report:
        def __init__(self, error: Exception | None):
            self.error = error

        def raise_for_failure(self) -> None:
            if self.error is not None:
                raise self.error

        def summary(self) -> str:
            return "fine"

    checked: list[Path] = []
    fake = types.ModuleType("dsv4.convert.check.run")
    fake.run_checks = lambda path, error=None: checked.append(path) or Report(error)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dsv4.convert.check.run", fake)
    assert run_check(tmp_path) == "fine" and checked == [tmp_path]

    failure = CheckError(f"{tmp_path}/config.json: no conversion record", kind="config_check")
    fake.run_checks = lambda path: Report(failure)  # type: ignore[attr-defined]
    with pytest.raises(CheckError) as raised:
        run_check(tmp_path)
    assert raised.value.kind == "config_check"

    monkeypatch.setitem(sys.modules, "dsv4.convert.check.run", None)  # not installed
    assert run_check(tmp_path) == "unavailable"


def test_a_second_run_on_the_same_report_is_refused_and_the_first_runs_report_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    from dsv4.convert.output import hold_lock

    manifest = write_manifest(tmp_path / "batch.toml")
    report = tmp_path / "out" / "batch-report.json"
    report.parent.mkdir()
    report.write_text('{"the first run": "its report"}\n')
    lock = report.parent / ".batch-report.json.lock"  # the report's lock, as a batch run on this out-dir takes it
    with held_by_a_thread(lambda: hold_lock(report, lock, report.parent / ".batch-report.json.lock.owner")):
        code, _, err = run_main(monkeypatch, capsys, "batch", manifest)
    assert code == 47
    assert (
        err
        == f"error: {report}: locked by another run (pid {os.getpid()} on host {socket.gethostname()}, running since "
        + err.split("running since ")[1]
    )
    assert err.endswith("); nothing was changed; pass --report FILE to write this run's report elsewhere\n")
    assert report.read_text() == '{"the first run": "its report"}\n' and not (tmp_path / "out" / "alpha-xpu").exists()


def test_a_push_whose_answer_is_lost_lands_once(native: Path, hub: FakeHub, tmp_path: Path) -> None:
    """issue 18 item 8: the commit lands, its answer never comes; huggingface_hub retries the
    request. One commit must land, and the batch must report it as pushed."""
    manifest = write_manifest(tmp_path / "batch.toml", repo_template="dest/{name}-{target}", sources=REPOS[:1])
    hub.faults.append(Fault(on("commit"), reset=True, after=True))
    r = run_cli("batch", str(manifest), "--push", env=hub_env(hub, tmp_path / "hf", HF_TOKEN=TOKEN))
    assert r.returncode == 0, r.stderr
    assert hub.faults[0].times == 0  # the answer was lost
    assert len(hub.pushed) == 1  # was 2: the retried request made a second, identical commit
    rep = report_of(tmp_path / "out" / "batch-report.json")
    assert rep["converted"][0]["pushed"]["commit"] == hub.pushed[0]["oid"] == hub.repos["dest/alpha-xpu"].refs["main"]


def test_a_failed_push_whose_read_back_fails_too_is_reported_as_the_push_failure(
    native: Path, hub: FakeHub, tmp_path: Path
) -> None:
    """Issue 28: after a failed push the head is read to see whether the commit landed anyway; that
    read failing as well was reported (60, hub_request_failed) instead of the push's own error (65)."""
    manifest = write_manifest(tmp_path / "batch.toml", repo_template="dest/{name}-{target}", sources=REPOS[:1])
    refused = Fault(on("commit"), status=403)
    read_back = Fault(  # the head read after the push, not the one before it
        lambda m, repo, route, p, rng: route == "info" and repo == "dest/alpha-xpu" and refused.times == 0,
        status=429,
        headers={"Retry-After": "3600"},  # beyond the cap: fails at once, not after the retries
    )
    hub.faults += [refused, read_back]
    r = run_cli("batch", str(manifest), "--push", env=hub_env(hub, tmp_path / "hf", HF_TOKEN=TOKEN))
    assert r.returncode == 66, r.stderr
    assert refused.times == read_back.times == 0  # both fired
    [failed] = report_of(tmp_path / "out" / "batch-report.json")["failed"]
    assert (failed["exit_code"], failed["kind"]) == (65, "push_failed"), failed
    assert failed["reason"].startswith("hub:dest/alpha-xpu") and "403" in failed["reason"], failed
    assert hub.pushed == []


DRAFTERS = {"org/mtp": "draft", "org/spark": "draft_dspark"}  # source repo -> the table its drafter takes


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny MTP checkpoint and a tiny DSpark (0731) one, and each one's local --target draft."""
    root = tmp_path_factory.mktemp("drafters")
    natives = {
        "mtp": write_checkpoint(root / "mtp", preset="tiny", main_layers="all", seed=3),
        "spark": write_checkpoint(root / "spark", preset="tiny", variant="dspark", main_layers="all", seed=4),
    }
    for name, native in natives.items():
        convert(native, root / f"{name}-draft-local", target="draft")
    return {**natives, **{f"{n}-draft-local": root / f"{n}-draft-local" for n in natives}}


@pytest.fixture
def drafter_hub(drafters: dict[str, Path]) -> Iterator[FakeHub]:
    with FakeHub(token=TOKEN) as h:
        for repo in DRAFTERS:
            h.commit_dir(repo, drafters[repo.split("/")[1]])
        yield h


@pytest.mark.slow
def test_batch_target_draft_converts_each_drafter_once_and_names_its_table(
    drafters: dict[str, Path], drafter_hub: FakeHub, tmp_path: Path
) -> None:
    manifest = write_manifest(tmp_path / "batch.toml", sources=tuple(DRAFTERS), check=True, target="draft")
    report = tmp_path / "out" / "batch-report.json"
    env = hub_env(drafter_hub, tmp_path / "hf")

    r = run_cli("batch", str(manifest), env=env)
    assert r.returncode == 0, r.stderr
    rep = report_of(report)
    assert rep["target"] == "draft" and rep["tables"] == {"draft": "1", "draft_dspark": "1", "draft_dspark_v41": "1"}
    assert [(e["repo"], e["table"]) for e in rep["converted"]] == list(DRAFTERS.items())
    assert all(
        e["check"] not in ("disabled", "unavailable") for e in rep["converted"]
    )  # check passed on each draft directory
    for repo in DRAFTERS:
        name = repo.split("/")[1]
        out, local = tmp_path / "out" / f"{name}-draft", drafters[f"{name}-draft-local"]
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in local.iterdir())
        for f in ("config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors"):
            assert (out / f).read_bytes() == (local / f).read_bytes(), (
                f
            )  # the same directory as `convert --target draft`

    drafter_hub.reset_counters()
    r = run_cli("batch", str(manifest), env=env)
    assert r.returncode == 0, r.stderr
    rep = report_of(report)
    assert rep["converted"] == [] and [e["repo"] for e in rep["skipped"]] == list(DRAFTERS)
    for e, table in zip(rep["skipped"], DRAFTERS.values(), strict=True):
        assert "already records source commit" in e["reason"] and f"table {table} v1" in e["reason"]
    assert all(source_bytes(drafter_hub, repo) == 0 for repo in DRAFTERS)


def test_push_of_a_draft_publishes_a_ready_to_serve_card_in_the_same_commit(
    drafter_hub: FakeHub, tmp_path: Path
) -> None:
    manifest = write_manifest(
        tmp_path / "batch.toml", repo_template="dest/{name}-{target}", sources=tuple(DRAFTERS), target="draft"
    )
    r = run_cli("batch", str(manifest), "--push", env=hub_env(drafter_hub, tmp_path / "hf", HF_TOKEN=TOKEN))
    assert r.returncode == 0, r.stderr
    converted = {e["repo"]: e for e in report_of(tmp_path / "out" / "batch-report.json")["converted"]}
    method = {
        "org/mtp": ('{"method":"mtp","model":"dest/mtp-draft","num_speculative_tokens":1}', "NEXTN"),
        "org/spark": ('{"method":"dspark","model":"dest/spark-draft"}', "DSPARK"),
    }
    for source, table in DRAFTERS.items():
        name, entry = source.split("/")[1], converted[source]
        dest, commit = f"dest/{name}-draft", entry["commit"]
        (pushed,) = [p for p in drafter_hub.pushed if p["repo"] == dest]
        assert {"README.md", "conversion.json", "config.json", "model-00001-of-00001.safetensors"} <= set(
            pushed["files"]
        )  # one commit
        assert entry["pushed"]["commit"] == pushed["oid"]
        assert not (
            tmp_path / "out" / f"{name}-draft" / "README.md"
        ).exists()  # the local OUT stays the converter's output

        card = ModelCard(drafter_hub.files(dest)["README.md"].decode())
        drafter = "dspark" if table == "draft_dspark" else "mtp"
        assert (card.data.base_model, card.data.library_name) == (source, "vllm")
        assert {"deepseek_v4", drafter, "speculative-decoding", "draft-model"} <= set(card.data.tags)
        speculative_config, algorithm = method[source]
        assert f"vllm serve {source} --speculative-config '{speculative_config}'" in card.text
        assert (
            f"python -m sglang.launch_server --model-path {source} --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path {dest}" in card.text
        )
        assert f"at commit `{commit}`" in card.text and f"table `{table}` version 1" in card.text


# --- batch manifests ----------------------------------------------------------------------------
VALID_MANIFEST = """\
target = "xpu"
sources = [
  "deepseek-ai/DeepSeek-V4-Flash",
  "deepseek-ai/DeepSeek-V4-Pro@main",
  { repo = "deepseek-ai/DeepSeek-V4-Flash-Base", revision = "0123abc" },
]

[output]
dir = "converted"
name = "{name}-{target}"
repo = "my-org/{name}-MTP-{target}"
private = true

[options]
max_shard_size = 5_000_000_000
check = true
"""


def toml_value(value: Any) -> str:
    """`value` as a TOML value (inline tables and arrays)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


manifest_words = st.sampled_from(
    [
        "org/a",
        "org/b@v2",
        "org/a@",
        "@v1",
        "a/b/c",
        "org/a@../x",
        "{name}-{target}",
        "{org}-{revision}",
        "{name:>99999999}",
        "{name.upper}",
        "{org.x}",
        "{0}",
        "{",
        "..",
        ".",
        "x/y",
        "xpu",
        "../../x",
        "",
        " ",
    ]
)


manifest_values = st.recursive(
    manifest_words
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=10)
    | st.sampled_from([5_000_000_000, 0, -1, 2**63, 2**63 - 1]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["repo", "revision", "dir", "name", "x"]) | st.text(max_size=6), inner, max_size=3
        )
    ),
    max_leaves=10,
)


manifests = st.fixed_dictionaries(
    {},
    optional={
        # mostly plausible values, so that some manifests get past the first checks
        "target": st.just("xpu") | manifest_values,
        "sources": st.lists(
            st.sampled_from(["org/a", "org/b@v2", "org/a@v3", {"repo": "org/c", "revision": "abc"}]) | manifest_values,
            max_size=4,
        )
        | manifest_values,
        "output": st.dictionaries(
            st.sampled_from(["dir", "name", "repo", "private", "colour"]), manifest_values, max_size=4
        )
        | manifest_values,
        "options": st.dictionaries(
            st.sampled_from(["max_shard_size", "check", "speed"]),
            st.sampled_from([1, 10**9, True]) | manifest_values,
            max_size=2,
        )
        | manifest_values,
        "extra": manifest_values,
    },
)


def load(tmp_path_factory: pytest.TempPathFactory, text: str) -> Manifest | None:
    path = tmp_path_factory.getbasetemp() / "fuzz-manifest.toml"
    path.write_text(text, encoding="utf-8")
    try:
        manifest = load_manifest(path)
    except Exception as exc:
        one_line_own_error(exc)
        return None
    assert_manifest_is_sound(manifest)
    outcome("accepted")
    return manifest


def assert_manifest_is_sound(m: Manifest) -> None:
    assert isinstance(m.target, str) and m.sources
    assert isinstance(m.max_shard_size, int) and 0 < m.max_shard_size <= MAX_SHARD_SIZE
    assert [s.key for s in m.sources] == sorted({s.key for s in m.sources})
    for s in m.sources:
        assert s.output.parent == m.out_dir and s.output.name not in ("", ".", "..")
        assert s.push_repo is None or s.push_repo.count("/") == 1


@pytest.mark.slow
@FUZZ
@given(manifest=manifests)
def test_random_manifests(tmp_path_factory: pytest.TempPathFactory, manifest: dict[str, Any]) -> None:
    load(tmp_path_factory, "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in manifest.items()))


@FUZZ
@given(data=st.data())
def test_mutated_manifests(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    load(tmp_path_factory, mutate_text(VALID_MANIFEST, data))


# values near the valid ones: templates with format tricks, sizes at the edges, odd sources
PLAUSIBLE = [
    "{name}-{revision}",
    "{org}_{name}",
    "{name.upper}",
    "{org.x}",
    "{name:>99999999}",
    "{name!r}",
    "{0}",
    "{{name}}",
    "x/{name}",
    "org/{name}",
    1,
    2**63 - 1,
    2**63,
    0,
    True,
    "org/a@v9",
    {"repo": "org/d"},
    {"repo": "org/e@x"},
    [],
]


@FUZZ
@given(data=st.data())
def test_manifests_with_values_replaced(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    manifest = tomllib.loads(VALID_MANIFEST)
    for _ in range(data.draw(st.integers(1, 2), label="replacements")):
        section = data.draw(st.sampled_from([None, "output", "options", "sources"]), label="section")
        value = data.draw(st.sampled_from(PLAUSIBLE) | manifest_values, label="value")
        if section is None:
            manifest[data.draw(st.sampled_from(["target", "sources", "output", "options", "x"]), label="key")] = value
        elif section == "sources" and isinstance(manifest.get("sources"), list) and manifest["sources"]:
            manifest["sources"][data.draw(st.integers(0, len(manifest["sources"]) - 1), label="at")] = value
        elif isinstance(manifest.get(section), dict):
            keys = ["dir", "name", "repo", "private"] if section == "output" else ["max_shard_size", "check"]
            manifest[section][data.draw(st.sampled_from(keys), label="key")] = value
    load(tmp_path_factory, "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in manifest.items()))


def test_the_valid_manifest_the_mutations_start_from_loads(tmp_path_factory: pytest.TempPathFactory) -> None:
    manifest = load(tmp_path_factory, VALID_MANIFEST)
    assert manifest is not None and len(manifest.sources) == 3


@pytest.mark.parametrize("template", ["{name.x}", "{name.upper}", "{name:>99999999}", "{name!r}", "{0}"])
def test_manifest_templates_take_bare_placeholders_only(template: str, tmp_path: Path) -> None:
    """str.format would run attribute access and a gigabyte of padding from the manifest."""
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'sources = ["org/a"]\n[output]\nname = "{template}"\n')
    with pytest.raises(HubError, match=r"output\.name: bad template .* is not a placeholder") as raised:
        load_manifest(manifest)
    assert raised.value.kind == "bad_manifest"


# --- a manifest's target is checked with the rest of the manifest -------------------------
@pytest.mark.parametrize("target", ["../x", "nosuch"])
def test_a_manifest_target_that_is_no_installed_table_is_a_bad_manifest(
    target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It failed with exit 20 and a line naming neither the manifest nor its field, or, with
    the default name template, as an output.name of 'b-../x'."""
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'target = "{target}"\nsources = ["org/b"]\n')
    code, line = run_one_line(monkeypatch, capsys, "batch", str(manifest))
    assert code == 64
    # two targets are installed since --target draft
    assert (
        line
        == f"error: {manifest}: target '{target}' is not an installed mapping table (installed: draft, xpu); a table "
        f"is chosen by name, not path"
    )


def test_batch_says_it_takes_hub_repositories_only(tiny_native, tmp_path, monkeypatch, capsys):
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(f'target = "xpu"\nsources = ["{tiny_native}"]\n\n[output]\ndir = "out"\n')
    code, _, err = run_main(monkeypatch, capsys, "batch", manifest)
    assert code == 64 and err.count("\n") == 1, err
    assert "is a local directory; batch takes hub repositories only" in err
