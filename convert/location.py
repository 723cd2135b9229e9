"""Where a source is: a local checkpoint directory or a model-hub repository. The one rule
that tells them apart, and the one reading of a repo id, for every command.

  - an existing path is a local directory;
  - `hf://org/name[@revision]` is always the hub;
  - a missing path that starts with `./`, `../` or `/`, or whose repo part has more than one
    `/`, can only be a mistyped local path: exit 19, without any network request;
  - anything else of the form `org/name[@revision]` is a hub repo id (when the hub has no such
    repository, the message names both readings).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import click

from dsv4.convert.errors import HubError
from dsv4.model.errors import CheckpointError

HF_PREFIX = "hf://"  # the hub's URL scheme in huggingface_hub's file system (HfFileSystem)
HUB_SCHEME = "hub:"  # how records and messages name a hub location: hub:org/name
LOCAL_PREFIXES = ("./", "../", "/")


@dataclass(frozen=True)
class HubSpec:
    repo: str
    revision: str | None  # None: the repo's default branch
    explicit: bool = False  # written hf://...: not also a possible local path
    token: str | None = field(default=None, repr=False, compare=False)  # --token; None: HF_TOKEN or the stored login
    verify_files: bool = False  # --verify-source: check whole files against the hub's sha256 (convert/hub.py)

    @property
    def location(self) -> str:
        return f"{HUB_SCHEME}{self.repo}"


def parse_hub_spec(spec: str) -> HubSpec:
    """`org/name`, `org/name@revision` (a branch, tag or commit; may contain '/'), either
    optionally written `hf://...`; anything else is refused (repo_not_found)."""
    # start-up time: huggingface_hub.utils brings its HTTP stack, which a local source never needs
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    explicit = spec.startswith(HF_PREFIX)
    repo, at, revision = spec.removeprefix(HF_PREFIX).partition("@")
    try:
        validate_repo_id(repo)
        ok = repo.count("/") == 1 and (revision != "" or not at)
    except HFValidationError:
        ok = False
    if not ok:
        raise HubError(
            f"{spec}: neither an existing local directory nor a hub repo id [hf://]org/name[@revision]",
            kind="repo_not_found",
            path=str(spec),
        )
    return HubSpec(repo, revision or None, explicit)


def locate(
    source: str | Path | HubSpec, *, revision: str | None = None, token: str | None = None, verify_files: bool = False
) -> Path | HubSpec:
    """The local directory `source` names, or the hub repository; source_not_found (19)
    when it can only be a local path that does not exist. `revision`, `token` and
    `verify_files` are the hub options `--revision` and `--token` (as in the `hf` CLI) and
    `--verify-source`: a revision given twice, by option and by `@rev`, must be the same
    one, and none of them applies to a local directory (click.UsageError, exit 2)."""
    where = source if isinstance(source, HubSpec) else _locate(source)
    if revision is None and token is None and not verify_files:
        return where
    if isinstance(where, Path):
        raise click.UsageError(
            f"--revision, --token and --verify-source are for hub sources; {source} is a local directory"
        )
    if revision is not None and where.revision not in (None, revision):
        raise click.UsageError(f"{source} names revision {where.revision!r} but --revision says {revision!r}; give one")
    return replace(
        where,
        revision=revision or where.revision,
        token=token or where.token,
        verify_files=verify_files or where.verify_files,
    )


def _locate(source: str | Path) -> Path | HubSpec:
    text = str(source)
    if text.startswith(HF_PREFIX):
        return parse_hub_spec(text)
    path = Path(source)
    if path.exists():
        return path
    repo = text.partition("@")[0]
    if text.startswith(LOCAL_PREFIXES) or repo.count("/") > 1:
        raise CheckpointError(f"{text}: no such local directory", kind="source_not_found", path=text)
    try:
        return parse_hub_spec(text)
    except HubError as exc:
        if exc.kind != "repo_not_found":
            raise
        raise CheckpointError(
            f"{text}: no such local directory (nor a hub repo id [hf://]org/name[@revision])",
            kind="source_not_found",
            path=text,
        ) from None
