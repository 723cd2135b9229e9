"""From what the user typed to an open Source (convert/sources/source.py): where the source is, a
local checkpoint directory or a model-hub repository, and `open_source`, which opens either.
The one rule that tells them apart, and the one reading of a repo id, for every command.

  - an existing path is a local directory;
  - `hf://org/name[@revision]` is always the hub;
  - a missing path that starts with `./`, `../` or `/`, or whose repo part has more than one
    `/`, can only be a mistyped local path: exit 19, without any network request;
  - anything else of the form `org/name[@revision]` is a hub repo id (when the hub has no such
    repository, the message names both readings).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from dsv4.convert.errors import HubError
from dsv4.convert.sources.hub import default_backend
from dsv4.convert.sources.hub_protocol import HubBackend
from dsv4.convert.sources.local import open_local
from dsv4.convert.sources.source import HubSpec, Source
from dsv4.model.errors import CheckpointError

HF_PREFIX = "hf://"  # the hub's URL scheme in huggingface_hub's file system (HfFileSystem)
LOCAL_PREFIXES = ("./", "../", "/")


def open_source(typed: str | Path | HubSpec, *, quiet: bool = True, backend: HubBackend | None = None) -> Source:
    """The source `typed` names (located here, unless it is already a HubSpec), opened:
    `with open_source(typed) as source:`. Unless `quiet`, a hub source's header reads (a
    request per shard: seconds) show a bar; local headers take well under a second. A hub
    source is read through `backend`, by default the Hugging Face Hub's."""
    where = typed if isinstance(typed, HubSpec) else locate(typed, backend=backend)
    if isinstance(where, Path):
        return open_local(where)
    from dsv4.convert.sources.hub_source import open_hub  # start-up time: only hub sources load the network client

    return open_hub(where, quiet=quiet, backend=backend)


def parse_hub_spec(spec: str, backend: HubBackend | None = None) -> HubSpec:
    """`org/name`, `org/name@revision` (a branch, tag or commit; may contain '/'), either
    optionally written `hf://...`; anything else is refused (repo_not_found). `backend`
    (default: the Hugging Face Hub's) says what a repository id is."""
    explicit = spec.startswith(HF_PREFIX)
    repo, at, revision = spec.removeprefix(HF_PREFIX).partition("@")
    ok = (backend or default_backend()).valid_repo_id(repo) and (revision != "" or not at)
    if not ok:
        raise HubError(
            f"{spec}: neither an existing local directory nor a hub repo id [hf://]org/name[@revision]",
            kind="repo_not_found",
            path=str(spec),
        )
    return HubSpec(repo, revision or None, explicit)


def locate(
    typed: str | Path | HubSpec,
    *,
    revision: str | None = None,
    token: str | None = None,
    verify_files: bool = False,
    backend: HubBackend | None = None,
) -> Path | HubSpec:
    """The local directory `typed` names, or the hub repository; source_not_found (19)
    when it can only be a local path that does not exist. `revision`, `token` and
    `verify_files` are the hub options `--revision` and `--token` (as in the `hf` CLI) and
    `--verify-source`: a revision given twice, by option and by `@rev`, must be the same
    one, and none of them applies to a local directory (click.UsageError, exit 2). `backend`:
    the hub whose repository ids are recognised (default: the Hugging Face Hub)."""
    where = typed if isinstance(typed, HubSpec) else _locate(typed, backend)
    if revision is None and token is None and not verify_files:
        return where
    if isinstance(where, Path):
        raise click.UsageError(
            f"--revision, --token and --verify-source are for hub sources; {typed} is a local directory"
        )
    if revision is not None and where.revision not in (None, revision):
        raise click.UsageError(f"{typed} names revision {where.revision!r} but --revision says {revision!r}; give one")
    return replace(
        where,
        revision=revision or where.revision,
        token=token or where.token,
        verify_files=verify_files or where.verify_files,
    )


def _locate(typed: str | Path, backend: HubBackend | None) -> Path | HubSpec:
    text = str(typed)
    if text.startswith(HF_PREFIX):
        return parse_hub_spec(text, backend)
    path = Path(typed)
    if path.exists():
        return path
    repo = text.partition("@")[0]
    if text.startswith(LOCAL_PREFIXES) or repo.count("/") > 1:
        raise CheckpointError(f"{text}: no such local directory", kind="source_not_found", path=text)
    try:
        return parse_hub_spec(text, backend)
    except HubError as exc:
        if exc.kind != "repo_not_found":
            raise
        raise CheckpointError(
            f"{text}: no such local directory (nor a hub repo id [hf://]org/name[@revision])",
            kind="source_not_found",
            path=text,
        ) from None
