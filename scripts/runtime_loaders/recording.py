"""The recording stand-ins (every weight_loader records what it was fed), reading a
directory's tensors, and one loader run with its report."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dsv4.model.checkpoint import local_weight_map


@dataclass
class Record:
    tensor: str
    shard: Any
    expert: int | None
    data: torch.Tensor


@dataclass
class Recorder:
    """Which fed tensor each weight_loader call came from, and what it was given."""

    current: str = ""
    records: dict[str, list[Record]] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)
    # a tensor a loader built from fed ones (SGLang fuses wq_a and wkv, the first one held
    # back until the second arrives) -> the fed tensors it holds
    made_of: dict[int, list[str]] = field(default_factory=dict)

    def load(self, param: RecordingParam, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        shard = kwargs.get("shard_id", args[-1] if args and not kwargs else None)
        sources = self.made_of.get(id(loaded), [self.current])
        self.records.setdefault(param.name, []).append(
            Record(", ".join(sources), shard, kwargs.get("expert_id"), loaded)
        )
        self.touched.update(sources)
        return True


class RecordingParam:
    """A parameter stand-in: its name and a weight_loader that records."""

    def __init__(self, name: str, recorder: Recorder) -> None:
        self.name = name
        self.weight_loader = recorder.load

    def __getitem__(self, rows: slice) -> types.SimpleNamespace:
        # `param[:n].copy_(w)`: vLLM before 0.22.0 copies the attention sink's heads of this
        # rank so (model_executor/models/deepseek_v4_mtp.py:426-429 in 0.21.0); at one rank
        # the rows are all of them, so the copy is the whole parameter's load
        return types.SimpleNamespace(copy_=lambda tensor: self.weight_loader(self, tensor))


def attrs(obj: Any) -> Any:
    """A JSON value with attribute access for objects (as transformers' config gives)."""
    if isinstance(obj, dict):
        return types.SimpleNamespace(**{k: attrs(v) for k, v in obj.items()})
    if isinstance(obj, list):
        return [attrs(v) for v in obj]
    return obj


# --- reading the directories -------------------------------------------------------------


def read_tensors(root: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint directory, in the index's order (as vLLM iterates)."""
    weight_map, _ = local_weight_map(root)
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    for shard in sorted(by_shard):
        with safe_open(root / shard, framework="pt") as f:
            for name in sorted(by_shard[shard]):
                yield name, f.get_tensor(name)


def raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


# --- one run -----------------------------------------------------------------------------


@dataclass
class Report:
    loader: str
    fed: int = 0
    hit: dict[str, str] = field(default_factory=dict)  # parameter -> the tensors it got
    skipped: list[str] = field(default_factory=list)  # fed, never reached a weight_loader
    errors: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # non-shared parameters not hit
    unequal: list[str] = field(default_factory=list)  # hit, bytes differ from XPU_OUT
    dropped: list[str] = field(default_factory=list)  # skipped, and the table says so
    absent: str = ""  # the release ("vLLM 0.25.1") that has no such loader; "" where it ran

    @property
    def passed(self) -> bool:
        return not (self.absent or self.errors or self.skipped or self.missing or self.unequal)

    def summary(self) -> dict[str, Any]:
        return {
            "loader": self.loader,
            "passed": self.passed,
            "not_in_release": self.absent or None,
            "fed": self.fed,
            "parameters_hit": len(self.hit),
            "skipped_as_the_table_says": self.dropped,
            "skipped": self.skipped,
            "errors": self.errors,
            "missing": self.missing,
            "bytes_unequal": self.unequal,
            "hit": self.hit,
        }


def assemble(records: list[Record]) -> bytes:
    """The bytes a parameter holds after its weight_loader calls, at tensor-parallel size 1."""
    if any(r.expert is not None for r in records):
        order = {"w1": 0, "w3": 1, "w2": 0}
        return b"".join(raw(r.data) for r in sorted(records, key=lambda r: (r.expert, order[r.shard])))
    if len(records) > 1:
        return b"".join(raw(r.data) for r in sorted(records, key=lambda r: r.shard))
    return raw(records[0].data)


def duplicate_shards(records: list[Record]) -> list[str]:
    seen: set[tuple[Any, Any]] = set()
    dup = []
    for r in records:
        key = (r.expert, r.shard)
        if key in seen:
            dup.append(f"{r.tensor} (shard {r.shard}, expert {r.expert})")
        seen.add(key)
    return dup


def run_loader(
    name: str,
    load: Callable[[Iterable[tuple[str, torch.Tensor]], bool], Any],
    recorder: Recorder,
    draft: Path,
    expected: dict[str, torch.Tensor],
    droppable: Callable[[str], bool],
    shared_params: set[str],
    on_feed: Callable[[str, torch.Tensor], None] = lambda _n, _t: None,
) -> Report:
    """Feed every tensor of `draft` to `load(weights, completeness_check)`; on an exception,
    record it against the tensor being loaded and go on with the rest (a fresh call, its
    completeness check off: only the first call's is the runtime's)."""
    report = Report(name)
    tensors = list(read_tensors(draft))
    report.fed = len(tensors)
    position = 0

    def feed() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal position
        while position < len(tensors):
            tname, tensor = tensors[position]
            recorder.current = tname
            on_feed(tname, tensor)
            position += 1
            yield tname, tensor
        recorder.current = ""

    first = True
    while first or position < len(tensors):
        start = position
        try:
            load(feed(), first)
        except Exception as exc:  # noqa: BLE001 - the runtime's error is the finding
            where = recorder.current or ("(after the last tensor)" if position else "(before the first tensor)")
            report.errors.append(f"{where}: {type(exc).__name__}: {exc}")
            if position == start:  # it fails before taking a tensor: a fresh call would too
                break
        first = False
    for tname, _ in tensors:
        if tname in recorder.touched:
            continue
        (report.dropped if droppable(tname) else report.skipped).append(tname)
    errored = {e.split(":", 1)[0] for e in report.errors}
    report.skipped = [t for t in report.skipped if t not in errored]
    for pname, records in sorted(recorder.records.items()):
        report.hit[pname] = ", ".join(sorted({r.tensor for r in records}))
        dup = duplicate_shards(records)
        if dup:
            report.errors.append(f"{pname}: loaded twice from {', '.join(dup)}")
        elif pname not in shared_params and (pname not in expected or assemble(records) != raw(expected[pname])):
            report.unequal.append(pname)
    report.missing = sorted(set(expected) - shared_params - set(recorder.records))
    return report
