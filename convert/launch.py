"""The launch commands that serve a draft directory, one per runtime, from its target file's
serve templates (mapping/targets/TARGET.toml [[card.serve]]): the model card's (convert/batch/card.py)
and OUT/serve/commands.sh's (convert/serving.py), written once here. string.Template fills
them: the commands hold shell and JSON, whose braces str.format would take for fields.
"""

from __future__ import annotations

import json
import shlex
from string import Template

from dsv4.mapping.drafters import NO_DRAFTER, NO_DRAFTER_TITLE
from dsv4.mapping.errors import TableError
from dsv4.mapping.targets import TARGET_DIR, Drafter, Target, drafter_families


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
    family: Drafter | None = None,
) -> str:
    """The serve block: for each runtime of `target`'s card that serves `route` (None: any),
    a comment naming its version (and platforms) and its command serving draft `repo` beside
    `source` (repo ids or paths, quoted here); `overrides`: the path of the draft's launch
    overrides file, `quantization`: the draft's quantisation method (its note); `family`: the
    comment names the platforms serving that drafter family instead, and for the native draft
    (`route` None or "native") its releases."""
    where = f"{TARGET_DIR.name}/{target.name}.toml"
    blocks = []
    for serve in target.card.serve:
        if route is not None and serve.routes is not None and route not in serve.routes:
            continue
        on = dict(family.platforms).get(serve.runtime, serve.platforms) if family is not None else serve.platforms
        platforms = f" ({on})" if on else ""
        # a drafter's release range is its native draft's; a route that renames or requantises
        # tensors was run against the target's runtime versions alone
        ranged = family is not None and route in (None, "native")
        releases = family.releases(target, serve.runtime) if ranged else target.runtime_named(serve.runtime)
        launch = fill(serve.launch, {"overrides": shlex.quote(overrides)}, where) if overrides is not None else ""
        fields = {
            "source": shlex.quote(source),
            "repo": shlex.quote(repo),
            "repo_in_json": _in_single_quoted_json(repo),
            "launch": launch,
        }
        lines = [f"# {releases}{platforms}", fill(serve.command(drafter), fields, where)]
        if serve.note and quantization is not None:
            lines.append("# " + fill(serve.note, {"quantization": quantization}, where))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


LABEL = 22  # the width of `plan`'s labels ("source keys consumed: ")


def drafter_lines(
    family: str | None,
    target: Target,
    *,
    draft: str = "OUT",
    route: str | None = None,
    overrides: str | None = None,
) -> list[str]:
    """What `plan` and `check` say of the drafter family a checkpoint holds (mapping/drafters.py):
    its name, and for a target whose layout runtimes load from disk each runtime's releases
    serving it and its command beside TARGET, the model it drafts for (`draft`: the draft's path),
    then the note."""
    if family is None:
        return []
    if family == NO_DRAFTER:
        return [f"{'drafter:':{LABEL}}{NO_DRAFTER_TITLE}"]
    drafter = drafter_families()[1][family]
    lines = [f"{'drafter:':{LABEL}}{drafter.title}"]
    if target.kind.native_names:
        block = serve_commands(target, "TARGET", draft, drafter.kind, route=route, overrides=overrides, family=drafter)
        lines += [
            f"serve {draft} beside TARGET, the model it drafts for:",
            *(f"  {line}" for line in block.splitlines() if line),
        ]
    if drafter.note:
        lines.append(f"note: {drafter.note}")
    return lines
