"""`convert-dsv4 check DIR`: verify a converted checkpoint (`--target xpu`) or a draft
directory (`--target draft`), one named check at a time.

Each check passes, fails with its own exit code (convert/exit_codes.py, 71..86) and a
one-line reason naming the file and tensor, or is skipped with the reason why (not
requested, or a check it builds on failed). `run_checks` returns the whole report
(convert/check/report.py: text, JSON, JUnit) for the command (convert/cli/main.py) and for library
callers (the batch job).

The ten checks share one context (convert/check/context.py: what the earlier checks found,
the inventory, the config, the hashes) and run in a fixed order from one table (CHECKS, here);
they live by concern in check_files.py (index, readable, sizes, checksums), check_config.py,
check_model.py (layout, quant, smoke, native) and check_serve.py. What differs between
targets (the layout, how it names blocks and scales, the runtimes) is the target registry's
(mapping/targets.py).

The checks, in order (a later one may need an earlier one's result):
  index      index and shard headers agree: names, shards present, no stray shard, every
             tensor's bytes inside its file, no gaps or overlaps (safetensors' own rule)
  readable   every tensor reads through safetensors, in bounded row blocks
  sizes      the index's total_size and conversion.json's files and sizes match the shards
  checksums  every tensor's sha256 matches conversion.json (skipped with --fast)
  config     the records name the conversion (config.json's layout record for xpu,
             conversion.json for a draft directory) and config.json agrees with the
             tensors: MTP blocks or stages present, expert_dtype, FP8 block size vs scale
             shapes; for a draft directory also architectures/model_type present, the
             experts, and every runtime-read field as the conversion wrote it
  layout     names, shapes and dtypes equal the target's layout for the config: the model's
             own (xpu), or the native draft directory's (draft)
  quant      every linear has a quantisation layer name and resolves to one scheme
  smoke      strict load into the bundled model and a few-token forward (--smoke); for a
             DSpark checkpoint one draft block from a few random target features; a draft
             directory is mapped in memory by the xpu table first (convert/inmemory.py;
             the plan the quant check made)
  native     numerical parity with the reference on the native checkpoint (--native);
             for DSpark also the draft tokens
  serve      a draft directory against the target it is to be served beside
             (--serve-with): vLLM builds the draft's layers from the target's config and
             quantisation, so those fields must be the draft's own
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsv4.convert import progress
from dsv4.convert.check.config import check_config, layout_target
from dsv4.convert.check.context import Context, Skipped
from dsv4.convert.check.files import check_checksums, check_index, check_readable, check_sizes
from dsv4.convert.check.model import check_layout, check_native, check_quant, check_smoke
from dsv4.convert.check.report import CheckReport, CheckResult
from dsv4.convert.check.serve import check_serve
from dsv4.convert.errors import CheckError
from dsv4.convert.exit_codes import exit_code
from dsv4.convert.launch import drafter_lines
from dsv4.convert.serving import OVERRIDES_FILE
from dsv4.mapping.drafters import identify_drafter
from dsv4.model.errors import DSV4Error
from dsv4.model.parity import MAX_REL_DIFF, MIN_TOP1, SMOKE_TOKENS

# each check returns its one-line reason and may fill `details` (kept on failure too)
CHECKS: tuple[tuple[str, Callable[[Context, dict[str, Any]], str]], ...] = (
    ("index", check_index),
    ("readable", check_readable),
    ("sizes", check_sizes),
    ("checksums", check_checksums),
    ("config", check_config),
    ("layout", check_layout),
    ("quant", check_quant),
    ("smoke", check_smoke),
    ("native", check_native),
    ("serve", check_serve),
)


def _load_config(ctx: Context) -> None:
    """config.json through the model's validating loader, as plan, convert and smoke read it;
    a refusal is the config check's finding (75) and the checks needing a config skip."""
    try:
        ctx.config = ctx.checkpoint.config
        ctx.cfg = ctx.checkpoint.model_config
    except DSV4Error as exc:  # missing_config, malformed_config, unsupported_layout
        ctx.config_error = str(exc)


def _drafter(ctx: Context) -> tuple[str | None, list[str]]:
    """The drafter family the checkpoint holds (mapping/drafters.py) and what `check` says of it
    (convert/launch.py: how each runtime serves it); none where the config or the headers could
    not be read (their checks say why)."""
    if ctx.config is None or ctx.headers is None:
        return None, []
    try:
        _, target = layout_target(ctx)
    except CheckError:
        return None, []
    family = identify_drafter(ctx.config, ctx.headers.tensors, target.kind.block)
    recorded = (ctx.record.serve or {}).get("route") if ctx.record is not None else None
    overrides = str(ctx.root / OVERRIDES_FILE) if (ctx.root / OVERRIDES_FILE).exists() else None
    route = recorded if isinstance(recorded, str) else None
    return family, drafter_lines(family, target, draft=str(ctx.root), route=route, overrides=overrides)


def run_checks(
    path: str | Path,
    *,
    native: str | Path | None = None,
    smoke: bool = False,
    fast: bool = False,
    device: str = "cpu",
    tokens: int = SMOKE_TOKENS,
    min_top1: float = MIN_TOP1,
    max_rel_diff: float = MAX_REL_DIFF,
    serve_with: str | Path | None = None,
    quiet: bool = True,
) -> CheckReport:
    """Run every check on the converted checkpoint at `path` and return the report (never
    raises for a failed check; `report.raise_for_failure()` does). `native` (the checkpoint
    it was converted from) implies the smoke run, which then also runs the reference.
    `serve_with` (the target model's directory, config.json or hub repo) checks that a draft
    directory would load beside it in vLLM. Unless `quiet`, a bar over the checks
    (convert/progress.py's rule)."""
    ctx = Context(
        Path(path),
        fast,
        smoke,
        Path(native) if native is not None else None,
        device,
        tokens,
        min_top1,
        max_rel_diff,
        serve_with=str(serve_with) if serve_with is not None else None,
    )
    _load_config(ctx)
    results = []
    bar = progress.bar(len(CHECKS), "check", "check", quiet)
    for name, check in CHECKS:
        bar.set_postfix_str(name)
        start = time.monotonic()
        details: dict[str, Any] = {}
        try:
            result = CheckResult(name, "pass", check(ctx, details))
            ctx.passed.add(name)
        except Skipped as skip:
            result = CheckResult(name, "skip", str(skip))
        except CheckError as exc:
            result = CheckResult(name, "fail", str(exc), exit_code(exc), exc)
        result.details = details
        result.seconds = time.monotonic() - start
        results.append(result)
        bar.update()
    bar.close()
    return CheckReport(str(ctx.root), results, *_drafter(ctx))
