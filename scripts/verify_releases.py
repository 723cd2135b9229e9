"""The release table: scripts/verify_runtimes.py over every vLLM and SGLang release in a wheel
directory, for the tiny draft of each drafter family, and the release ranges it proves.

    .venv/bin/python scripts/verify_releases.py [--wheels DIR] [--work DIR] [--vllm X.Y.Z ...] [--sglang X.Y.Z ...]

The drafts are the converter's own, built as the tests build them:
`synth WORK/D/native --preset tiny --variant instruct|base|dspark`, then `convert` of it
to `--target draft` (WORK/D/draft) and `--target xpu` (WORK/D/xpu). Every cell is one run of

    verify_runtimes.py WORK/D/draft --expected WORK/D/xpu --native WORK/D/native --wheels DIR \
        --vllm-version X (or --sglang-version X) --loader L --json

(that script's main(), in this process): "pass", "FAIL" (its first error below the table) or
"-" where release X has no such loader (runtime_loaders/releases.py). The releases run are
every wheel in DIR (default: verify_runtimes' cache) unless --vllm/--sglang name some. A
drafter's proven range, per runtime, runs from the oldest release from which every newer
release run passes every loader it has to the newest release run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import sys
import tempfile
from pathlib import Path

from dsv4.convert.pipeline import convert
from dsv4.convert.synth import write_checkpoint

HERE = Path(__file__).resolve().parent
_SPEC = importlib.util.spec_from_file_location("verify_runtimes", HERE / "verify_runtimes.py")
assert _SPEC and _SPEC.loader
vr = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(vr)
from runtime_loaders.releases import release  # noqa: E402 - beside verify_runtimes, on its sys.path

# drafter family -> (synth's variant, the loaders of each runtime that load it)
DRAFTERS = {
    "v4-mtp": ("instruct", {"vllm": ["vllm-xpu-mtp", "vllm-nvidia-mtp", "vllm-amd-mtp"], "sglang": ["sglang-nextn"]}),
    "base-mtp": (
        "base",
        {"vllm": ["vllm-xpu-mtp", "vllm-nvidia-mtp", "vllm-amd-mtp"], "sglang": ["sglang-nextn"]},
    ),
    "dspark-0731": (
        "dspark",
        {"vllm": ["vllm-xpu-dspark", "vllm-nvidia-dspark", "vllm-amd-dspark"], "sglang": ["sglang-dspark"]},
    ),
}
RUNTIMES = {"vllm": "vLLM", "sglang": "SGLang"}


def build_drafts(work: Path) -> None:
    """Per drafter family: the tiny native checkpoint (`synth --preset tiny`), its --target
    draft and --target xpu outputs, as tests/scripts/test_verify_runtimes.py builds them."""
    for name, (variant, _) in DRAFTERS.items():
        if not (work / name / "xpu" / "config.json").is_file():
            native = write_checkpoint(work / name / "native", preset="tiny", variant=variant, seed=0)
            convert(native, work / name / "draft", target="draft")
            convert(native, work / name / "xpu", target="xpu")


def command(work: Path, wheels: Path, drafter: str, package: str, version: str, loader: str) -> list[str]:
    d = work / drafter
    return [
        str(d / "draft"),
        "--expected",
        str(d / "xpu"),
        "--native",
        str(d / "native"),
        "--wheels",
        str(wheels),
        f"--{package}-version",
        version,
        "--loader",
        loader,
        "--json",
    ]


def cell(argv: list[str]) -> tuple[str, str]:
    """verify_runtimes' main() on `argv`: ("pass" | "FAIL" | "-", the first error)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = vr.main(argv)
    if code == 2:  # a usage error: a wheel or file the release has not
        return "FAIL", err.getvalue().strip()
    (report,) = json.loads(out.getvalue())
    if report["not_in_release"]:
        return "-", ""
    first = [*report["errors"], *(f"skipped {t}" for t in report["skipped"])]
    first += [f"missing {p}" for p in report["missing"]] + [f"bytes unequal {p}" for p in report["bytes_unequal"]]
    return ("pass", "") if report["passed"] else ("FAIL", first[0] if first else "")


def releases_in(wheels: Path, package: str) -> list[str]:
    return sorted({p.name.split("-")[1] for p in wheels.glob(f"{package}-*.whl")}, key=release)


def proven(results: dict[str, str]) -> str | None:
    """The range `results` (release -> the worst cell of its loaders, oldest first) proves: from
    the oldest release after the newest one not passing (a failure, or no such loader)."""
    newest = list(results)[-1]
    first = None
    for version, verdict in reversed(results.items()):
        if verdict != "pass":
            break
        first = version
    return None if first is None else f"{first}-{newest}" if first != newest else first


def runtime_table(work: Path, wheels: Path, package: str, versions: list[str]) -> tuple[list[str], list[str]]:
    columns = [(d, loader) for d, (_, by) in DRAFTERS.items() for loader in by[package]]
    lines = [
        "| release | " + " | ".join(f"{d} {loader.split('-', 1)[1]}" for d, loader in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    errors: list[str] = []
    worst: dict[str, dict[str, str]] = {d: {} for d in DRAFTERS}
    per_loader: dict[tuple[str, str], dict[str, str]] = {c: {} for c in columns}
    for version in versions:
        row = []
        for d, loader in columns:
            verdict, error = cell(command(work, wheels, d, package, version, loader))
            row.append(verdict)
            per_loader[d, loader][version] = verdict
            if error:
                errors.append(f"{RUNTIMES[package]} {version} {d} {loader}: {error}")
            held = worst[d].get(version, "-")
            worst[d][version] = "FAIL" if "FAIL" in (held, verdict) else "pass" if "pass" in (held, verdict) else "-"
        lines.append(f"| {version} | " + " | ".join(row) + " |")
    ranges = [
        f"{d}: {RUNTIMES[package]} {proven(by_version) or 'none'} ("
        + ", ".join(f"{loader} {proven(per_loader[d, loader]) or 'none'}" for loader in DRAFTERS[d][1][package])
        + ")"
        for d, by_version in worst.items()
    ]
    return lines + [""] + errors, ranges


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", type=Path, default=vr.wheel_cache(), help="the wheel directory (every release in it)")
    ap.add_argument("--work", type=Path, help="where the tiny drafts go (default: a temporary directory)")
    ap.add_argument("--vllm", nargs="*", metavar="X.Y.Z", help="only these vLLM releases")
    ap.add_argument("--sglang", nargs="*", metavar="X.Y.Z", help="only these SGLang releases")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="releases-")))
        build_drafts(work)
        out, ranges = [], []
        for package, chosen in (("vllm", args.vllm), ("sglang", args.sglang)):
            versions = sorted(chosen or releases_in(args.wheels, package), key=release)
            if not versions:
                continue
            lines, proved = runtime_table(work, args.wheels, package, versions)
            out += [f"### {RUNTIMES[package]}", "", *lines, ""]
            ranges += proved
        template = " ".join(command(Path("WORK"), args.wheels, "D", "PACKAGE", "X", "L"))
        print("\n".join([*out, "each cell: verify_runtimes.py " + template, "", "proven:", *ranges]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
