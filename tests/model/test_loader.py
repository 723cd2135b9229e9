"""Memory of the bundled model and of the native reference: on the CPU their weights are
views of the memory-mapped safetensors shards (no copy of the embedding, the head or the
routed experts), a write to one never reaches the file, and the logits are computed without
an fp32 copy of the head. Real-size figures: docs/results/model-memory.md."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.model import quantized as quant
from dsv4.model import reference, smoke
from dsv4.model.loader import load_converted
from dsv4.model.reference import NativeReference

INDEX = "model.safetensors.index.json"
L = "model.layers.2."
EXPERTS = L + "mtp_block.ffn.experts.routed_experts."
BIG = ["model.embed_tokens.weight", L + "shared_head.head.weight", EXPERTS + "w13_weight", EXPERTS + "w2_weight"]

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/maps").exists(), reason="reads the process's mappings from Linux's /proc"
)


def file_maps() -> dict[str, list[tuple[int, int]]]:
    """Real path -> address ranges of this process's mappings of that file."""
    out: dict[str, list[tuple[int, int]]] = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            out.setdefault(os.path.realpath(fields[5]), []).append((lo, hi))
    return out


def mapped_from(t: torch.Tensor, file: Path, maps: dict[str, list[tuple[int, int]]]) -> bool:
    """Every byte of t lies in a mapping of `file`: t is a view of the file, not a copy."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.nbytes
    return any(a <= lo and hi <= b for a, b in maps.get(os.path.realpath(file), []))


def weight_map(root: Path) -> dict[str, str]:
    return json.loads((root / INDEX).read_text())["weight_map"]


def test_on_the_cpu_every_loaded_weight_is_a_view_of_its_mapped_shard(tiny_pair):
    converted = tiny_pair[1]
    state = load_converted(converted, "cpu").state_dict()
    files, maps = weight_map(converted), file_maps()
    copied = [name for name, t in state.items() if not mapped_from(t, converted / files[name], maps)]
    assert not copied, f"copied out of the mapped shards: {copied}"
    assert set(BIG) <= set(state), "the embedding, the head and the routed experts were checked"


def test_the_reference_reads_the_native_shards_in_place(tiny_pair):
    native = tiny_pair[0]
    ref = NativeReference(native, "cpu")
    files, maps = weight_map(native), file_maps()
    copied = [name for name, t in ref.t.items() if not mapped_from(t, native / files[name], maps)]
    assert not copied, f"copied out of the mapped shards: {copied}"
    assert {"embed.weight", "head.weight", "mtp.0.ffn.experts.0.w1.weight"} <= set(ref.t)


def test_a_write_to_a_loaded_weight_never_reaches_the_file(tiny_pair):
    # the maps are private (copy-on-write): the user's checkpoint is never written through them
    converted = tiny_pair[1]
    shards = sorted(converted.glob("*.safetensors"))
    before = [hashlib.sha256(p.read_bytes()).hexdigest() for p in shards]
    model = load_converted(converted, "cpu")
    for name in BIG:
        model.state_dict()[name].fill_(7)
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in shards] == before
    fresh = load_converted(converted, "cpu").state_dict()
    assert not any(bool((fresh[name] == 7).all()) for name in BIG)


class LargestFp32(TorchDispatchMode):
    """Records the size in bytes of the largest fp32 tensor any op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.nbytes = max(self.nbytes, t.nbytes)
        return out


def test_the_logits_need_no_fp32_copy_of_the_head(tiny_pair, monkeypatch):
    native, converted = tiny_pair
    model, ref = load_converted(converted, "cpu"), NativeReference(native, "cpu")
    head = model.state_dict()[L + "shared_head.head.weight"]
    g = torch.Generator().manual_seed(0)
    ids, positions = torch.randint(0, head.shape[0], (4,), generator=g), torch.arange(4)
    prev = torch.randn(4, model.config.hc_dim, generator=g).to(torch.bfloat16)
    runs = (
        (model.compute_logits, model(ids, positions, prev)),
        (ref.compute_logits, ref.forward(ids, positions, prev)),
    )
    in_one_step = [compute_logits(hidden) for compute_logits, hidden in runs]  # the tiny head fits one step
    # steps of 100 rows (the real ones are 64-128 MiB): the tiny head's 512 rows take several
    monkeypatch.setattr(quant, "FP32_STEP_BYTES", 100 * head.shape[1] * 4, raising=False)
    monkeypatch.setattr(reference, "VOCAB_SLICE", 100, raising=False)
    for (compute_logits, hidden), whole in zip(runs, in_one_step, strict=True):
        with LargestFp32() as seen:
            logits = compute_logits(hidden)
        assert seen.nbytes < head.numel() * 4, (
            f"{compute_logits.__qualname__}: an fp32 tensor of {seen.nbytes} bytes, the head's size in fp32"
        )
        assert logits.dtype == torch.float32 and logits.shape == (4, head.shape[0])
        torch.testing.assert_close(logits, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_smoke_with_the_reference_unmaps_the_model_before_the_reference_loads(tiny_pair, monkeypatch):
    """`smoke --native` holds one side at a time: the converted shards the model's weights
    were mapped from (and the pages its forward made resident) are gone before the reference
    maps the native ones, so the peak is the larger side, not the sum."""
    native, converted = tiny_pair
    shards = {os.path.realpath(converted / f) for f in set(weight_map(converted).values())}
    still_mapped: list[set[str]] = []
    real_init = NativeReference.__init__

    def init(self, *args, **kwargs):
        still_mapped.append(shards & set(file_maps()))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(NativeReference, "__init__", init)
    report = smoke.run_smoke(converted, "cpu", tokens=4, reference_dir=native)
    assert still_mapped == [set()]
    assert report["top1_agreement_up_to_ties"] == 1.0
