"""The expert-storage registry (model/storage.py): an unknown storage is refused by name wherever
it is looked up, dequantisation follows the entries (checked against the independent reference's
decode), and a storage registered there alone converts to a draft directory that passes `check`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv4.convert.check.run import run_checks
from dsv4.convert.exit_codes import exit_code
from dsv4.convert.pipeline import convert
from dsv4.convert.synth import write_checkpoint
from dsv4.mapping import probe
from dsv4.model import presets, storage
from dsv4.model.checkpoint import INDEX_NAME
from dsv4.model.config import ModelConfig
from dsv4.model.errors import CheckpointError
from dsv4.model.native import variant_of
from dsv4.model.presets import preset_config
from dsv4.model.quantized import RoutedExperts, dequantize
from dsv4.model.reference import NativeReference, fp4_weight, fp8_weight
from dsv4.model.storage import FP4, FP8, ExpertStorage, storage_of

UNKNOWN = "int8"  # a storage this tool does not have


def _refused_by_name(exc: CheckpointError, where: str) -> None:
    assert exc.kind == "unsupported_layout" and exit_code(exc) == 35
    assert exc.field == "expert_dtype" and exc.path == where
    assert str(exc) == f"{where}: unknown expert_dtype {UNKNOWN!r} (expected fp4 or fp8)"


def test_an_unknown_storage_is_refused_by_name() -> None:
    with pytest.raises(CheckpointError) as direct:
        storage_of(UNKNOWN, "ckpt/config.json")
    _refused_by_name(direct.value, "ckpt/config.json")
    with pytest.raises(CheckpointError) as loaded:
        ModelConfig.from_dict({**preset_config("tiny"), "expert_dtype": UNKNOWN}, "ckpt/config.json")
    _refused_by_name(loaded.value, "ckpt/config.json")


def test_variant_of_an_unknown_storage_is_refused_not_read_as_base() -> None:
    """Before the registry, variant_of answered "base" for anything that was not fp4, and the
    probe of an unknown storage was a KeyError."""
    cfg = ModelConfig.from_dict(preset_config("tiny"))
    object.__setattr__(cfg, "expert_dtype", UNKNOWN)  # past the loader, which refuses it itself
    with pytest.raises(CheckpointError) as exc:
        variant_of(cfg)
    _refused_by_name(exc.value, "config.json")
    with pytest.raises(CheckpointError) as probed:
        probe.probe_config(UNKNOWN)
    _refused_by_name(probed.value, "config.json")


def _expert(root: Path, e: int, w: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale) of routed expert e's linear w of MTP block 0 in native checkpoint `root`."""
    name = f"mtp.0.ffn.experts.{e}.{w}"
    shard = json.loads((root / INDEX_NAME).read_text())["weight_map"][f"{name}.weight"]
    with safe_open(str(root / shard), "pt") as f:
        return f.get_tensor(f"{name}.weight"), f.get_tensor(f"{name}.scale")


@pytest.mark.parametrize(("fixture", "entry"), [("tiny_native", FP4), ("tiny_base", FP8)])
def test_the_registry_drives_dequantisation_as_the_reference_decodes(
    fixture: str, entry: ExpertStorage, request: pytest.FixtureRequest
) -> None:
    """Each storage's synthetic experts dequantise, one linear at a time and stacked in the bundled
    model's containers, to the values of the reference's own decode (model/reference.py)."""
    root: Path = request.getfixturevalue(fixture)
    cfg = ModelConfig.from_dict(preset_config("tiny", entry.release))
    block = cfg.weight_block_size

    def reference(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return fp4_weight(w, s) if entry is FP4 else fp8_weight(w, s, block)

    experts = RoutedExperts(entry, 2, cfg.hidden_size, cfg.moe_intermediate_size, block)
    for e in range(2):
        parts = {w: _expert(root, e, w) for w in ("w1", "w2", "w3")}
        for w, s in parts.values():
            assert torch.equal(dequantize(entry, w, s, block, torch.float32), reference(w, s))
        w13 = torch.cat((parts["w1"][0], parts["w3"][0]))
        s13 = torch.cat((parts["w1"][1], parts["w3"][1]))
        state = {"w13_weight": w13, f"w13_{entry.scale_param}": s13}
        state |= {"w2_weight": parts["w2"][0], f"w2_{entry.scale_param}": parts["w2"][1]}
        for key, value in state.items():
            param = experts.get_parameter(key)
            param.data[e] = value.view(param.dtype)
    for e in range(2):
        got13, got2 = experts.expert_weights(e, torch.float32)
        parts = {w: _expert(root, e, w) for w in ("w1", "w2", "w3")}
        assert torch.equal(got13, torch.cat((reference(*parts["w1"]), reference(*parts["w3"]))))
        assert torch.equal(got2, reference(*parts["w2"]))


def test_fp8_experts_with_a_ragged_block_grid_dequantise_w1_and_w3_apart() -> None:
    """moe_intermediate_size 192 is not a multiple of the 128-row block: w3's scale grid starts on a
    block of its own, so w13 is dequantised part by part."""
    gen = torch.Generator().manual_seed(0)
    E, H, I, block = 1, 256, 192, (128, 128)
    experts = RoutedExperts(FP8, E, H, I, block)
    w1, w3 = ((torch.randn(I, H, generator=gen) * 100).to(torch.float8_e4m3fn) for _ in range(2))
    s1, s3 = (torch.exp2(torch.randint(-15, -10, (2, 2), generator=gen).float()) for _ in range(2))
    experts.w13_weight.data[0] = torch.cat((w1, w3))
    experts.w13_weight_scale_inv.data[0] = torch.cat((s1, s3))
    got13, _ = experts.expert_weights(0, torch.float32)
    assert torch.equal(got13, torch.cat((fp8_weight(w1, s1, block), fp8_weight(w3, s3, block))))


# A pretend storage: int8 weights, F32 scales per row and 128 inputs.
PRETEND = ExpertStorage(
    name="int8",
    release="int8",
    weight_dtype="I8",
    scale_dtype="F32",
    linear_scale_dtype="F32",
    container_dtype="I8",
    scale_container_dtype="F32",
    scale_param="weight_scale",
    scale_block=(1, 128),
    synth_weight_std=40.0,
    synth_scale_exponents=(-13, -9),
)


@pytest.fixture
def pretend_storage(monkeypatch: pytest.MonkeyPatch) -> ExpertStorage:
    """PRETEND registered as a release would be: its registry entry and its release's variant
    (which presets derives from the registry at import)."""
    monkeypatch.setitem(storage.STORAGES, PRETEND.name, PRETEND)
    monkeypatch.setitem(presets.EXPERT_DTYPE, PRETEND.release, PRETEND.name)
    probe.probe_keys.cache_clear()  # the table probe covers every registered storage
    yield PRETEND
    probe.probe_keys.cache_clear()


def test_a_storage_registered_alone_synthesises_converts_to_draft_and_passes_check(
    pretend_storage: ExpertStorage, tmp_path: Path
) -> None:
    """No code outside the registry names a storage: synth, the draft conversion and every check
    but the xpu-table ones (the xpu table maps no int8 experts) take the new entry as it is."""
    native = write_checkpoint(tmp_path / "native", preset="tiny", variant=pretend_storage.release, seed=0)
    w, s = _expert(native, 0, "w1")
    assert (w.dtype, s.dtype) == (torch.int8, torch.float32) and s.shape == (128, 256 // 128)
    assert 1e-3 < dequantize(pretend_storage, w, s, (128, 128), torch.float32).std() < 0.1
    out = convert(native, tmp_path / "draft", target="draft").out
    report = run_checks(out)
    assert report.ok, report.summary()
    passed = {r.name for r in report.results if r.status == "pass"}
    assert passed == {"index", "readable", "sizes", "checksums", "config", "layout"}, report.summary()
    assert "expert_dtype int8" in report.result("config").reason


def test_the_independent_reference_refuses_a_storage_it_does_not_decode_itself(
    pretend_storage: ExpertStorage, tmp_path: Path
) -> None:
    """The reference decodes fp4 and fp8 its own way (by design it shares nothing with the
    registry), so a storage registered only there is refused by name before any tensor is
    read: never decoded as packed FP4 because its weights are int8 too (which it was: a raw
    torch shape error, exit 84 from check --native)."""
    native = write_checkpoint(tmp_path / "native", preset="tiny", variant=pretend_storage.release, seed=0)
    with pytest.raises(CheckpointError) as refused:
        NativeReference(native)
    assert refused.value.kind == "unsupported_layout" and refused.value.field == "expert_dtype"
    assert str(refused.value) == (
        f"{native / 'config.json'}: expert_dtype 'int8': the independent reference decodes fp4 and fp8 experts "
        "only, so --native cannot compare against it"
    )
