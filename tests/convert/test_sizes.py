"""Shard sizes (convert/sizes.py): `--max-shard-size` and the manifest's max_shard_size take
bytes or decimal and binary units, refuse what is not a positive whole number of bytes with the
same reason, and cut the output into shards below the size."""

from pathlib import Path

import pytest
from inprocess import one_error_line, run_main

from dsv4.convert.batch.manifest import load_manifest
from dsv4.convert.errors import HubError
from dsv4.convert.sizes import shard_size

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
# text forms (tests/convert/test_batch.py::test_manifest_max_shard_size_follows_the_options_rule)
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
