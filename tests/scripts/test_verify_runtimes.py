"""scripts/verify_runtimes.py: the runtimes' own loaders, cut out of their wheels.

The pass rule is tested with stand-in loaders, so a wrong directory fails whatever the
machine has; the wheels' own loaders run on the wheels in the cache (verify_runtimes.wheel_cache:
DSV4_WHEELS, default ~/.cache/dsv4-convert/wheels). The test command, scripts/test.sh, fetches
them there first (`verify_runtimes.py --fetch-wheels`, pip download --no-deps: an install
step); the tests never download (no network in tests) and never skip: without the wheels
they fail, saying how to fetch them.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dsv4.convert.pipeline import convert
from dsv4.convert.synth import write_checkpoint
from dsv4.mapping.targets import require_target

_SPEC = importlib.util.spec_from_file_location(
    "verify_runtimes", Path(__file__).parents[2] / "scripts" / "verify_runtimes.py"
)
assert _SPEC and _SPEC.loader
vr = importlib.util.module_from_spec(_SPEC)
sys.modules["verify_runtimes"] = vr
_SPEC.loader.exec_module(vr)

WHEELS = vr.wheel_cache()


def write_dir(root: Path, tensors: dict[str, torch.Tensor]) -> Path:
    root.mkdir(parents=True)
    save_file(tensors, root / "model-00001-of-00001.safetensors")
    weight_map = dict.fromkeys(tensors, "model-00001-of-00001.safetensors")
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text("{}")
    return root


# A stand-in runtime: `a.*` loads into parameter A (two shards, in order), `b` into B.
EXPECTED = {"A": torch.arange(8, dtype=torch.int8), "B": torch.ones(3), "SHARED": torch.zeros(2)}
GOOD = {
    "a.0": torch.arange(4, dtype=torch.int8),
    "a.1": torch.arange(4, 8, dtype=torch.int8),
    "b": torch.ones(3),
    "embed": torch.zeros(2),
}


def stand_in_loader(recorder: vr.Recorder) -> object:
    params = {n: vr.RecordingParam(n, recorder) for n in EXPECTED}

    def load(weights: Iterable[tuple[str, torch.Tensor]], _first: bool) -> None:
        for name, tensor in weights:
            if name.startswith("a."):
                params["A"].weight_loader(params["A"], tensor, int(name[2:]))
            elif name == "b":
                params["B"].weight_loader(params["B"], tensor)
            elif name == "boom":
                raise KeyError("no such parameter")

    return load


def report_on(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> vr.Report:
    recorder = vr.Recorder()
    directory = write_dir(tmp_path / "d", tensors)
    return vr.run_loader(
        "stand-in", stand_in_loader(recorder), recorder, directory, EXPECTED, lambda name: name == "embed", {"SHARED"}
    )


def test_a_directory_the_loader_takes_whole_passes(tmp_path: Path) -> None:
    report = report_on(tmp_path, GOOD)
    assert report.passed, report.summary()
    assert report.hit == {"A": "a.0, a.1", "B": "b"}
    assert report.dropped == ["embed"]


@pytest.mark.parametrize(
    ("change", "field", "offender"),
    [
        ({"c": torch.ones(1)}, "skipped", "c"),  # a tensor the loader does not take
        ({"b": torch.full((3,), 2.0)}, "unequal", "B"),  # different bytes
        ({"boom": torch.ones(1)}, "errors", "boom: KeyError: 'no such parameter'"),  # the loader raises
    ],
)
def test_a_wrong_directory_fails_naming_the_offender(tmp_path: Path, change: dict, field: str, offender: str) -> None:
    report = report_on(tmp_path, {**GOOD, **change})
    assert not report.passed
    assert offender in getattr(report, field)


def test_a_parameter_no_tensor_reached_fails(tmp_path: Path) -> None:
    tensors = {k: v for k, v in GOOD.items() if k != "b"}
    report = report_on(tmp_path, tensors)
    assert not report.passed and report.missing == ["B"]


def test_a_shard_loaded_twice_is_an_error(tmp_path: Path) -> None:
    report = report_on(tmp_path, {**GOOD, "a.00": GOOD["a.0"].clone()})  # int("00") == 0: shard 0 again
    assert not report.passed
    assert any("A: loaded twice" in e for e in report.errors)


def test_the_loading_goes_on_after_an_error(tmp_path: Path) -> None:
    # tensors are fed in name order: "a." comes first, and the stand-in raises on it (int(""))
    report = report_on(tmp_path, {**GOOD, "a.": torch.ones(1)})
    assert any(e.startswith("a.: ValueError") for e in report.errors)
    assert report.hit["B"] == "b"


def test_a_loader_failing_before_its_first_tensor_is_one_error_and_every_tensor_skipped(tmp_path: Path) -> None:
    # an older release's loader can fail on the stand-in model before it takes a tensor: a
    # fresh call would fail the same way, so the run stops there
    recorder = vr.Recorder()
    calls = []

    def load(_weights: Iterable[tuple[str, torch.Tensor]], _first: bool) -> None:
        calls.append(1)
        raise AttributeError("no such attribute")

    report = vr.run_loader(
        "stand-in", load, recorder, write_dir(tmp_path / "d", GOOD), EXPECTED, lambda _n: False, set()
    )
    assert len(calls) == 1 and report.errors == ["(before the first tensor): AttributeError: no such attribute"]
    assert sorted(report.skipped) == sorted(GOOD) and not report.passed


def test_cut_runs_the_source_under_its_own_file_and_line() -> None:
    source = (
        "import nothing_of_this_runs\n\nclass M:\n    def other(self):\n        pass\n\n"
        "    def load(self):\n        raise ValueError(self.name)\n"
    )
    ns: dict = {}
    vr.cut(source, "pkg/model.py", ["M.load"], ns)
    assert not hasattr(ns["M"], "other")
    m = ns["M"]()
    m.name = "x"
    with pytest.raises(ValueError) as info:
        m.load()
    frame = info.traceback[-1]
    assert (str(frame.path), frame.lineno + 1) == ("pkg/model.py", 8)


def test_cut_refuses_a_name_the_file_does_not_have() -> None:
    with pytest.raises(vr.UsageError, match="pkg/model.py: not found in the wheel: M.gone"):
        vr.cut("class M:\n    pass\n", "pkg/model.py", ["M.gone"], {})


# --- the wheels' own loaders (only where the wheels are already cached) -------------------


@pytest.fixture(scope="module")
def wheels() -> Path:
    """The cache holding the pinned wheels and the newest proven ones; without them the runtime
    tests fail (never skip)."""
    wanted = sorted({f"{p}=={v}" for versions in (vr.PINNED, vr.NEWEST) for p, v in versions.items()})
    if not (vr.wheels_cached(WHEELS) and vr.wheels_cached(WHEELS, vr.NEWEST)):
        pytest.fail(
            f"{' and '.join(wanted)} wheels not in {WHEELS}: scripts/test.sh fetches them "
            "(.venv/bin/python scripts/verify_runtimes.py --fetch-wheels)"
        )
    return WHEELS


def test_the_wheel_cache_is_dsv4_wheels_else_the_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(vr.WHEELS_ENV, str(tmp_path))
    assert vr.wheel_cache() == tmp_path
    monkeypatch.delenv(vr.WHEELS_ENV)
    assert vr.wheel_cache() == vr.DEFAULT_WHEELS == Path.home() / ".cache" / "dsv4-convert" / "wheels"


def test_the_wheels_verified_are_the_releases_the_draft_target_names() -> None:
    # one statement of each version (mapping/targets/draft.toml): a runtime bump there is the wheel run here
    versions = dict(require_target("draft").runtimes)
    assert vr.WHEELS == {"vllm": f"vllm=={versions['vLLM']}", "sglang": f"sglang=={versions['SGLang']}"}


def test_fetch_wheels_takes_cached_wheels_without_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for versions in (vr.PINNED, vr.NEWEST):
        for package, version in versions.items():
            (tmp_path / f"{package}-{version}-py3-none-any.whl").touch()
    monkeypatch.setattr(vr.subprocess, "run", lambda *a, **k: pytest.fail(f"pip ran: {a}"))
    assert vr.main(["--fetch-wheels", "--wheels", str(tmp_path)]) == 0
    assert vr.wheels_cached(tmp_path) and vr.wheels_cached(tmp_path, vr.NEWEST)


def test_the_newest_release_fetched_is_the_newest_a_drafter_range_claims() -> None:
    # scripts/test.sh's --fetch-wheels fetches it, and the tests below run its loaders
    draft = require_target("draft")
    for package, runtime in (("vllm", "vLLM"), ("sglang", "SGLang")):
        claimed = [dict(d.until).get(runtime, dict(draft.runtimes)[runtime]) for d in draft.drafters]
        assert vr.NEWEST[package] == max(claimed, key=lambda v: tuple(map(int, v.split("."))))


def test_fetch_wheels_of_a_release_named_fetches_that_release(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fetched = []

    def pip(cmd: list[str], check: bool) -> object:
        fetched.append(cmd[cmd.index("--quiet") + 1])
        name, version = fetched[-1].split("==")
        (tmp_path / f"{name}-{version}-py3-none-any.whl").touch()
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(vr.subprocess, "run", pip)
    argv = ["--fetch-wheels", "--wheels", str(tmp_path), "--vllm-version", "0.25.1", "--sglang-version", "0.5.15"]
    assert vr.main(argv) == 0
    assert sorted(fetched) == ["sglang==0.5.15", "vllm==0.25.1"]


PRO_0813 = ("pro-0813", "dspark", "tiny-pro")  # (directory, variant, preset)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per drafter: the tiny native checkpoint, its --target draft and --target xpu outputs."""
    root = tmp_path_factory.mktemp("runtimes")
    dirs = {}
    for key, variant, preset in (("instruct", "instruct", "tiny"), ("dspark", "dspark", "tiny"), PRO_0813):
        native = write_checkpoint(root / key / "native", preset=preset, variant=variant, seed=0)
        convert(native, root / key / "draft", target="draft")
        convert(native, root / key / "xpu", target="xpu")
        dirs.update({f"{key}/native": native, f"{key}/draft": root / key / "draft", f"{key}/xpu": root / key / "xpu"})
    return dirs


@pytest.mark.parametrize(
    ("variant", "loaders", "hit"),
    [
        (
            "instruct",
            ["vllm-xpu-mtp", "vllm-nvidia-mtp", "vllm-amd-mtp", "sglang-nextn"],
            39,
        ),  # 41 less embedding and head
        # 98 less embedding and head
        ("dspark", ["vllm-xpu-dspark", "vllm-nvidia-dspark", "vllm-amd-dspark", "sglang-dspark"], 96),
        # a V4-Pro-0813-shaped DSpark drafter (stages at its last three layers, Pro's wider dims) as 0731's
        ("pro-0813", ["vllm-xpu-dspark", "vllm-nvidia-dspark", "vllm-amd-dspark", "sglang-dspark"], 96),
    ],
)
def test_every_runtime_loads_a_draft_directory_whole(
    tiny_dirs: dict[str, Path], wheels: Path, variant: str, loaders: list[str], hit: int
) -> None:
    reports = vr.verify(
        tiny_dirs[f"{variant}/draft"], tiny_dirs[f"{variant}/xpu"], tiny_dirs[f"{variant}/native"], wheels
    )
    assert [r.loader for r in reports] == loaders
    for r in reports:
        assert r.passed, r.summary()
        assert {"embed.weight", "head.weight"} <= set(r.dropped)
    assert len(reports[0].hit) == hit


@pytest.mark.parametrize("variant", ["instruct", "dspark"])
def test_no_runtime_loads_the_xpu_layout(tiny_dirs: dict[str, Path], wheels: Path, variant: str) -> None:
    reports = vr.verify(
        tiny_dirs[f"{variant}/xpu"], tiny_dirs[f"{variant}/xpu"], tiny_dirs[f"{variant}/native"], wheels
    )
    assert not any(r.passed for r in reports)
    if variant == "instruct":  # vLLM prefixes a second mtp_block. (xpu/mtp.py:504-506)
        assert any("KeyError: 'model.layers.2.mtp_block.mtp_block." in e for e in reports[0].errors)
    else:  # vLLM's DSpark loader takes only mtp.* names, silently (xpu/dspark.py:401-403)
        assert len(reports[0].hit) == 0 and len(reports[0].skipped) == 98


def test_a_release_without_the_loader_says_so(
    tiny_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM's XPU DSpark class is in 0.26.0 and later (runtime_loaders/releases.py): asked for
    # 0.25.1, the harness opens that release's wheel (a stand-in here, with no file in it) and
    # reports the loader not in the release, a failure, without reading any file of it
    zipfile.ZipFile(tmp_path / "vllm-0.25.1-py3-none-any.whl", "w").close()
    d = {k.split("/")[1]: str(v) for k, v in tiny_dirs.items() if k.startswith("dspark/")}
    argv = [d["draft"], "--expected", d["xpu"], "--native", d["native"], "--wheels", str(tmp_path)]
    assert vr.main([*argv, "--vllm-version", "0.25.1", "--loader", "vllm-xpu-dspark"]) == 1
    assert "| vllm-xpu-dspark | not in vLLM 0.25.1 |" in capsys.readouterr().out
    assert vr.main([*argv, "--vllm-version", "0.25.1", "--loader", "vllm-xpu-dspark", "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert (report["not_in_release"], report["passed"]) == ("vLLM 0.25.1", False)


def test_the_newest_release_runs_its_own_loaders(tiny_dirs: dict[str, Path], wheels: Path) -> None:
    # vLLM 0.34.0's XPU DSpark class keeps the confidence head that 0.33.0's drops
    # (xpu/dspark.py:112-117, 337-345 in 0.34.0; :406-407 in 0.33.0): one parameter more, fed
    # from the draft's own confidence head, where the pinned release drops it as its table says
    assert vr.NEWEST["vllm"] == "0.34.0"
    dirs = [tiny_dirs[f"dspark/{k}"] for k in ("draft", "xpu", "native")]
    pinned, newest = (
        vr.verify(*dirs, wheels, ["vllm-xpu-dspark"], {**vr.PINNED, "vllm": version})[0]
        for version in (vr.PINNED["vllm"], "0.34.0")
    )
    assert pinned.passed and newest.passed, (pinned.summary(), newest.summary())
    assert set(newest.hit) - set(pinned.hit) == {"model.confidence_head.proj.weight"}
    assert newest.hit["model.confidence_head.proj.weight"] == "mtp.2.confidence_head.proj.weight"
    assert "mtp.2.confidence_head.proj.weight" in pinned.dropped


@pytest.mark.parametrize("variant", ["instruct", "dspark"])
def test_every_loader_of_the_newest_releases_loads_a_draft_directory_whole(
    tiny_dirs: dict[str, Path], wheels: Path, variant: str
) -> None:
    reports = vr.verify(*(tiny_dirs[f"{variant}/{k}"] for k in ("draft", "xpu", "native")), wheels, None, vr.NEWEST)
    assert len(reports) == 4
    for r in reports:
        assert r.passed, r.summary()


def test_serve_with_runs_the_pinned_releases_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the --serve-with builds (vllm_build.py's cuts) are the pinned wheels' alone
    with pytest.raises(SystemExit) as exited:
        vr.main([str(tmp_path), "--serve-with", str(tmp_path), "--native", str(tmp_path), "--vllm-version", "0.34.0"])
    assert exited.value.code == 2
    assert "--serve-with runs the verified releases only (vLLM 0.33.0, SGLang 0.5.23)" in capsys.readouterr().err
