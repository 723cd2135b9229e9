"""The commands that run or make a model: `check`, `smoke` and `synth` (convert/cli/main.py puts them on the
command line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from dsv4.convert.cli.common import (
    device_option,
    echo_json,
    json_option,
    native_option,
    quiet_option,
)
from dsv4.model.memory import refuse_unless_torch_fits
from dsv4.model.parity import MIN_TOP1, SMOKE_TOKENS
from dsv4.model.presets import PRESET_NAMES, VARIANTS


@click.command("check")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@native_option
@click.option("--smoke", is_flag=True, help="Load strictly into the bundled model and run a few-token forward.")
@click.option(
    "--fast", is_flag=True, help="Skip hashing the tensor data against conversion.json (says so in the report)."
)
@device_option
@click.option(
    "--junit",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the report as JUnit XML to this file (its folder is created), one test case per check.",
)
@click.option(
    "--serve-with",
    metavar="TARGET",
    help="A draft directory: the target model it is to be served beside (its directory, its config.json, or a hub "
    "repo [hf://]org/name[@revision], of which only config.json is read), with the draft's OUT/serve/"
    "vllm-hf-overrides.json applied where it has one; fails when vLLM would build the draft's layers differently "
    "(another quantisation, another architecture).",
)
@quiet_option
@json_option
def check_command(
    directory: Path,
    native: Path | None,
    smoke: bool,
    fast: bool,
    device: str | None,
    junit: Path | None,
    serve_with: str | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Verify converted checkpoint DIRECTORY; exit with the first failed check's code.

    --native implies --smoke.

    \b
    exit codes: 71 index/headers  72 unreadable tensor  73 sizes  74 checksum
                75 config vs tensors  76 missing  77 unexpected  78 shape  79 dtype
                80 quantisation scheme  81 empty quantisation name (vLLM #44817)
                84 smoke  85 native parity  86 --serve-with: the target builds the draft otherwise
                42 the --junit file could not be written (after the report is printed)
    """
    refuse_unless_torch_fits("check")
    from dsv4.convert.check.report import write_junit
    from dsv4.convert.check.run import run_checks  # start-up time
    from dsv4.model.checkpoint import refuse_full_native

    refuse_full_native(directory, "check")
    report = run_checks(
        directory, native=native, smoke=smoke, fast=fast, device=device, serve_with=serve_with, quiet=quiet or as_json
    )
    if as_json:
        echo_json(report.to_json())
    else:
        if not quiet:
            for r in report.results:
                code = f" [{r.exit_code}]" if r.status == "fail" else ""
                click.echo(f"  {r.status.upper():4} {r.name:9} {r.reason}{code}")
            for line in report.drafter:
                click.echo(f"  {line}")
        click.echo(report.summary())
    if junit is not None:  # after the report: a JUnit file that cannot be written loses nothing else
        write_junit(report, junit)
    report.raise_for_failure()  # main() exits with the failed check's code


@click.command("smoke")
@click.argument("out", type=click.Path(exists=True, file_okay=False, path_type=Path))
@device_option
@click.option(
    "--tokens",
    type=click.IntRange(min=1),
    default=SMOKE_TOKENS,
    show_default=True,
    help="Tokens in the draft step (DSpark: context tokens of random target features).",
)
@native_option
@click.option(
    "--min-top1",
    type=click.FloatRange(0, 1),
    default=MIN_TOP1,
    show_default=True,
    help="With --native: fail when top-1 agreement with the reference is lower (a disagreement on a near-tie, within "
    "1% of max|logit| in the reference, counts as agreeing; DSpark: each draft position given the reference's "
    "previous token). `check --native` applies the same rule.",
)
@click.option(
    "--features",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="DSpark: a safetensors file of target features h_<l> [T_ctx, H] for each of dspark_target_layer_ids "
    "(default: random, seeded).",
)
@click.option(
    "--anchor",
    type=click.IntRange(min=0),
    help="DSpark: the anchor token (the last accepted one; default: random, seeded).",
)
@click.option(
    "--position",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="DSpark: the position of the context's first token.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@quiet_option
@json_option
def smoke_command(
    out: Path,
    device: str | None,
    tokens: int,
    native: Path | None,
    min_top1: float,
    features: Path | None,
    anchor: int | None,
    position: int,
    seed: int,
    quiet: bool,
    as_json: bool,
) -> None:
    """Load converted checkpoint OUT into the bundled draft model and run one draft step
    (MTP: one step on TOKENS tokens; DSpark: one block drafted from a context)."""
    refuse_unless_torch_fits("smoke")
    from dsv4.convert import progress
    from dsv4.convert.inmemory import match_target_figures, model_loader
    from dsv4.convert.served import agreement_line, recorded_agreement
    from dsv4.model.checkpoint import refuse_full_native
    from dsv4.model.errors import LoadError
    from dsv4.model.loader import converted_config  # start-up time: torch and the kernels
    from dsv4.model.parity import parity_verdict
    from dsv4.model.smoke import run_dspark_smoke, run_smoke

    dspark = converted_config(out).is_dspark
    progress.step(
        f"smoke: loading {out} into the bundled model and drafting"
        + (" (then the reference on the native checkpoint)" if native is not None else ""),
        quiet or as_json,
    )
    refuse_full_native(out, "smoke")  # a draft directory in native names is fine; a whole native checkpoint is not
    load = model_loader(out)  # a draft directory (native names): the xpu plan, in memory
    if not dspark and (features is not None or anchor is not None or position):
        raise click.UsageError("--features, --anchor and --position are for a DSpark checkpoint; OUT is an MTP one")
    # a lossy draft (match-target --allow-lossy, its conversion.json says) is not held to parity: it
    # reports its agreement, the figures convert recorded, measured the same way
    lossy = native is not None and not dspark and recorded_agreement(out) is not None
    if dspark:
        try:
            report = run_dspark_smoke(out, device, tokens, features, anchor, position, native, seed, load=load)
        except ValueError as exc:  # an anchor outside the vocabulary
            raise click.UsageError(str(exc)) from None
    else:
        report = run_smoke(out, device, tokens, None if lossy else native, seed, load=load)
    if lossy:
        report["agreement"] = {"measured": True, **match_target_figures(out, native, report["device"], tokens, seed)}
    verdict = parity_verdict(report, min_top1) if native is not None and not lossy else None  # `check --native`'s rule
    if as_json:
        echo_json(report)
    else:
        _print_smoke(report, None if lossy else native, quiet)
        if lossy:
            click.echo(f"  {agreement_line(report['agreement'])}; a lossy match-target draft, not held to parity")
    if verdict is not None and not verdict[0]:
        raise LoadError(
            f"{out}: differs from the reference on {native}: {verdict[1]}", kind="smoke_output", path=str(out)
        )


def _print_smoke(report: dict[str, Any], native: Path | None, quiet: bool) -> None:
    click.echo(f"smoke: {report['checkpoint']} on {report['device']}, fused norms: {report['kernels']}")
    dspark = report.get("layout") == "dspark"
    if dspark:
        click.echo(
            f"  draft tokens {report['draft_tokens']} (anchor {report['anchor']}, block positions "
            f"{report['block_positions'][0]}..{report['block_positions'][-1]})"
        )
    if "confidence" in report:  # V4.1's confidence head
        click.echo(f"  confidence {', '.join(f'{c:.3f}' for c in report['confidence'])}")
    if not quiet:
        if dspark:
            click.echo(
                f"  load {report['load_ms']:.0f} ms; stages {report['hidden_first_ms']:.1f} ms first, "
                f"{report['hidden_warm_ms']:.1f} ms warm; "
                f"heads and sampler {report['logits_first_ms']:.1f} / {report['logits_warm_ms']:.1f} ms"
            )
        else:
            click.echo(
                f"  load {report['load_ms']:.0f} ms; forward {report['forward_first_ms']:.1f} ms first, "
                f"{report['forward_warm_ms']:.1f} ms warm; "
                f"logits {report['logits_first_ms']:.1f} / {report['logits_warm_ms']:.1f} ms"
            )
        click.echo(f"  hidden {report['hidden_shape']}, logits {report['logits_shape']}, all finite")
    if native is None:
        return
    diffs = (
        f"  vs reference {native}: hidden max|diff| {report['hidden_max_abs_diff']:.4g} (max|h| "
        f"{report['hidden_max_abs']:.4g}), "
        f"logits max|diff| {report['logits_max_abs_diff']:.4g} (max {report['logits_max_abs']:.4g}), "
    )
    if dspark:
        diffs += (
            f"reference draft tokens {report['reference_draft_tokens']}, "
            f"agreement {report['draft_token_agreement']:.3f} "
            f"(equal up to position {report['draft_tokens_agree_to']}), "
        )
    if "confidence_max_abs_diff" in report:
        diffs += f"confidence max|diff| {report['confidence_max_abs_diff']:.4g}, "
    click.echo(
        diffs + f"top-1 agreement {report['top1_agreement']:.3f} "
        f"({report['top1_agreement_up_to_ties']:.3f} counting near-ties)"
    )
    for d in report["routing_disagreements"]:
        kind = "a near-tie" if d["near_tie"] else "NOT a near-tie"
        click.echo(
            f"  routing differs at MoE call {d['call']}, token {d['token']}: margin {d['margin']:.4g}, tolerance "
            f"{d['tolerance']:.4g} ({kind})"
        )


def _main_layers_arg(ctx: click.Context, param: click.Parameter, value: str) -> int | str:
    if value == "all":
        return value
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter("expected a number of layers or 'all'") from None


@click.command("synth")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--preset",
    type=click.Choice(PRESET_NAMES),
    help="Released config to replicate (default tiny; with --variant dspark: flash, i.e. V4-Flash-0731; "
    "pro with it is V4-Pro-0813, tiny-pro its tiny sibling).",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="A config.json to use instead of a preset.",
)
@click.option("--variant", type=click.Choice(VARIANTS), default="instruct", show_default=True)
@click.option(
    "--main-layers",
    default="0",
    callback=_main_layers_arg,
    show_default=True,
    help="Main decoder layers to write: K or 'all'.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic tensor data.")
@click.option("--sparse", is_flag=True, help="Headers only; tensor data are file holes (read back as zeros).")
@quiet_option
@json_option
def synth_command(
    out: Path,
    preset: str | None,
    config_path: Path | None,
    variant: str,
    main_layers: int | str,
    seed: int,
    sparse: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Write a synthetic native DeepSeek V4 checkpoint to OUT."""
    refuse_unless_torch_fits("synth")
    from dsv4.convert.synth import synthesize  # start-up time: torch

    if preset and config_path:
        raise click.UsageError("--preset and --config are alternatives; give one")
    try:
        summary = synthesize(
            out,
            preset=preset,
            config_path=config_path,
            variant=variant,
            main_layers=main_layers,
            seed=seed,
            sparse=sparse,
            quiet=quiet or as_json,
        )
    except ValueError as exc:  # a preset or layer count the synthesiser does not have
        raise click.UsageError(str(exc)) from exc
    if as_json:
        echo_json(summary)
    else:
        holes = " (sparse)" if sparse else ""
        size = summary["bytes"]
        click.echo(
            f"synth: {summary['tensors']} tensors in {summary['files']} files, {size:,} bytes ({size / 1e9:.1f} GB) "
            f"logical{holes} -> {out}"
        )
