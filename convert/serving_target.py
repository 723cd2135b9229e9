"""The serving target of `--serve-with TARGET`: the model a draft is to be served beside,
read as its config.json only (its tensors are never needed: the runtime builds the draft's
layers from the target's config and quantisation config).

TARGET is a local model directory, the path of a config.json, or a hub repository
`[hf://]org/name[@revision]` (convert/sources/location.py's one rule tells them apart). Of a
hub repository only config.json is fetched, pinned to the commit the revision resolves to,
as a source is; a repository that is missing or gated, or that has no config.json, is
refused with the hub's exit codes. The bytes go through the one strict reader (a size bound,
strict JSON) and the model fields through the one config validator (model/config.py), so
every refusal is one line naming the file and the field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dsv4.convert.errors import PlanError
from dsv4.convert.sources.hub import default_backend, download, repo_info
from dsv4.convert.sources.hub_protocol import HubBackend
from dsv4.convert.sources.location import HF_PREFIX, locate
from dsv4.model.checkpoint import CONFIG
from dsv4.model.config import ModelConfig, parse_config
from dsv4.model.errors import CheckpointError
from dsv4.model.record import ABSENT, RUNTIME_CONFIG_FIELDS, brief, sha256_hex
from dsv4.model.strictjson import MAX_RECORD_BYTES, read_record_bytes

QUANTIZATION = "quantization_config"


def serve_fields() -> tuple[str, ...]:
    """The config fields a runtime builds the draft's layers from: the runtime-read ones and the
    model's. vLLM builds a draft's layers from the TARGET's config and quantisation (line numbers
    at the vLLM version of mapping/targets/draft.toml: model_loader/utils.py:93-101 with the
    target's vllm_config; xpu/mtp.py:76, 89, 97, 176-178; speculative.py:1564-1566 gives a V4
    DSpark draft the target's quantisation method), so each must be the draft's own."""
    model_fields = sorted({f.name for f in fields(ModelConfig)} - set(RUNTIME_CONFIG_FIELDS))
    return (*RUNTIME_CONFIG_FIELDS, *model_fields)


def first_difference(
    mine: dict[str, Any], theirs: dict[str, Any], keys: tuple[str, ...]
) -> tuple[str, Any, Any] | None:
    """The first of `keys` whose values differ, as (field, mine, theirs); for two objects the
    first sub-field that differs (`quantization_config.fmt`)."""
    for key in keys:
        a, b = mine.get(key, ABSENT), theirs.get(key, ABSENT)
        if isinstance(a, dict) and isinstance(b, dict):
            sub = next((k for k in sorted(a.keys() | b.keys()) if a.get(k, ABSENT) != b.get(k, ABSENT)), None)
            if sub is not None:
                return f"{key}.{sub}", a.get(sub, ABSENT), b.get(sub, ABSENT)
        elif a != b:
            return key, a, b
    return None


@dataclass(frozen=True)
class ServingTarget:
    """A serving target's config.json, read: where from, its bytes and its fields."""

    name: str  # what a launch command serves: the model directory, or the hub repo id
    where: str  # the config.json read, as messages name it
    config: dict[str, Any]
    config_bytes: bytes
    commit: str | None = None  # a hub target: the commit its revision resolved to

    @property
    def sha256(self) -> str:
        return sha256_hex(self.config_bytes)

    def to_json(self) -> dict[str, Any]:
        """How conversion.json names it: the directory's path, or the repo and commit."""
        at = {"path": self.name} if self.commit is None else {"repo": self.name, "commit": self.commit}
        return {**at, "config_sha256": self.sha256}

    def refuse_unless_fits(self, source_config: dict[str, Any]) -> None:
        """Refuse a target whose model fields (all but its quantisation) differ from the
        source's: the runtime would build the draft's layers to the target's shapes and
        numbering, which the source's tensors do not fit."""
        keys = tuple(k for k in serve_fields() if k != QUANTIZATION)
        found = first_difference(source_config, self.config, keys)
        if found is not None:
            key, mine, theirs = found
            raise PlanError(
                f"{self.where}: {key} is {brief(theirs)}, the source's is {brief(mine)}: the runtime builds the "
                "draft's layers from the target's config, so the source's draft would not fit it (serve it beside "
                "the model it was trained with, or a re-quantisation of it)",
                kind="layout_mismatch",
                path=self.where,
                field=key,
            )


def _parsed(raw: bytes, name: str, where: str, commit: str | None, model_fields: bool) -> ServingTarget:
    config = parse_config(raw, where)
    if model_fields:  # checked as every config.json reader checks them
        ModelConfig.from_dict(config, where)
    return ServingTarget(name, where, config, raw, commit)


def _too_large(where: str, size: int) -> CheckpointError:
    return CheckpointError(
        f"{where}: {size:,} bytes, over the {MAX_RECORD_BYTES:,}-byte limit on a config.json",
        kind="malformed_config",
        path=where,
    )


def _read_local(file: Path, where: str) -> bytes:
    try:
        return read_record_bytes(file)
    except FileNotFoundError:
        raise CheckpointError(
            f"{where}: no {CONFIG}: a serving target is a model directory, its {CONFIG}, or a hub repo",
            kind="missing_config",
            path=where,
        ) from None
    except OSError as exc:  # a FIFO, a device, over the size bound, unreadable
        raise CheckpointError(f"{where}: {exc.strerror or exc}", kind="malformed_config", path=where) from None


def read_serving_target(
    typed: str | Path, *, backend: HubBackend | None = None, model_fields: bool = True
) -> ServingTarget:
    """The serving target `typed` names (module docstring), read and checked. `backend`: the
    hub a repo id is read from (default: the Hugging Face Hub). `model_fields=False` leaves
    the model fields unchecked, for `check --serve-with`, which compares each with the
    draft's and names the first that differs."""
    text = str(typed)
    path = Path(text)
    if not text.startswith(HF_PREFIX) and path.exists():
        file = path / CONFIG if path.is_dir() else path
        return _parsed(_read_local(file, str(file)), str(file.parent.resolve()), str(file), None, model_fields)
    try:
        hub = locate(text, backend=backend)
    except CheckpointError as exc:
        if exc.kind != "source_not_found":
            raise
        raise CheckpointError(
            f"{text}: no such model directory or {CONFIG} (nor a hub repo id [hf://]org/name[@revision])",
            kind="source_not_found",
            path=text,
        ) from None
    assert not isinstance(hub, Path)  # an existing path was read above
    backend = backend or default_backend()
    if backend.offline() is not None:  # the cache's copy at the commit the revision pinned, as a source is read
        snapshot, commit = backend.cached_snapshot(hub)
        where = f"{hub.location}/{CONFIG}@{commit[:12]}"
        return _parsed(_read_local(snapshot / CONFIG, where), hub.repo, where, commit, model_fields)
    commit, info = repo_info(backend, hub)  # one request: repo_not_found (61, also gated), revision_not_found (62)
    where = f"{hub.location}/{CONFIG}@{commit[:12]}"
    listed = {f.name: f for f in info.files}
    if CONFIG not in listed:
        raise CheckpointError(f"{where}: no {CONFIG} in the repository", kind="missing_config", path=where)
    size = listed[CONFIG].size
    if size is not None and size > MAX_RECORD_BYTES:
        raise _too_large(where, size)
    raw = download(hub, commit, CONFIG, backend=backend)
    assert raw is not None  # missing_ok is off: a missing file raised
    if len(raw) > MAX_RECORD_BYTES:
        raise _too_large(where, len(raw))
    return _parsed(raw, hub.repo, where, commit, model_fields)
