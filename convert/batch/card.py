"""The model card (README.md) that `batch --push` uploads with a conversion.

The card is made at push time and goes into the same commit as the output; the local OUT
stays exactly the converter's output (check and the output-safety rules see no extra file).
Its front matter is the hub's model-card metadata, written by the hub backend
(convert/sources/hub_protocol.py; huggingface_hub's ModelCardData for the Hugging Face Hub):
`base_model` (the source repo), `library_name` and `tags`. Its body is the target's card
template (mapping/targets/TARGET.toml `[card]`): who reads the repo and, for a target
runtimes load from disk (a draft directory), how to serve it in the runtime versions of its
target, from which source commit and with which table and version. What is per target (the
template, the serve commands with their flags, the runtimes) is that data; this module fills
it in (string.Template: the bodies hold shell and JSON, whose braces str.format would take
for fields).
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from string import Template

from dsv4 import __version__
from dsv4.convert.sources.hub import default_backend
from dsv4.convert.sources.hub_protocol import HubBackend
from dsv4.mapping.errors import TableError
from dsv4.mapping.table import Table
from dsv4.mapping.targets import TARGET_DIR, Target, require_target

CARD_NAME = "README.md"
HUB_URL = "https://huggingface.co"
DRAFTER_NAMES = {"mtp": "MTP", "dspark": "DSpark"}


def _fill(template: str, fields: dict[str, str], where: str) -> str:
    try:
        return Template(template).substitute(fields)
    except (KeyError, ValueError) as exc:  # an unknown $name, or a lone $
        raise TableError(
            f"{where}: the card template names {exc} (it may name ${', $'.join(sorted(fields))})",
            kind="malformed_table",
            path=where,
        ) from None


def _in_single_quoted_json(text: str) -> str:
    """`text` as a JSON string's content inside a shell word quoted '...' (the commands'
    --speculative-config): JSON's escapes, then each ' closed, escaped and reopened."""
    return json.dumps(text)[1:-1].replace("'", "'\\''")


def serve_commands(
    target: Target,
    source: str,
    repo: str,
    drafter: str,
    *,
    route: str | None = None,
    overrides: str | None = None,
    quantization: str | None = None,
) -> str:
    """The serve block: for each runtime of `target`'s card that serves `route` (None: any),
    a comment naming its version (and platforms) and its command serving draft `repo` beside
    `source` (repo ids or paths, quoted here); `overrides`: the path of the draft's launch
    overrides file, `quantization`: the draft's quantisation method (its note)."""
    where = f"{TARGET_DIR.name}/{target.name}.toml"
    blocks = []
    for serve in target.card.serve:
        if route is not None and serve.routes is not None and route not in serve.routes:
            continue
        platforms = f" ({serve.platforms})" if serve.platforms else ""
        launch = _fill(serve.launch, {"overrides": shlex.quote(overrides)}, where) if overrides is not None else ""
        fields = {
            "source": shlex.quote(source),
            "repo": shlex.quote(repo),
            "repo_in_json": _in_single_quoted_json(repo),
            "launch": launch,
        }
        lines = [f"# {target.runtime_named(serve.runtime)}{platforms}", _fill(serve.command(drafter), fields, where)]
        if serve.note and quantization is not None:
            lines.append("# " + _fill(serve.note, {"quantization": quantization}, where))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _provenance(source: str, commit: str, table: Table) -> str:
    return (
        f"Converted from [{source}]({HUB_URL}/{source}) at commit `{commit}` by dsv4-convert {__version__} "
        f"with table `{table.name}` version {table.version} ({table.layout}). "
        f"`conversion.json` records the source, the table and every tensor's sha256."
    )


def card_body(repo: str, source: str, commit: str, table: Table, target: Target) -> str:
    """`target`'s card template filled in for `repo`, the conversion of `source` at `commit`."""
    fields = {
        "name": repo.split("/")[1],
        "drafter": DRAFTER_NAMES[table.drafter],
        "source": source,
        "repo": repo,
        "commit": commit,
        "hub": HUB_URL,
        "provenance": _provenance(source, commit, table),
        "serve": serve_commands(target, source, repo, table.drafter),
        **{runtime: f"{runtime} {version}" for runtime, version in target.runtimes},
    }
    return _fill(target.card.template(), fields, f"{TARGET_DIR.name}/{target.card.body}")


def model_card(repo: str, source: str, commit: str, table: Table, backend: HubBackend | None = None) -> str:
    """README.md for `repo` on `backend` (default: the Hugging Face Hub), holding the
    conversion of `source` at `commit` with `table`."""
    tags = [
        "deepseek_v4",
        table.drafter,
        "speculative-decoding",
        "draft-model",
        "dsv4-convert",
        f"target-{table.target}",
    ]
    target = require_target(table.target)
    metadata = {"base_model": source, "library_name": target.card.library_name, "tags": tags}
    body = card_body(repo, source, commit, table, target)
    return (backend or default_backend()).model_card(metadata, body)


@contextmanager
def with_card(out: Path, card: str) -> Iterator[Path]:
    """A folder holding `out`'s files (links to them, never copies) and README.md = `card`,
    to upload as one commit; it lives in the system's temporary directory and is removed
    after, so nothing in or beside OUT changes."""
    with tempfile.TemporaryDirectory(prefix="dsv4-push-") as tmp:
        staged = Path(tmp)
        for f in out.iterdir():
            if f.name != CARD_NAME:
                os.symlink(f.resolve(), staged / f.name)
        (staged / CARD_NAME).write_text(card, encoding="utf-8")
        yield staged
