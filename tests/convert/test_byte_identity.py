"""The output bytes of every target, pinned: a refactor that changes any byte a conversion
writes (a tensor, its order, the index, config.json, conversion.json) fails here.

The digests were taken from the tool before the house was rebuilt around registries (the
commit that added this file); a change that means to alter an output updates them and says
why in its commit message.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from edits import tree_digest
from inprocess import run_main

# (synth variant, target) -> {file: sha256} of every file the conversion writes
GOLDEN: dict[tuple[str, str], dict[str, str]] = {
    ("base", "draft"): {
        "config.json": "ec4790a0d0b41f4062a6fa7d67031b3d660e90812f4b9c7c72ecbec5caf73ce1",
        "conversion.json": "364cd350688ce491801713941b2134b876d6439b43afbb246eb2fa01ea178e7d",
        "model-00001-of-00001.safetensors": "057bebe2fd2400b9042bcbf931e254b803a79d1b9d4b766c4ba53e67cb0dfdbf",
        "model.safetensors.index.json": "558e7d6d4bd83d8b481bb978d31ef61e39f024d09095ad6bd377a06f11fce368",
    },
    ("base", "xpu"): {
        "config.json": "b5baf68af31bb568a854e0a6f960d0f55ff77c30da36baa39ad50c2da5e0586a",
        "conversion.json": "cb7177075d78b59173bf0aafd5bfa83602b00fce70a772ad2742c024ddb86f50",
        "model-00001-of-00001.safetensors": "0c684842cd4ecfedd9f2cb1d51ba26c7731363b4360b74e6670adb7b544920ba",
        "model.safetensors.index.json": "4cdcec6538e2e3ef8eb27255c681c7e12dac1ee290eab92f6f1cfa259e817b3f",
    },
    ("dspark", "draft"): {
        "config.json": "ac6668b58dbc4656536abbfc2c1304a704784694fb0060314b3e09e5bf93288d",
        "conversion.json": "6918013708cb12803ed0279ed63fe1289a7339f3897adb7a0978b84d7aa99fe7",
        "model-00001-of-00001.safetensors": "90775bf9f8f656924a08e3c5b8244d2c7cdf9b8c069a8d10cec9d31ccd6fbec6",
        "model.safetensors.index.json": "f27e8ccb1ed4feb42310a6c92ae458666800c65da59fd61fe633a64f80c3ef46",
    },
    ("dspark", "xpu"): {
        "config.json": "74e8e752b0aab186d5e2d3c51220ce5d473963dd3c0f7efc46903c3594659af0",
        "conversion.json": "69193872a2f71fb3058668d8154d96d812c6573e37b2ac93839136898f2301ce",
        "model-00001-of-00001.safetensors": "ea4c25a45ce8853bdf48c024285db8525baceb0133038eae1946ad8a52ff4277",
        "model.safetensors.index.json": "52cc1e93e5d78adbdac19528b1ecf290e79e48c5b1645e6e6f1ed6ef523e176c",
    },
    ("instruct", "draft"): {
        "config.json": "2c579217a8b5489a1809391d4146b729d9ed528f9384d4cfd221ede8ba0b5835",
        "conversion.json": "1fb089f3d0bdccaeb47a3a8e16496b07ac7fe2caa82eeba8be9f1abde43f4825",
        "model-00001-of-00001.safetensors": "78f00942f04bb33dc7cdb22a6b539c3760a3b76ab580748870e26da71f43bad7",
        "model.safetensors.index.json": "d995b26cd60d42a86e170dbd562a579dec257b5a9284ef878833483f61c49259",
    },
    ("instruct", "xpu"): {
        "config.json": "379ac2fc16b675c5690af7120868edccb3b8feb1fac0ddbcea1387dded640714",
        "conversion.json": "620d8ccf899a179667be9cd0a3736fdbdb8382996d8bde981e4a51b60513eef1",
        "model-00001-of-00001.safetensors": "d8bc156b7e50d8a87823affc407651a580dedf50e04aadcd232142f243130bda",
        "model.safetensors.index.json": "06bf8132b7d752dd6900ce6297dd9d2b05919c78404afb93590b51f05d855920",
    },
}


def _stable_digests(out: Path) -> dict[str, str]:
    """tree_digest of `out`, conversion.json's taken without its `fingerprint`, which digests the
    source files' identities on disk (inode, mtime: what resume compares) and so differs between runs."""
    digests = tree_digest(out)
    record = json.loads((out / "conversion.json").read_bytes())
    assert len(record.pop("fingerprint")) == 64
    digests["conversion.json"] = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
    return digests


@pytest.mark.parametrize("target", ["xpu", "draft"])
@pytest.mark.parametrize("variant", ["instruct", "base", "dspark"])
def test_every_output_byte_is_what_it_was(
    variant: str, target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # relative paths: conversion.json records the source as typed
    monkeypatch.chdir(tmp_path)
    preset = ["--preset", "tiny"]
    code, _, err = run_main(monkeypatch, capsys, "synth", "src", "--variant", variant, *preset, "-q")
    assert code == 0, err
    code, _, err = run_main(monkeypatch, capsys, "src", "out", "--target", target, "-q")
    assert code == 0, err
    assert _stable_digests(tmp_path / "out") == GOLDEN[(variant, target)]
