"""Which sources are local directories and which are hub repositories (convert/sources/location.py):
a mistyped local path is refused at once (exit 19) without a network request; `hf://` always
means the hub; a bare org/name that is neither names both readings."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from hubserver import FakeHub, Fault, hub_env, on, run_cli
from inprocess import run_main

from dsv4.convert.sources.location import locate, parse_hub_spec
from dsv4.convert.sources.source import HubSpec
from dsv4.model.errors import CheckpointError


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every attempt to open a connection or resolve a name is recorded and refused."""
    attempts: list[str] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(repr(args[:2]))
        raise OSError("network use in a test that must not reach it")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


@pytest.mark.parametrize(
    "spec", ["does/not/exist", "./typo", "../typo/dir", "/no/such/checkpoint", "org/name/extra@main"]
)
def test_a_path_that_can_only_be_local_and_does_not_exist_exits_19_without_a_request(
    spec: str,
    no_network: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(monkeypatch, capsys, "plan", spec)
    assert (code, out) == (19, "")
    assert err == f"error: {spec}: no such local directory\n"
    assert no_network == []


def test_the_socket_guard_itself_catches_a_hub_request(
    no_network: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The guard above would see a request: a bare org/name is tried on the hub."""
    monkeypatch.setenv("HF_ENDPOINT", "http://hub.invalid")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("dsv4.convert.sources.hub.BACKOFF_S", 0.0)
    code, _, err = run_main(monkeypatch, capsys, "plan", "org/name")
    # one error line, after one warning line per retry (was: one line in all, before a failed
    # connection was retried, issue 18 item 2)
    *waits, line = err.splitlines()
    assert code != 0 and line.startswith("error: ") and all(w.startswith("warning: hub:org/name") for w in waits)
    assert no_network  # it tried


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("hf://org/name", HubSpec("org/name", None, True)),
        ("hf://org/name@refs/pr/1", HubSpec("org/name", "refs/pr/1", True)),
        ("org/name@v1", HubSpec("org/name", "v1", False)),
    ],
)
def test_hub_specs_bare_or_with_the_hf_scheme(
    spec: str, want: HubSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert locate(spec) == want == parse_hub_spec(spec)


def test_an_existing_directory_is_local_even_when_it_reads_like_a_repo_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert locate("org/name") == Path("org/name")
    assert locate("hf://org/name") == HubSpec("org/name", None, True)  # the scheme says hub


def test_a_word_that_is_no_repo_id_is_no_such_local_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"^typo: no such local directory \(nor a hub repo id") as raised:
        locate("typo")
    assert raised.value.kind == "source_not_found"


def test_a_bare_repo_id_the_hub_does_not_have_names_both_readings(tmp_path: Path) -> None:
    with FakeHub() as hub:
        env = hub_env(hub, tmp_path / "hf")
        bare = run_cli("plan", "org/missing", env=env)
        explicit = run_cli("plan", "hf://org/missing", env=env)
    assert bare.returncode == explicit.returncode == 61  # repo_not_found
    assert bare.stderr.startswith(
        "error: org/missing: no such local directory, and as a hub repository: hub:org/missing"
    )
    assert "no such local directory" not in explicit.stderr and "repository not found" in explicit.stderr


def test_a_bare_repo_id_the_hub_fails_to_answer_is_reported_as_the_hub_s_failure_alone(tmp_path: Path) -> None:
    """Issue 28: every hub failure of a bare org/name, a timeout or a rate limit included, was
    prefixed "no such local directory, and as a hub repository", sending the user looking for
    a mistyped path. Only the hub's "no such repository" names both readings."""
    with FakeHub() as hub:
        hub.commit("org/present", {"config.json": b"{}"})
        hub.faults.append(Fault(on("info"), status=429, headers={"Retry-After": "3600"}))  # fails at once
        done = run_cli("plan", "org/present", env=hub_env(hub, tmp_path / "hf"))
    assert done.returncode == 60, done.stderr  # hub_request_failed
    assert done.stderr.startswith("error: hub:org/present@default branch: HTTP 429"), done.stderr
    assert "no such local directory" not in done.stderr
