"""A batch manifest (`convert-dsv4 batch MANIFEST`, convert/batch/run.py runs it): reading and
checking it, and which of its sources this task takes.

Scale-out: the manifest's sources are sorted by id and shard K of N takes every N-th one
from K, so array tasks split the work the same way on every machine without talking to
each other. N and K default from Slurm array or Kubernetes indexed-Job variables.
"""

from __future__ import annotations

import os
import string
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4.convert.errors import HubError
from dsv4.convert.pipeline import DEFAULT_MAX_SHARD
from dsv4.convert.serving import DRAFT_FORMATS
from dsv4.convert.sizes import shard_size
from dsv4.convert.sources.hub import default_backend
from dsv4.convert.sources.location import HF_PREFIX, parse_hub_spec
from dsv4.convert.sources.source import HubSpec
from dsv4.mapping.targets import default_target, installed_targets, serving_targets
from dsv4.model.errors import DSV4Error

TOP_KEYS = {"target", "sources", "output", "options", "serve_with"}
OUTPUT_KEYS = {"dir", "name", "repo", "private"}
OPTION_KEYS = {"max_shard_size", "check", "draft_format", "allow_lossy"}
PLACEHOLDERS = ("org", "name", "target", "revision")
DEFAULT_DIR = "converted"
DEFAULT_NAME = "{name}-{target}"
NUM_SHARDS_ENV = "DSV4_NUM_SHARDS"


@dataclass(frozen=True)
class ManifestEntry:
    """One repository of the manifest's `sources`, and where its output goes."""

    repo: str
    revision: str | None  # as the manifest names it; None = the default branch
    output: Path  # local output directory
    push_repo: str | None  # target hub repo, when the manifest names one

    @property
    def key(self) -> str:
        return f"{self.repo}@{self.revision}" if self.revision else self.repo


@dataclass(frozen=True)
class Manifest:
    path: Path
    target: str
    out_dir: Path
    sources: tuple[ManifestEntry, ...]  # sorted by key: the order shards are cut from
    private: bool | None  # visibility of target repos that --push creates; None: the hub's default
    max_shard_size: int
    check: bool
    # the serving target every draft is made for (convert's --serve-with): a hub repo, or a
    # path relative to the manifest; None: none
    serve_with: str | None = None
    draft_format: str = "auto"
    allow_lossy: bool = False


def _table(raw: Any, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise HubError(f"{where}: must be a table", kind="bad_manifest", path=str(where))
    unknown = sorted(set(raw) - keys)
    if unknown:
        raise HubError(
            f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(keys))})",
            kind="bad_manifest",
            path=str(where),
        )
    return raw


def _fill(template: str, hub: HubSpec, target: str, where: str) -> str:
    org, name = hub.repo.split("/")
    values = {"org": org, "name": name, "target": target, "revision": hub.revision or "main"}
    try:
        # bare placeholders only: str.format would also run "{name.upper}" (attribute access)
        # and "{name:>999999999}" (a gigabyte of padding) straight from the manifest
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
        bad = next(
            (
                f"{{{f}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}"
                for f, spec, conv in fields
                if f not in values or spec or conv
            ),
            None,
        )
        if bad is not None:
            raise ValueError(f"{bad} is not a placeholder")
        return template.format(**values)
    except ValueError as exc:
        raise HubError(
            f"{where}: bad template {template!r} ({exc}); placeholders are "
            f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}",
            kind="bad_manifest",
            path=str(where),
        ) from None


def _hub_spec(raw: Any, where: str, base: Path) -> HubSpec:
    if isinstance(raw, dict):
        raw = _table(raw, where, {"repo", "revision"})
        repo, revision = raw.get("repo"), raw.get("revision")
        if not isinstance(repo, str) or "@" in repo or not (revision is None or isinstance(revision, str)):
            raise HubError(
                f'{where}: needs repo = "org/name" and optionally revision = "branch, tag or commit"',
                kind="bad_manifest",
                path=str(where),
            )
        raw = f"{repo}@{revision}" if revision else repo
    if not isinstance(raw, str):
        raise HubError(
            f'{where}: a source is "org/name[@revision]" or {{repo = ..., revision = ...}}',
            kind="bad_manifest",
            path=str(where),
        )
    if not raw.startswith(HF_PREFIX) and (Path(raw).is_dir() or (base / raw).is_dir()):
        raise HubError(
            f"{where}: {raw!r} is a local directory; batch takes hub repositories only (convert a local checkpoint "
            f"with convert-dsv4 {raw} OUT --target xpu)",
            kind="bad_manifest",
            path=str(where),
        )
    try:
        return parse_hub_spec(raw)
    except DSV4Error as exc:
        raise HubError(f"{where}: {exc}", kind="bad_manifest", path=str(where)) from None


def load_manifest(path: str | Path, out_dir: str | Path | None = None) -> Manifest:
    """Read and check a batch manifest. `out_dir` overrides its output.dir."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise HubError(f"{path}: cannot read the manifest ({exc})", kind="bad_manifest", path=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise HubError(f"{path}: not valid TOML ({exc})", kind="bad_manifest", path=str(path)) from None
    _table(raw, str(path), TOP_KEYS)
    output = _table(raw.get("output", {}), f"{path}: [output]", OUTPUT_KEYS)
    options = _table(raw.get("options", {}), f"{path}: [options]", OPTION_KEYS)
    target = raw.get("target", default_target())
    name_t, repo_t, private = output.get("name", DEFAULT_NAME), output.get("repo"), output.get("private")
    max_shard, check = options.get("max_shard_size", DEFAULT_MAX_SHARD), options.get("check", True)
    if not isinstance(target, str) or not isinstance(name_t, str) or not (repo_t is None or isinstance(repo_t, str)):
        raise HubError(f"{path}: target, output.name and output.repo are strings", kind="bad_manifest", path=str(path))
    if target not in installed_targets():  # before it fills a template or names a path
        raise HubError(
            f"{path}: target {target!r} is not an installed mapping table (installed: "
            f"{', '.join(installed_targets())}); a table is chosen by name, not path",
            kind="bad_manifest",
            path=str(path),
        )
    if not (private is None or isinstance(private, bool)) or not isinstance(check, bool):
        raise HubError(
            f"{path}: output.private and options.check are true or false", kind="bad_manifest", path=str(path)
        )
    try:
        max_shard = shard_size(max_shard)  # the rule --max-shard-size follows
    except ValueError as exc:
        raise HubError(f"{path}: options.max_shard_size: {exc}", kind="bad_manifest", path=str(path)) from None
    if out_dir is None:
        dir_raw = output.get("dir", DEFAULT_DIR)
        if not isinstance(dir_raw, str):
            raise HubError(f"{path}: output.dir is a string", kind="bad_manifest", path=str(path))
        out_root = path.parent / dir_raw  # relative to the manifest, so jobs may start anywhere
    else:
        out_root = Path(out_dir)

    entries = raw.get("sources")
    if not isinstance(entries, list) or not entries:
        raise HubError(
            f'{path}: sources must be a non-empty list of "org/name[@revision]"', kind="bad_manifest", path=str(path)
        )
    sources = _sources(path, entries, name_t, repo_t, target, out_root)
    return Manifest(path, target, out_root, sources, private, max_shard, check, *_serving(raw, options, target, path))


def _serving(raw: dict[str, Any], options: dict[str, Any], target: str, path: Path) -> tuple[str | None, str, bool]:
    """(serve_with, options.draft_format, options.allow_lossy), checked as convert's options are."""
    serve_with, draft_format = raw.get("serve_with"), options.get("draft_format", "auto")
    allow_lossy = options.get("allow_lossy", False)
    if not (serve_with is None or isinstance(serve_with, str)) or draft_format not in DRAFT_FORMATS:
        raise HubError(
            f"{path}: serve_with is a serving target (a hub repo, or a path relative to the manifest) and "
            f"options.draft_format one of {', '.join(DRAFT_FORMATS)}",
            kind="bad_manifest",
            path=str(path),
        )
    if not isinstance(allow_lossy, bool):
        raise HubError(f"{path}: options.allow_lossy is true or false", kind="bad_manifest", path=str(path))
    if serve_with is None and (draft_format != "auto" or allow_lossy):
        raise HubError(
            f"{path}: options.draft_format and options.allow_lossy choose how a draft serves: they need serve_with",
            kind="bad_manifest",
            path=str(path),
        )
    if serve_with is not None and target not in serving_targets():
        raise HubError(
            f"{path}: serve_with makes drafts to serve beside a target: it takes target = "
            f"{' or '.join(repr(t) for t in serving_targets())}",
            kind="bad_manifest",
            path=str(path),
        )
    if serve_with is not None and (path.parent / serve_with).exists():
        serve_with = str(path.parent / serve_with)
    return serve_with, draft_format, allow_lossy


def _sources(
    path: Path, entries: list[Any], name_t: str, repo_t: str | None, target: str, out_root: Path
) -> tuple[ManifestEntry, ...]:
    """The manifest's `sources`, each with its local output and target repo, sorted by key;
    a source listed twice, or two sources given the same output or repo, is refused."""
    sources: dict[str, ManifestEntry] = {}
    names: dict[str, str] = {}
    for k, listed in enumerate(entries):
        where = f"{path}: sources[{k}]"
        hub = _hub_spec(listed, where, Path(path).parent)
        local = _fill(name_t, hub, target, f"{path}: output.name")
        if not local or local in (".", "..") or "/" in local or "\\" in local:
            raise HubError(
                f"{where}: output.name gives {local!r}, not a plain directory name",
                kind="bad_manifest",
                path=str(where),
            )
        push_repo = _fill(repo_t, hub, target, f"{path}: output.repo") if repo_t else None
        if push_repo is not None and not default_backend().valid_repo_id(push_repo):
            raise HubError(
                f"{where}: output.repo gives {push_repo!r}, not a repo id org/name",
                kind="bad_manifest",
                path=str(where),
            )
        entry = ManifestEntry(hub.repo, hub.revision, out_root / local, push_repo)
        if entry.key in sources:
            raise HubError(f"{where}: {entry.key} is listed twice", kind="bad_manifest", path=str(where))
        for label, value in (("local output", local), ("target repo", push_repo)):
            if value is not None and (other := names.get(f"{label}:{value}")) is not None:
                raise HubError(
                    f"{where}: {entry.key} and {other} get the same {label} {value!r}; tell them apart in the template "
                    f"({{org}}, {{revision}})",
                    kind="bad_manifest",
                    path=str(where),
                )
            names[f"{label}:{value}"] = entry.key
        sources[entry.key] = entry
    return tuple(sources[k] for k in sorted(sources))


def shard_from_env(
    num_shards: int | None, shard_index: int | None, env: Mapping[str, str] = os.environ
) -> tuple[int, int]:
    """(N, K): the options where given (N also from DSV4_NUM_SHARDS), else a Slurm array task
    ((SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP, of
    SLURM_ARRAY_TASK_COUNT) or a Kubernetes indexed Job (JOB_COMPLETION_INDEX, with N from
    --num-shards / DSV4_NUM_SHARDS), else (1, 0). A variable that is set but unusable is a
    ValueError naming it."""

    def number(var: str, *, least: int) -> int:
        try:
            value = int(env[var])
        except ValueError:
            value = None
        if value is None or value < least:
            raise ValueError(f"{var}={env[var]!r} is not {'a positive' if least == 1 else 'a non-negative'} integer")
        return value

    if num_shards is None and NUM_SHARDS_ENV in env:
        num_shards = number(NUM_SHARDS_ENV, least=1)
    if shard_index is None:
        if "SLURM_ARRAY_TASK_ID" in env:
            task = number("SLURM_ARRAY_TASK_ID", least=0)
            low = number("SLURM_ARRAY_TASK_MIN", least=0) if "SLURM_ARRAY_TASK_MIN" in env else 0
            step = number("SLURM_ARRAY_TASK_STEP", least=1) if "SLURM_ARRAY_TASK_STEP" in env else 1
            if task < low or (task - low) % step:
                raise ValueError(
                    f"SLURM_ARRAY_TASK_ID={task} is not in the array SLURM_ARRAY_TASK_MIN={low}, "
                    f"SLURM_ARRAY_TASK_STEP={step} describe"
                )
            shard_index = (task - low) // step
            if num_shards is None and "SLURM_ARRAY_TASK_COUNT" in env:
                num_shards = number("SLURM_ARRAY_TASK_COUNT", least=1)
        elif "JOB_COMPLETION_INDEX" in env:
            shard_index = number("JOB_COMPLETION_INDEX", least=0)
            if num_shards is None:
                raise ValueError(
                    "JOB_COMPLETION_INDEX is set but not the number of shards: pass --num-shards or set "
                    f"{NUM_SHARDS_ENV} to the Job's completions"
                )
        elif num_shards not in (None, 1):
            raise ValueError(
                f"--num-shards {num_shards} needs --shard-index (or SLURM_ARRAY_TASK_ID / JOB_COMPLETION_INDEX)"
            )
        else:
            shard_index = 0
    num_shards = 1 if num_shards is None else num_shards
    if not 0 <= shard_index < num_shards:
        raise ValueError(
            f"shard index {shard_index} is outside 0..{num_shards - 1} (a Slurm array must be a range like 0-7 or "
            "1-15:2)"
        )
    return num_shards, shard_index


def select_shard(sources: Sequence[ManifestEntry], num_shards: int, shard_index: int) -> list[ManifestEntry]:
    """Shard K of N: every N-th source of the sorted list, from K. Each source lands in
    exactly one shard, and shard sizes differ by at most one."""
    return [s for k, s in enumerate(sorted(sources, key=lambda s: s.key)) if k % num_shards == shard_index]
