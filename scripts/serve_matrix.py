"""The proof table of `--serve-with`: every tiny draft x serving target x route, from the
converter's own outputs, checked by the tools that would catch a wrong one.

    .venv/bin/python scripts/serve_matrix.py [--work DIR] [--json FILE] [--only-draft D] [--only-target T]

Per draft (tiny MTP instruct with FP4 experts, tiny Base with FP8 experts, tiny DSpark) x
target (TARGETS) x route (ROUTES), in this one process, through the real command line
(dsv4.convert.cli.main) and scripts/verify_runtimes.py's main():

1. `convert SRC OUT --target draft --serve-with TARGET --draft-format R [--allow-lossy]`: its
   exit code, and on refusal its one line;
2. on success `check OUT --serve-with TARGET --native SRC` (exit code, first failure),
   `smoke OUT --native SRC --json` (exact: the figures against the independent reference are
   the plain `--target draft` output's, bit for bit; else top-1 agreement and logits error);
3. `verify_runtimes.py OUT --serve-with TARGET [--overrides OUT/serve/vllm-hf-overrides.json]
   --native SRC --json` (a DeepSeek fp8 target: `--expected XPU_OUT`, the older mode, since
   that target builds the native draft): per loader, parameters filled, errors, skips,
   exact. SGLang's loader runs where OUT/serve/commands.sh gives an SGLang command.

The markdown table goes to stdout, every figure to --json. The targets' config.json are the
source's with a quantization_config written by compressed-tensors' own ModelCompressor
(what llm-compressor calls when it saves), from the library's preset schemes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.format import _flatten_formats, infer_module_format
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

from dsv4.convert.cli.main import main as cli_main

HERE = Path(__file__).resolve().parent
DRAFTS = {"mtp": [], "base": ["--variant", "base"], "dspark": ["--variant", "dspark"]}
ROUTES = {
    "auto": ["--draft-format", "auto"],
    "native": ["--draft-format", "native"],
    "overlay": ["--draft-format", "overlay"],
    "bf16": ["--draft-format", "bf16"],
    "match-target": ["--draft-format", "match-target"],
    "match-target lossy": ["--draft-format", "match-target", "--allow-lossy"],
}
PLATFORMS = {"nvidia": "vllm-nvidia-mtp", "amd": "vllm-amd-mtp", "xpu": "vllm-xpu-mtp"}
DSPARK_PLATFORMS = {p: f"vllm-{p}-dspark" for p in PLATFORMS}  # vLLM's three DSpark classes
SGLANG = {False: "sglang-nextn", True: "sglang-dspark"}
WO_A = r"re:.*attn\.wo_a$"  # a runnable V4 target's O-projection reads wo_a as FP8 (its own group)


def scheme(preset: str, targets: list[str]) -> Any:
    """compressed-tensors' preset on `targets`, with the format its compressors infer for a Linear."""
    s = preset_name_to_scheme(preset, targets)
    s.format = infer_module_format(torch.nn.Linear, s).value
    return s


def ct_target(preset: str, ignore: list[str], transforms: TransformConfig | None = None) -> Callable[[Path], None]:
    """A compressed-tensors target: `preset` on every Linear (FP8_BLOCK on wo_a first unless
    the preset is FP8_BLOCK), `ignore`d modules, written into DIR/config.json by ModelCompressor."""

    def write(target: Path) -> None:
        groups = {} if preset == "FP8_BLOCK" else {"group_0": scheme("FP8_BLOCK", [WO_A])}
        groups[f"group_{len(groups)}"] = scheme(preset, ["Linear"])
        fmt = _flatten_formats({CompressionFormat(g.format) for g in groups.values()}).value
        n = json.loads((target / "config.json").read_text())["num_hidden_layers"]
        qc = QuantizationConfig(
            config_groups=groups,
            format=fmt,
            quantization_status="compressed",
            ignore=[i.replace("{N}", str(n)) for i in ignore],
        )
        ModelCompressor(quantization_config=qc, transform_config=transforms).update_config(str(target))

    return write


def modelopt_nvfp4(target: Path) -> None:
    """ModelOpt's NVFP4 export (hf_quant_config flattened into config.json, as vLLM reads it)."""
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": ["lm_head"],
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))


def quip() -> TransformConfig:
    """QuIP's two rotations as llm-compressor's QuIP template lays them out
    (src/llmcompressor/modifiers/transform/template/quip.py): V on every Linear's input, its
    inverse fused into the weight; U on the weight's output, undone on the layer's output."""
    args = {"targets": ["Linear"], "ignore": ["lm_head"]}
    v = [TransformArgs(location="input", **args), TransformArgs(location="weight_input", inverse=True, **args)]
    u = [TransformArgs(location="weight_output", **args), TransformArgs(location="output", inverse=True, **args)]
    return TransformConfig(
        config_groups={
            "v": TransformScheme(type="hadamard", apply=v, randomize=True),
            "u": TransformScheme(type="hadamard", apply=u, randomize=True),
        }
    )


TARGETS: dict[str, Callable[[Path], None] | None] = {
    "DeepSeek fp8 (the source)": None,
    "CT FP8_BLOCK": ct_target("FP8_BLOCK", ["lm_head"]),
    "CT W4A16": ct_target("W4A16", ["lm_head"]),
    "CT NVFP4A16": ct_target("NVFP4A16", ["lm_head"]),
    "CT NVFP4": ct_target("NVFP4", ["lm_head"]),
    "CT MXFP4A16": ct_target("MXFP4A16", ["lm_head"]),
    "ModelOpt NVFP4": modelopt_nvfp4,
    "CT W4A16, ignore covers the draft": ct_target("W4A16", ["lm_head", r"re:.*layers\.{N}\..*"]),
    "CT W4A16, ignore re:^mtp.*": ct_target("W4A16", ["lm_head", "re:^mtp.*"]),
    "CT W4A16 + QuIP transform": ct_target("W4A16", ["lm_head"], quip()),
}


def cli(*args: str | Path) -> tuple[int, str, str]:
    """`convert-dsv4 ARGS` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["convert-dsv4", *map(str, args)]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli_main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def load_verify_runtimes() -> Any:
    spec = importlib.util.spec_from_file_location("verify_runtimes", HERE / "verify_runtimes.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if len(lines) == 1 else f"{len(lines)} lines: {' / '.join(lines[:3])}"


def parity(smoke: dict[str, Any]) -> dict[str, Any]:
    """The smoke figures against the reference (timings and shapes aside)."""
    return {k: v for k, v in smoke.items() if isinstance(v, float) and not k.endswith("_ms")}


def loader_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """One loader's report in one shape: the serving mode's ServeReport, or the older mode's
    Report (a DeepSeek fp8 target, verified against the --target xpu output)."""
    if "filled" in summary:
        return {
            "filled": summary["filled"],
            "params": summary["params"],
            "errors": summary["errors"],
            "skipped": summary["skipped"],
            "unfilled": summary["unfilled"] + summary["twice"],
            "inexact": summary["inexact"],
            "passed": summary["passed"],
        }
    hit = summary["parameters_hit"]
    return {
        "filled": hit,
        "params": hit + len(summary["missing"]),
        "errors": summary["errors"],
        "skipped": summary["skipped"],
        "unfilled": summary["missing"],
        "inexact": summary["bytes_unequal"],
        "passed": summary["passed"],
    }


class Matrix:
    """The sources, the targets and the cells, under one work directory."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.vr = load_verify_runtimes()
        self.baseline: dict[str, dict[str, Any]] = {}

    def source(self, draft: str) -> Path:
        src = self.work / draft / "src"
        if not src.exists():
            code, _, err = cli("synth", src, "--preset", "tiny", "-q", *DRAFTS[draft])
            assert code == 0, err
            # the plain draft (no --serve-with) and the xpu layout: what routes are compared with
            for target in ("draft", "xpu"):
                code, _, err = cli(src, self.work / draft / f"plain-{target}", "--target", target, "-q")
                assert code == 0, err
            self.baseline[draft] = self.smoke(self.work / draft / "plain-draft", src)
        return src

    def target(self, draft: str, name: str, writer: Callable[[Path], None] | None) -> Path:
        src = self.source(draft)
        if writer is None:
            return src
        target = self.work / draft / "targets" / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        if not target.exists():
            target.mkdir(parents=True)
            shutil.copy(src / "config.json", target / "config.json")
            writer(target)
        return target

    def smoke(self, out: Path, src: Path) -> dict[str, Any]:
        """smoke's figures against the reference: asked for with no top-1 floor, and kept
        where smoke refuses the output (a lossy one exceeds its 2% limit, and says so)."""
        code, stdout, err = cli("smoke", out, "--native", src, "--min-top1", "0", "--json", "-q")
        figures = json.loads(stdout) if stdout.startswith("{") else {}
        return {"exit": code, **figures, **({"error": one_line(err)} if code else {})}

    def verify(self, out: Path, target: Path, src: Path, draft: str) -> dict[str, Any]:
        dspark = draft == "dspark"
        if target == src:
            argv = [out, "--expected", self.work / draft / "plain-xpu", "--native", src]
        else:
            loaders = list((DSPARK_PLATFORMS if dspark else PLATFORMS).values())
            if "sglang" in (out / "serve" / "commands.sh").read_text():
                loaders.append(SGLANG[dspark])
            argv = [out, "--serve-with", target, "--native", src, *(a for n in loaders for a in ("--loader", n))]
            if (out / "serve" / "vllm-hf-overrides.json").exists():
                argv += ["--overrides", out / "serve" / "vllm-hf-overrides.json"]
        got = self.run_verify(argv)
        if "error" in got:
            return got
        return {"exit": got["exit"], "loaders": {r["loader"]: loader_figures(r) for r in got["reports"]}}

    def run_verify(self, argv: list[Any]) -> dict[str, Any]:
        """verify_runtimes.py ARGV --json in this process: its exit code and reports, or the
        one line it refused with (exit 2); a traceback is a defect of the proof or of the
        draft, kept as the row's error."""
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = self.vr.main([*map(str, argv), "--json"])
            except Exception as exc:
                return {"exit": None, "error": f"traceback: {type(exc).__name__}: {exc}"}
        if code == 2:
            return {"exit": code, "error": one_line(stderr.getvalue())}
        return {"exit": code, "reports": json.loads(stdout.getvalue())}

    def sglang_plain(self, draft: str, name: str) -> dict[str, Any]:
        """SGLang beside a target: the plain `--target draft` output (no --serve-with), which
        SGLang builds by its own config.json whatever the target (docs/serving.md)."""
        src = self.source(draft)
        target = self.target(draft, name, TARGETS[name])
        plain = self.work / draft / "plain-draft"
        got = self.run_verify([plain, "--serve-with", target, "--native", src, "--loader", SGLANG[draft == "dspark"]])
        row = {"draft": draft, "target": name}
        if "error" in got:
            return row | got
        (report,) = got["reports"]
        return row | {"exit": got["exit"], "sglang": loader_figures(report), **report}

    def cell(self, draft: str, name: str, route: str) -> dict[str, Any]:
        src = self.source(draft)
        target = self.target(draft, name, TARGETS[name])
        out = self.work / draft / "out" / f"{target.name}-{route.replace(' ', '-')}"
        shutil.rmtree(out, ignore_errors=True)
        code, _, err = cli(src, out, "--target", "draft", "--serve-with", target, *ROUTES[route], "-q")
        row: dict[str, Any] = {"draft": draft, "target": name, "route": route, "convert": code}
        if code != 0:
            return row | {"refusal": one_line(err)}
        record = json.loads((out / "conversion.json").read_text())["serve"]
        row["chosen"] = record["route"]
        check_code, check_out, check_err = cli("check", out, "--serve-with", target, "--native", src)
        failed = [line.strip() for line in check_out.splitlines() if line.strip().startswith("FAIL")]
        row["check"] = {"exit": check_code, "failed": failed or ([one_line(check_err)] if check_code else [])}
        if check_code:  # which failure: the serving check's, or the parity with the native checkpoint's
            row["check"]["without --native"] = cli("check", out, "--serve-with", target)[0]
        smoke = self.smoke(out, src)
        row["smoke"] = smoke | {"exact": smoke["exit"] == 0 and parity(smoke) == parity(self.baseline[draft])}
        row["verify"] = self.verify(out, target, src, draft)
        return row


def loader_cell(figures: dict[str, Any] | None) -> str:
    if figures is None:
        return "—"
    parts = [f"{'✓' if figures['passed'] else '✗'} {figures['filled']}/{figures['params']}"]
    for label, key in (("err", "errors"), ("skip", "skipped"), ("unfilled", "unfilled"), ("not exact", "inexact")):
        if figures[key]:
            parts.append(f"{len(figures[key])} {label}")
    return " · ".join(parts)


def short(failure: str) -> str:
    """A check's FAIL line as the check's name and the start of its reason (JSON has all of it)."""
    return failure if len(failure) <= 90 else failure[:87] + "..."


def md(text: str) -> str:
    return text.replace("|", "\\|")


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| draft | target | --draft-format | convert | check | smoke vs native "
        "| vLLM nvidia | vLLM amd | vLLM xpu | SGLang |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['draft']} | {r['target']} | {r['route']} "
        if r["convert"] != 0:
            lines.append(head + f"| exit {r['convert']}: {md(r['refusal'])} | | | | | | |")
            continue
        c, s = r["check"], r["smoke"]
        check = "pass" if c["exit"] == 0 else f"exit {c['exit']}: " + md("; ".join(short(f) for f in c["failed"]))
        if c["exit"]:
            check += f" (without --native: exit {c['without --native']})"
        if s["exact"]:
            smoke = "exact"
        elif "agreement" in s or "top1_agreement" in s:
            # a lossy draft: smoke reports the agreement conversion.json records (or, without
            # one, its own figures against the reference)
            a = s.get("agreement", s)
            top1 = "n/a" if a["top1_agreement"] is None else f"{a['top1_agreement']:.3f}"
            smoke = f"top-1 {top1}, logits err {a['logits_max_abs_diff']:.3g} of {a['logits_max_abs']:.3g}"
            smoke += f" (exit {s['exit']})" if s["exit"] else ""
        else:
            smoke = f"exit {s['exit']}: {md(s['error'])}"
        v = r["verify"]
        if "loaders" not in v:
            platforms = [f"not run: {md(v['error'])}"] + [""] * 3
        else:
            loaders = v["loaders"]
            sglang = loaders.get(SGLANG[r["draft"] == "dspark"])
            platforms = [loader_cell(loaders.get(DSPARK_PLATFORMS[p]) or loaders.get(n)) for p, n in PLATFORMS.items()]
            platforms += [loader_cell(sglang) if sglang else "no SGLang command"]
        chosen = f"exit 0 ({r['chosen']})" if r["route"] == "auto" else "exit 0"
        lines.append(head + f"| {chosen} | {check} | {smoke} | " + " | ".join(platforms) + " |")
    return lines


def sglang_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| draft | target | SGLang on the plain draft | quantisation it builds the draft with |",
        "|---|---|---|---|",
    ]
    for r in rows:
        got = loader_cell(r["sglang"]) if "sglang" in r else f"not run: {md(r['error'])}"
        lines.append(f"| {r['draft']} | {r['target']} | {got} | {r.get('methods', {}).get('draft', '')} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--work", type=Path, help="where the sources, targets and outputs go (default: a temporary directory)"
    )
    ap.add_argument("--json", type=Path, help="write every row's figures here")
    ap.add_argument("--only-draft", choices=sorted(DRAFTS), action="append")
    ap.add_argument("--only-target", choices=sorted(TARGETS), action="append")
    args = ap.parse_args(argv)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="serve-matrix-")))
        matrix = Matrix(work)
        rows = [
            matrix.cell(draft, name, route)
            for draft in args.only_draft or DRAFTS
            for name in args.only_target or TARGETS
            for route in ROUTES
        ]
        sglang = [
            matrix.sglang_plain(draft, name)
            for draft in args.only_draft or DRAFTS
            for name in args.only_target or TARGETS
            if TARGETS[name] is not None  # beside the DeepSeek fp8 target: the rows above
        ]
    # the work directory's path is the same in every message: WORK stands for it
    print("\n".join([*table(rows), "", *sglang_table(sglang)]).replace(str(work), "WORK"))
    converted = [r for r in rows if r["convert"] == 0]
    print(
        f"{len(rows)} cells: {len(converted)} converted, {len(rows) - len(converted)} refused; "
        f"{time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "sglang": sglang}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
