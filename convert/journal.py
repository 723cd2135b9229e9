"""The partial directory's journal of finished tensors, and the run of a plan's tensors into its
shards around it: what a killed run resumes from (convert/pipeline.py owns the directory's
life cycle). A computed tensor's entry keeps its measured error, so a resumed run records it
without computing it again."""

from __future__ import annotations

import json
from contextlib import ExitStack
from itertools import chain
from pathlib import Path
from typing import IO, Any

from dsv4.convert.execute import Executor, still_valid
from dsv4.convert.output import OutputClaim
from dsv4.convert.plan import PlannedTensor
from dsv4.convert.served import measured_fields
from dsv4.convert.transforms import may_refuse, prefetch_ops
from dsv4.convert.writer import ShardWriter, TensorSpec
from dsv4.model import strictjson


def read_journal(path: Path) -> dict[str, dict[str, Any]]:
    """Finished tensors; a line torn by a kill is ignored (that tensor is redone)."""
    done: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_bytes().splitlines():
            try:
                entry = strictjson.loads(line)
            except strictjson.StrictJSONError:
                continue
            if (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("nbytes"), int)
                and isinstance(entry.get("sha256"), str)
            ):
                done[entry["name"]] = entry
    return done


def open_shards(
    claim: OutputClaim,
    opened: ExitStack,
    shards: list[list[PlannedTensor]],
    names: list[str],
    journal: dict[str, dict[str, Any]],
    resumed: bool,
) -> tuple[list[tuple[PlannedTensor, ShardWriter]], list[ShardWriter]]:
    """Every shard of the partial directory open at once (the executor reads the largest
    tensors first, whichever shard they go into), and the tensors still to write: a
    journaled tensor whose bytes no longer hash as recorded is dropped from `journal`."""
    jobs: list[tuple[PlannedTensor, ShardWriter]] = []
    writers: list[ShardWriter] = []
    for tensors, name in zip(shards, names, strict=True):
        claim.ensure_owner()  # never open a shard in a partial directory another run may own now
        specs = [TensorSpec(t.name, t.dtype, t.shape) for t in tensors]
        writer = opened.enter_context(ShardWriter(claim.partial / name, specs, {"format": "pt"}, resume=resumed))
        writers.append(writer)
        done = [journal[t.name] for t in tensors if t.name in journal]
        valid = still_valid(writer.path, done, writer.offsets) if writer.resumed else set()
        for t in tensors:
            if t.name in journal and t.name not in valid:
                del journal[t.name]
        jobs += [(t, writer) for t in tensors if t.name not in journal]
    return jobs, writers


def run_jobs(
    executor: Executor,
    jobs: list[tuple[PlannedTensor, ShardWriter]],
    shard_of: dict[str, str],
    jf: IO[str],
    journal: dict[str, dict[str, Any]],
) -> None:
    """Write every job, journaling each finished tensor (a computed one with its measured
    error): the computations that may be refused first, so a refusal stops the run before the
    copies; those that cannot (a scale decoded) after them, torch imported meanwhile."""
    refusable = {t.name: may_refuse(t.transform) for t, _ in jobs if t.transform is not None}
    first = [(t, w) for t, w in jobs if refusable.get(t.name)]
    last = [(t, w) for t, w in jobs if refusable.get(t.name) is False]
    if last and not first:
        prefetch_ops()
    copied = ((t, sha, None) for t, sha in executor.run([(t, w) for t, w in jobs if t.transform is None]))
    for t, sha, measured in chain(executor.compute(first), copied, executor.compute(last)):
        entry = {"name": t.name, "file": shard_of[t.name], "nbytes": t.nbytes, "sha256": sha}
        entry.update(measured_fields(measured))
        jf.write(json.dumps(entry, sort_keys=True) + "\n")
        jf.flush()
        journal[t.name] = entry
