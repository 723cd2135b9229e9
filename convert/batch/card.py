"""The model card (README.md) that `batch --push` uploads with a conversion.

The card is made at push time and goes into the same commit as the output; the local OUT
stays exactly the converter's output (check and the output-safety rules see no extra file).
Its front matter is the hub's model-card metadata, written by the hub backend
(convert/sources/hub_protocol.py; huggingface_hub's ModelCardData for the Hugging Face Hub):
`base_model` (the source repo), `library_name` and `tags`. Its body is the target's card
template (mapping/targets/TARGET.toml `[card]`): who reads the repo and, for a target
runtimes load from disk (a draft directory), how to serve it in the runtime versions of its
target (beside the model it was converted from, or, for a draft made for a serving target,
beside that target by the route its conversion.json records), from which source commit and
with which table and version. What is per target (the template, the serve commands with
their flags, the runtimes) is that data; this module and convert/launch.py (the commands)
fill it in (string.Template: the bodies hold shell and JSON, whose braces str.format would
take for fields).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsv4 import __version__
from dsv4.convert.launch import fill, serve_commands
from dsv4.convert.serving import OVERRIDES_FILE, quant_method
from dsv4.convert.sources.hub import default_backend
from dsv4.convert.sources.hub_protocol import HubBackend
from dsv4.mapping.table import Table
from dsv4.mapping.targets import TARGET_DIR, Target, drafter_families, require_target
from dsv4.model.checkpoint import CONFIG
from dsv4.model.record import ConversionRecord
from dsv4.model.strictjson import loads

CARD_NAME = "README.md"
HUB_URL = "https://huggingface.co"
DRAFTER_NAMES = {"mtp": "MTP", "dspark": "DSpark"}
CHECKOUT = "draft"  # the folder the card's `hf download $repo --local-dir draft` fills: where its overrides file is


def _provenance(source: str, commit: str, table: Table) -> str:
    return (
        f"Converted from [{source}]({HUB_URL}/{source}) at commit `{commit}` by dsv4-convert {__version__} "
        f"with table `{table.name}` version {table.version} ({table.layout}). "
        f"`conversion.json` records the source, the table and every tensor's sha256."
    )


def _serve_block(
    target: Target, source: str, commit: str, repo: str, table: Table, out: Path | None
) -> tuple[str, str]:
    """($beside, $serve): what the draft serves beside and the commands; for a draft made for
    a serving target (conversion.json's "serve", OUT/serve/), that target, its route and
    launch overrides. A table of one drafter family (V4.1's) names that family's platforms."""
    drafter = table.drafter
    family = drafter_families()[1][table.family] if table.family is not None else None
    record = ConversionRecord.find(out) if out is not None else None
    serve = record.serve if record is not None else None
    if serve is None:
        beside = f"the target model it was converted from ({source}, commit `{commit}`)"
        return beside, serve_commands(target, source, repo, drafter, family=family)
    assert out is not None  # a record was read from it
    at = serve["target"]
    name = at.get("repo") or at.get("path")
    pinned = f", commit `{at['commit']}`" if "commit" in at else ""
    overrides = f"{CHECKOUT}/{OVERRIDES_FILE}" if OVERRIDES_FILE in serve.get("files", {}) else None
    config = loads((out / CONFIG).read_bytes())
    commands = serve_commands(
        target,
        name,
        repo,
        drafter,
        route=serve["route"],
        overrides=overrides,
        quantization=quant_method(config),
        family=family,
    )
    return f"{name}{pinned}, the target it was made for (route {serve['route']}: {serve['why']})", commands


def card_body(repo: str, source: str, commit: str, table: Table, target: Target, out: Path | None = None) -> str:
    """`target`'s card template filled in for `repo`, the conversion of `source` at `commit`
    (in `out`, whose records say what it serves beside)."""
    beside, serve = _serve_block(target, source, commit, repo, table, out)
    fields = {
        "name": repo.split("/")[1],
        "drafter": drafter_families()[1][table.family].title if table.family else DRAFTER_NAMES[table.drafter],
        "source": source,
        "repo": repo,
        "commit": commit,
        "hub": HUB_URL,
        "provenance": _provenance(source, commit, table),
        "beside": beside,
        "serve": serve,
        **{runtime: f"{runtime} {version}" for runtime, version in target.runtimes},
    }
    return fill(target.card.template(), fields, f"{TARGET_DIR.name}/{target.card.body}")


def model_card(
    repo: str, source: str, commit: str, table: Table, backend: HubBackend | None = None, *, out: Path | None = None
) -> str:
    """README.md for `repo` on `backend` (default: the Hugging Face Hub), holding the
    conversion of `source` at `commit` with `table` (in `out`)."""
    tags = [
        "deepseek_v41" if table.family == "v41-dspark" else "deepseek_v4",
        table.drafter,
        "speculative-decoding",
        "draft-model",
        "dsv4-convert",
        f"target-{table.target}",
    ]
    target = require_target(table.target)
    metadata = {"base_model": source, "library_name": target.card.library_name, "tags": tags}
    body = card_body(repo, source, commit, table, target, out)
    return (backend or default_backend()).model_card(metadata, body)


@contextmanager
def with_card(out: Path, card: str) -> Iterator[Path]:
    """A folder holding `out`'s files (links to them, never copies) and README.md = `card`,
    to upload as one commit; it lives in the system's temporary directory and is removed
    after, so nothing in or beside OUT changes."""
    with tempfile.TemporaryDirectory(prefix="dsv4-push-") as tmp:
        staged = Path(tmp)
        for f in out.iterdir():
            if f.is_dir():  # OUT/serve/: a folder of links, as an upload walks folders but not linked ones
                (staged / f.name).mkdir()
                for inner in f.iterdir():
                    os.symlink(inner.resolve(), staged / f.name / inner.name)
            elif f.name != CARD_NAME:
                os.symlink(f.resolve(), staged / f.name)
        (staged / CARD_NAME).write_text(card, encoding="utf-8")
        yield staged
