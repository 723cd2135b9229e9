"""The command line refuses bad input with its documented exit code and one line on stderr,
never a Python traceback: shard sizes, table names, malformed records in `check`, a JUnit
report into a missing folder, and whatever else escapes (the last-resort handler)."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from inprocess import run_main

from dsv4.convert import cli as cli_module
from dsv4.convert.batch import load_manifest
from dsv4.convert.check import run_checks
from dsv4.convert.errors import HubError
from dsv4.convert.pipeline import convert
from dsv4.convert.sizes import shard_size
from dsv4.mapping.errors import TableError
from dsv4.mapping.table import TABLE_DIR, installed_targets, load_table

INDEX = "model.safetensors.index.json"
RECORD = "conversion.json"


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def converted(tiny_native: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("robust") / "xpu"
    convert(tiny_native, out)
    return out


@pytest.fixture
def out(converted: Path, tmp_path: Path) -> Path:
    """A fresh copy of the converted checkpoint, for a test to break."""
    return Path(shutil.copytree(converted, tmp_path / "xpu"))


def edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


# --- --max-shard-size and the manifest's max_shard_size: one rule ---------------------------
REFUSED_SIZES = ["0", "-1", "infGB", "nanGB", "1e400", "-0GB", "1.5", "5XB", ""]


@pytest.mark.parametrize("size", REFUSED_SIZES)
def test_convert_refuses_a_size_that_is_not_a_positive_whole_number_of_bytes(
    size: str, tiny_native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(
        monkeypatch, capsys, str(tiny_native), str(tmp_path / "out"), "--max-shard-size", size, "-q"
    )
    line = one_error_line(err)
    assert code == 2
    assert "'--max-shard-size'" in line and repr(size) in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [0, -1, 2**63])
def test_convert_and_batch_refuse_the_same_size_for_the_same_reason(
    value: int, tiny_native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError) as rule:
        shard_size(value)
    reason = str(rule.value).split(" ", 1)[1]  # after the value, which the command line quotes as text
    code, _, err = run_main(
        monkeypatch, capsys, str(tiny_native), str(tmp_path / "out"), "--max-shard-size", str(value), "-q"
    )
    assert code == 2 and reason in one_error_line(err)
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'sources = ["org/a"]\n[options]\nmax_shard_size = {value}\n')
    with pytest.raises(HubError) as refused:
        load_manifest(manifest)
    assert refused.value.kind == "bad_manifest"
    assert "options.max_shard_size" in str(refused.value) and reason in str(refused.value)


# '"5GB"' was here: refused until issue 19 item 7 made the manifest take --max-shard-size's
# text forms (tests/test_batch.py::test_manifest_max_shard_size_follows_the_options_rule)
@pytest.mark.parametrize("toml_value", ["inf", "nan", "1e400", "5.0", '"infGB"', "true"])
def test_batch_refuses_a_shard_size_that_is_no_integer(toml_value: str, tmp_path: Path) -> None:
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'sources = ["org/a"]\n[options]\nmax_shard_size = {toml_value}\n')
    with pytest.raises(HubError, match=r"options\.max_shard_size") as raised:
        load_manifest(manifest)
    assert raised.value.kind == "bad_manifest"


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("5GB", 5 * 10**9),
        ("500mb", 5 * 10**8),
        ("2GiB", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("1000000", 10**6),
        ("1e9", 10**9),
        ("0.5KB", 500),
        ("300 KB", 300_000),
        (7, 7),
    ],
)
def test_sizes_in_bytes_and_units(text: str | int, size: int) -> None:
    assert shard_size(text) == size


def test_max_shard_size_with_a_unit_cuts_the_output_into_shards(
    tiny_native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(
        monkeypatch, capsys, str(tiny_native), str(tmp_path / "out"), "--max-shard-size", "300KB", "-q"
    )
    assert code == 0, err
    shards = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(shards) > 1 and all((tmp_path / "out" / s).stat().st_size < 300_000 + 100_000 for s in shards)


# --- --target is a name, never a path ---------------------------------------------------------
@pytest.fixture
def table_copy(tmp_path: Path) -> Path:
    """A valid table outside the package: loading it would work, so only the name rule refuses it."""
    path = tmp_path / "elsewhere" / "evil.toml"
    path.parent.mkdir()
    shutil.copy(TABLE_DIR / "xpu.toml", path)
    return path


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
            TableError, match=r"installed: draft, draft_dspark, xpu, xpu_dspark"
        ):  # the draft tables are installed too
            load_table(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("table", ["path", 5, ["xpu"]])
def test_check_refuses_a_config_recording_a_table_that_is_no_installed_name(
    table: object, out: Path, table_copy: Path
) -> None:
    edit_json(
        out / "config.json",
        lambda c: c["dsv4_convert"].update(table=str(table_copy.with_suffix("")) if table == "path" else table),
    )
    report = run_checks(out, fast=True)
    failed = report.failures[0]
    assert (failed.name, report.exit_code) == ("config", 75), report.summary()
    assert (
        "dsv4_convert.table" in failed.reason and "installed: draft, draft_dspark, xpu, xpu_dspark" in failed.reason
    )  # the draft tables are installed too


# --- check on malformed records ----------------------------------------------------------------
def first_tensor(record: dict) -> str:
    return sorted(record["tensors"])[0]


def record_entry_is_a_number(out: Path) -> None:
    edit_json(out / RECORD, lambda r: r["tensors"].update({first_tensor(r): 5}))


def record_tensors_is_a_list(out: Path) -> None:
    edit_json(out / RECORD, lambda r: r.update(tensors=list(r["tensors"])))


def record_nbytes_is_a_string(out: Path) -> None:
    edit_json(
        out / RECORD,
        lambda r: r["tensors"][first_tensor(r)].update(nbytes=str(r["tensors"][first_tensor(r)]["nbytes"])),
    )


def record_file_is_a_number(out: Path) -> None:
    edit_json(out / RECORD, lambda r: r["tensors"][first_tensor(r)].update(file=1))


def record_sha256_is_a_number(out: Path) -> None:
    edit_json(out / RECORD, lambda r: r["tensors"][first_tensor(r)].update(sha256=5))


def record_sha256_is_uppercase(out: Path) -> None:
    edit_json(
        out / RECORD,
        lambda r: r["tensors"][first_tensor(r)].update(sha256=r["tensors"][first_tensor(r)]["sha256"].upper()),
    )


def record_nested_100000_deep(out: Path) -> None:
    (out / RECORD).write_text("[" * 100_000 + "]" * 100_000)


def record_with_a_duplicate_key(out: Path) -> None:
    # json.loads keeps the last "tensors": a record whose first copy lies would pass unread
    text = (out / RECORD).read_text()
    (out / RECORD).write_text('{"tensors": {"x": 1},' + text.lstrip()[1:])


def record_with_a_huge_integer(out: Path) -> None:
    text = (out / RECORD).read_text()
    (out / RECORD).write_text(text.replace('"nbytes": ', '"nbytes": ' + "9" * 5000, 1))


def index_metadata_is_a_list(out: Path) -> None:
    edit_json(out / INDEX, lambda i: i.update(metadata=[1]))


def index_total_size_is_a_string(out: Path) -> None:
    edit_json(out / INDEX, lambda i: i["metadata"].update(total_size=str(i["metadata"]["total_size"])))


def index_total_size_is_true(out: Path) -> None:
    edit_json(out / INDEX, lambda i: i["metadata"].update(total_size=True))


def index_weight_map_values_are_numbers(out: Path) -> None:
    edit_json(out / INDEX, lambda i: i.update(weight_map={k: 5 for k in i["weight_map"]}))


def config_quantization_is_a_list(out: Path) -> None:
    edit_json(out / "config.json", lambda c: c.update(quantization_config=[1]))


@pytest.mark.parametrize(
    ("breakage", "codes", "named"),
    [
        (record_entry_is_a_number, {73}, "is 5, not an object"),
        (record_tensors_is_a_list, {73}, "no 'tensors' object"),
        (record_nbytes_is_a_string, {73}, "].nbytes is '"),
        (record_file_is_a_number, {73}, "].file is 1, not a file name"),
        (record_sha256_is_a_number, {74}, ".sha256 is 5, not 64 lowercase hex digits"),
        (record_sha256_is_uppercase, {74}, "not 64 lowercase hex digits"),
        (record_nested_100000_deep, {73}, "nested more than"),
        (record_with_a_duplicate_key, {73}, "duplicate key 'tensors'"),
        (record_with_a_huge_integer, {73}, "integer of 50"),
        # the index check reads the index strictly (metadata and total_size types) where the
        # inventory's reader does so; otherwise the sizes check refuses it: one of the two
        (index_metadata_is_a_list, {71, 73}, "metadata"),
        (index_total_size_is_a_string, {71, 73}, "total_size"),
        (index_total_size_is_true, {71, 73}, "total_size"),
        (index_weight_map_values_are_numbers, {71}, INDEX),
        (
            config_quantization_is_a_list,
            {75},
            "quantization_config",
        ),  # (h3's config loader may refuse it first: the same code)
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_a_malformed_record_fails_its_own_check_in_one_line(
    breakage: Callable[[Path], None],
    codes: set[int],
    named: str,
    out: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    breakage(out)
    code, stdout, err = run_main(monkeypatch, capsys, "check", str(out))
    line = one_error_line(err)
    assert code in codes, line
    assert line.startswith("error: ") and named in line
    assert f"FAILED (exit {code})" in stdout  # the report is printed before the error


# --- check --junit -----------------------------------------------------------------------------
def test_junit_into_a_missing_folder_creates_it(
    out: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    junit = tmp_path / "reports" / "ci" / "check.xml"
    code, stdout, err = run_main(monkeypatch, capsys, "check", str(out), "--fast", "--junit", str(junit))
    assert (code, err) == (0, "")
    assert "OK: 6 passed" in stdout
    assert junit.read_text().startswith("<?xml") and 'name="checksums"' in junit.read_text()


@pytest.mark.parametrize("broken", [False, True])
def test_junit_that_cannot_be_written_fails_after_the_report_in_one_line(
    broken: bool, out: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if broken:
        record_sha256_is_a_number(out)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, stdout, err = run_main(monkeypatch, capsys, "check", str(out), "--junit", str(blocker / "check.xml"))
    line = one_error_line(err)
    assert code == 42
    assert line.startswith(
        f"error: {blocker / 'check.xml'}: cannot write the JUnit report ({blocker} is not a directory)"
    )
    assert ("FAILED (exit 74: checksums)" if broken else "all checks passed") in line
    assert ("FAILED (exit 74)" if broken else "OK: 7 passed") in stdout  # the whole report came first


# --- the last-resort handler ---------------------------------------------------------------------
def raising(exc: BaseException) -> Callable[..., object]:
    def convert(*args: object, **kwargs: object) -> object:
        raise exc

    return convert


def test_an_unexpected_exception_is_one_line_asking_for_a_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("dsv4.convert.pipeline.convert", raising(RuntimeError("the unexpected\nsecond line")))
    monkeypatch.delenv(cli_module.TRACEBACK_ENV, raising=False)
    code, _, err = run_main(monkeypatch, capsys, str(tmp_path / "in"), str(tmp_path / "out"))
    line = one_error_line(err)
    assert code == 1
    assert line.startswith("internal error: RuntimeError: the unexpected (please report")
    assert "DSV4_TRACEBACK=1" in line


def test_the_traceback_env_var_lets_developers_see_the_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dsv4.convert.pipeline.convert", raising(RuntimeError("the unexpected")))
    monkeypatch.setenv(cli_module.TRACEBACK_ENV, "1")
    monkeypatch.setattr(sys, "argv", ["convert-dsv4", str(tmp_path / "in"), str(tmp_path / "out")])
    with pytest.raises(RuntimeError, match="the unexpected"):
        cli_module.main()


def test_an_unclassified_os_error_is_one_line_with_path_and_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        "dsv4.convert.pipeline.convert", raising(PermissionError(13, "Permission denied", "/data/out/.out.partial"))
    )
    monkeypatch.delenv(cli_module.TRACEBACK_ENV, raising=False)
    code, _, err = run_main(monkeypatch, capsys, str(tmp_path / "in"), str(tmp_path / "out"))
    assert (code, one_error_line(err)) == (1, "error: /data/out/.out.partial: Permission denied")


def test_ctrl_c_exits_130_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("dsv4.convert.pipeline.convert", raising(KeyboardInterrupt()))
    code, _, err = run_main(monkeypatch, capsys, str(tmp_path / "in"), str(tmp_path / "out"))
    assert (code, one_error_line(err)) == (130, "interrupted")


def test_an_error_message_quoting_a_newline_stays_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        "dsv4.convert.pipeline.convert", raising(TableError("x.toml: tensor 'a\nb' is odd", kind="malformed_table"))
    )
    code, _, err = run_main(monkeypatch, capsys, str(tmp_path / "in"), str(tmp_path / "out"))
    assert (code, one_error_line(err)) == (20, "error: x.toml: tensor 'a\\nb' is odd")


# --- hostile file-system states reach one line, whatever code the owner of that path gives ----
def test_outputs_below_a_file_end_in_one_line(
    tiny_native: Path, out: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    manifest = tmp_path / "m.toml"
    manifest.write_text('sources = ["org/a"]\n')
    monkeypatch.setattr(
        "dsv4.convert.batch.resolve_commit", raising(HubError("org/a: no such repo", kind="repo_not_found"))
    )  # no network in tests
    for (
        args
    ) in (  # convert's and synth's output checks are other modules' (their codes may change): one line naming the path
        [str(tiny_native), str(blocker / "out"), "-q"],
        ["synth", str(blocker / "native"), "--preset", "tiny"],
    ):
        code, _, err = run_main(monkeypatch, capsys, *args)
        assert code != 0
        assert str(blocker) in one_error_line(err), args
    code, _, err = run_main(monkeypatch, capsys, "batch", str(manifest), "--report", str(blocker / "report.json"))
    assert (code, one_error_line(err)) == (
        42,
        f"error: {blocker / 'report.json'}: cannot write the batch report ({blocker} is not a directory)",
    )


@pytest.mark.parametrize("template", ["{name.x}", "{name.upper}", "{name:>99999999}", "{name!r}", "{0}"])
def test_manifest_templates_take_bare_placeholders_only(template: str, tmp_path: Path) -> None:
    """str.format would run attribute access and a gigabyte of padding from the manifest."""
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'sources = ["org/a"]\n[output]\nname = "{template}"\n')
    with pytest.raises(HubError, match=r"output\.name: bad template .* is not a placeholder") as raised:
        load_manifest(manifest)
    assert raised.value.kind == "bad_manifest"


@pytest.mark.parametrize("command", ["smoke", "check"])
@pytest.mark.parametrize("device", ["nonsense", "cuda:99"])
def test_a_device_this_machine_lacks_is_a_usage_error(
    command: str, device: str, converted: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["smoke", str(converted)] if command == "smoke" else ["check", str(converted), "--smoke"]
    code, out, err = run_main(monkeypatch, capsys, *args, "--device", device)
    line = one_error_line(err)
    assert code == 2 and "'--device'" in line and repr(device) in line
    assert out == ""  # refused before anything ran


def test_no_arguments_prints_the_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(monkeypatch, capsys)
    assert code in (0, 2)  # click 8.1 exits 0 after the help, 8.2+ 2
    assert "convert-dsv4 check OUT" in out + err and "\\n" not in out + err


@pytest.mark.parametrize("record", ["[]", "[" * 100_000, '{"fingerprint": 1, "fingerprint": 2}', "\xff"])
def test_an_out_whose_record_is_malformed_records_nothing(
    record: str, tiny_native: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """read_record: not a strict JSON object means no record, so OUT is a foreign non-empty folder."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / RECORD).write_text(record, encoding="latin-1")
    code, _, err = run_main(monkeypatch, capsys, str(tiny_native), str(tmp_path / "out"), "-q")
    assert code == 41 and "exists and is not empty" in one_error_line(err)
