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

from dataclasses import dataclass
from pathlib import Path

from dsv4.convert.errors import RepoNotFound
from dsv4.model.errors import SourceNotFoundError
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

HF_PREFIX = "hf://"  # the hub's URL scheme in huggingface_hub's file system (HfFileSystem)
HUB_SCHEME = "hub:"  # how records and messages name a hub location: hub:org/name
LOCAL_PREFIXES = ("./", "../", "/")


@dataclass(frozen=True)
class HubSpec:
    repo: str
    revision: str | None  # None: the repo's default branch
    explicit: bool = False  # written hf://...: not also a possible local path

    @property
    def location(self) -> str:
        return f"{HUB_SCHEME}{self.repo}"


def parse_hub_spec(spec: str) -> HubSpec:
    """`org/name`, `org/name@revision` (a branch, tag or commit; may contain '/'), either
    optionally written `hf://...`; anything else is refused (RepoNotFound)."""
    explicit = spec.startswith(HF_PREFIX)
    repo, at, revision = spec.removeprefix(HF_PREFIX).partition("@")
    try:
        validate_repo_id(repo)
        ok = repo.count("/") == 1 and (revision != "" or not at)
    except HFValidationError:
        ok = False
    if not ok:
        raise RepoNotFound(f"{spec}: neither an existing local directory nor a hub repo id [hf://]org/name[@revision]", path=str(spec))
    return HubSpec(repo, revision or None, explicit)


def locate(source: str | Path) -> Path | HubSpec:
    """The local directory `source` names, or the hub repository; SourceNotFoundError (19)
    when it can only be a local path that does not exist."""
    text = str(source)
    if text.startswith(HF_PREFIX):
        return parse_hub_spec(text)
    path = Path(source)
    if path.exists():
        return path
    repo = text.partition("@")[0]
    if text.startswith(LOCAL_PREFIXES) or repo.count("/") > 1:
        raise SourceNotFoundError(f"{text}: no such local directory", path=text)
    try:
        return parse_hub_spec(text)
    except RepoNotFound:
        raise SourceNotFoundError(f"{text}: no such local directory (nor a hub repo id [hf://]org/name[@revision])", path=text) from None
