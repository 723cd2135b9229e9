"""The model card (README.md) that `batch --push` uploads with a conversion.

The card is made at push time and goes into the same commit as the output; the local OUT
stays exactly the converter's output (check and the output-safety rules see no extra file).
Its front matter is the hub's model-card metadata, written by the hub backend
(convert/hub_protocol.py; huggingface_hub's ModelCardData for the Hugging Face Hub):
`base_model` (the source repo), `library_name` and `tags`. Its body says who
reads the repo and, for a draft directory, how to serve it in vLLM 0.33.0 and SGLang 0.5.23,
from which source commit and with which table and version.

Serve commands, from the runtimes' code:
- vLLM: `--speculative-config` with `method` always given (vllm/config/speculative.py
  1445-1470 guesses the method from the path otherwise); an MTP draft takes
  `num_speculative_tokens` 1 (one trained MTP step), a DSpark draft defaults it to its
  `dspark_block_size` (speculative.py 1592-1599), so it is left out.
- SGLang: `--speculative-algorithm NEXTN` / `DSPARK` with `--speculative-draft-model-path`
  (sglang/srt/arg_groups/kv_cache_hook.py 162-167; README "Serving the draft").
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsv4 import __version__
from dsv4.convert.hub import default_backend
from dsv4.convert.hub_protocol import HubBackend
from dsv4.mapping.table import Table

CARD_NAME = "README.md"
HUB_URL = "https://huggingface.co"
DRAFTER_NAMES = {"mtp": "MTP", "dspark": "DSpark"}


def vllm_command(target: str, draft: str, drafter: str) -> str:
    """`vllm serve` for `target` with `draft` as its separate draft model."""
    config: dict[str, object] = {"method": drafter, "model": draft}
    if drafter == "mtp":
        config["num_speculative_tokens"] = 1
    return f"vllm serve {target} --speculative-config '{json.dumps(config, separators=(',', ':'))}'"


def sglang_command(target: str, draft: str, drafter: str) -> str:
    """`sglang.launch_server` for `target` with `draft` as its draft model."""
    algorithm = "DSPARK" if drafter == "dspark" else "NEXTN"
    return (
        f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {draft}"
    )


def _provenance(source: str, commit: str, table: Table) -> str:
    return (
        f"Converted from [{source}]({HUB_URL}/{source}) at commit `{commit}` by dsv4-convert {__version__} "
        f"with table `{table.name}` version {table.version} ({table.layout}). "
        f"`conversion.json` records the source, the table and every tensor's sha256."
    )


def _draft_body(repo: str, source: str, commit: str, table: Table) -> str:
    kind = DRAFTER_NAMES[table.drafter]
    return f"""# {repo.split("/")[1]}

The {kind} draft model of [{source}]({HUB_URL}/{source}), as a standalone draft directory:
the checkpoint's own tensor names, bytes unchanged, and its config.json byte for byte.
{_provenance(source, commit, table)}

## Serve it

Beside the target model it was converted from ({source}, commit `{commit}`):

```bash
# vLLM 0.33.0 (XPU, CUDA, ROCm)
{vllm_command(source, repo, table.drafter)}

# SGLang 0.5.23
{sglang_command(source, repo, table.drafter)}
```

Always pass `method`: without it vLLM guesses the method from the draft's path. The runtimes
take the embedding and head from the target; `embed.weight` and `head.weight` are here so
that `convert-dsv4 check` and `convert-dsv4 smoke` run on this directory alone.

## Check it

```bash
hf download {repo} --local-dir draft
convert-dsv4 check draft
# TARGET_DIR, the target's local copy: exit 86 if vLLM would build the draft otherwise
convert-dsv4 check draft --serve-with TARGET_DIR
```
"""


def _xpu_body(repo: str, source: str, commit: str, table: Table) -> str:
    kind = DRAFTER_NAMES[table.drafter]
    return f"""# {repo.split("/")[1]}

The {kind} draft of [{source}]({HUB_URL}/{source}) in the in-memory parameter layout of
vLLM 0.33.0's XPU draft model. {_provenance(source, commit, table)}

## What reads it

The reference model bundled with dsv4-convert (`convert-dsv4 smoke`) and `convert-dsv4 check`.
No runtime loads this layout from disk: vLLM's and SGLang's weight loaders read a draft
directory in the checkpoint's own names. To serve the draft, convert with `--target draft`
(`convert-dsv4 hf://{source} OUT --target draft`) or a batch manifest with `target = "draft"`.

```bash
hf download {repo} --local-dir xpu
convert-dsv4 check xpu --smoke
```
"""


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
    serving = table.target == "draft"  # the one target a runtime loads from disk (shared/spec/05 §5.2)
    metadata = {"base_model": source, "library_name": "vllm" if serving else None, "tags": tags}
    body = (_draft_body if serving else _xpu_body)(repo, source, commit, table)
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
