"""The launch commands that serve a draft directory, one per runtime, from its target file's
serve templates (mapping/targets/TARGET.toml [[card.serve]]): the model card's (convert/batch/card.py)
and OUT/serve/commands.sh's (convert/serving.py), written once here. string.Template fills
them: the commands hold shell and JSON, whose braces str.format would take for fields.
"""

from __future__ import annotations

import json
import shlex
from string import Template

from dsv4.mapping.errors import TableError
from dsv4.mapping.targets import TARGET_DIR, Target


def fill(template: str, fields: dict[str, str], where: str) -> str:
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
        launch = fill(serve.launch, {"overrides": shlex.quote(overrides)}, where) if overrides is not None else ""
        fields = {
            "source": shlex.quote(source),
            "repo": shlex.quote(repo),
            "repo_in_json": _in_single_quoted_json(repo),
            "launch": launch,
        }
        lines = [f"# {target.runtime_named(serve.runtime)}{platforms}", fill(serve.command(drafter), fields, where)]
        if serve.note and quantization is not None:
            lines.append("# " + fill(serve.note, {"quantization": quantization}, where))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
