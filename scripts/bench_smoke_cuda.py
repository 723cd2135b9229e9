"""The bundled model on an accelerator at real size: `smoke OUT --native NATIVE` and `check OUT --native
NATIVE` of converted directories, each in its own process, with what the CLI's JSON does not say.

    python3 scripts/bench_smoke_cuda.py --native SLICE OUT [OUT ...] [--device cuda] [--tokens 8]
        [--serve-with TARGET] [--same-logits-as DRAFT]

For each OUT and each command: the wall seconds of the whole command, its exit code and verdict (the
CLI's own JSON), the process's peak GPU memory (torch.cuda.max_memory_allocated and
max_memory_reserved: the model and the reference, which run one after the other), its peak RSS
(VmHWM), and how many times each fused RMSNorm kernel was launched through Triton: the launches
are counted at model/kernels.py's `_fused_mtp_input_rmsnorm_into` and `_mtp_shared_head_rmsnorm_into`,
which only the Triton path calls (the torch fallback never does), so a count above zero means the
Triton kernels ran. One JSON line per command on stdout, then a markdown table on stderr.

--serve-with TARGET is passed to `check` (the OUTs are drafts written for that serving target).
--same-logits-as DRAFT: afterwards, in one more process, the logits of one MTP step on smoke's inputs
(model/smoke.py draft_logits, the test tests/model/test_route_load.py runs on the CPU) of each OUT
against DRAFT's (the native draft): bit for bit or not, and the max |difference|; DRAFT itself first,
loaded a second time (whether the device repeats its own logits at all).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# In the child: count the Triton launches, run the CLI, report. SystemExit carries the CLI's exit code.
RUN_AND_REPORT = """
import json, sys, torch
from dsv4.model import kernels
launches = {"fused_input": 0, "shared_head": 0}
def counted(name, fn):
    def launch(*args, **kwargs):
        launches[name] += 1
        return fn(*args, **kwargs)
    return launch
kernels._fused_mtp_input_rmsnorm_into = counted("fused_input", kernels._fused_mtp_input_rmsnorm_into)
kernels._mtp_shared_head_rmsnorm_into = counted("shared_head", kernels._mtp_shared_head_rmsnorm_into)
from dsv4.convert.cli.main import main
sys.argv = ["convert-dsv4", *sys.argv[1:]]
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code or 0
dev = torch.device(DEVICE)
peak = {"exit_code": code, "triton_launches": launches}
if dev.type == "cuda":
    peak |= {"gpu_peak_allocated_MiB": round(torch.cuda.max_memory_allocated(dev) / 2**20),
             "gpu_peak_reserved_MiB": round(torch.cuda.max_memory_reserved(dev) / 2**20)}
peak["peak_rss_MiB"] = round(int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024)
print("REPORT", json.dumps(peak))
"""


def run(command: list[str], device: str) -> dict:
    """One CLI command in a fresh process: wall seconds, its JSON result and the child's report."""
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", RUN_AND_REPORT.replace("DEVICE", repr(device)), *command],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t
    if "REPORT" not in done.stdout:
        sys.exit(f"{' '.join(command)} died ({done.returncode}): {done.stderr.strip()[-2000:]}")
    cli_out, report = done.stdout.rsplit("REPORT", 1)
    return {"command": " ".join(command), "wall_s": round(wall, 2), **json.loads(report), "result": json.loads(cli_out)}


# In the child: each OUT's logits against the first directory's (the native draft), on DEVICE.
SAME_LOGITS = """
import json, sys, torch
from pathlib import Path
from dsv4.convert.inmemory import model_loader
from dsv4.model.loader import load_converted
from dsv4.model.smoke import draft_logits
dev = torch.device(DEVICE)
def logits(path):
    load = model_loader(path) or (lambda d: load_converted(path, d))
    out = draft_logits(load, dev, TOKENS).cpu()
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    return out
native, *outs = map(Path, sys.argv[1:])
expected = logits(native)
for out in outs:
    got = logits(out)
    print(json.dumps({"out": str(out), "against": str(native), "tokens": TOKENS,
                      "bit_for_bit": torch.equal(got, expected),
                      "logits_max_abs_diff": (got - expected).abs().max().item(),
                      "logits_max_abs": expected.abs().max().item()}))
"""


def same_logits(native_draft: Path, outs: list[Path], device: str, tokens: int) -> list[dict]:
    """Each OUT's logits against `native_draft`'s, on `device` (one process, one model at a time)."""
    code = SAME_LOGITS.replace("DEVICE", repr(device)).replace("TOKENS", str(tokens))
    done = subprocess.run(
        [sys.executable, "-c", code, str(native_draft), *map(str, outs)], capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(f"the logits comparison died ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def verdict(row: dict) -> str:
    """The figures a reader compares, from the CLI's JSON (smoke's report, or check's smoke result)."""
    r = row["result"]
    if "checks" in r:  # check: every check's status, then the figures of its smoke and native checks
        statuses = ", ".join(f"{c['name']} {c['status']}" for c in r["checks"])
        details = {
            k: v for c in r["checks"] if c["name"] in ("smoke", "native") for k, v in c.get("details", {}).items()
        }
        return f"{r['summary']}: {statuses}" + (f"; {figures(details)}" if details else "")
    return figures(r)


def figures(r: dict) -> str:
    return (
        f"kernels {r.get('kernels')}, top-1 {r.get('top1_agreement')} "
        f"(up to ties {r.get('top1_agreement_up_to_ties')}), "
        f"hidden {r.get('hidden_max_abs_diff')} / {r.get('hidden_max_abs')}, "
        f"logits {r.get('logits_max_abs_diff')} / {r.get('logits_max_abs')}, "
        f"forward warm {r.get('forward_warm_ms')} ms, load {r.get('load_ms')} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outs", nargs="+", type=Path, help="converted directories (--target xpu or draft)")
    ap.add_argument("--native", required=True, type=Path, help="the native checkpoint they were converted from")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=8, help="smoke's --tokens")
    ap.add_argument("--serve-with", help="check's --serve-with TARGET")
    ap.add_argument("--same-logits-as", type=Path, help="compare each OUT's logits with this draft's")
    args = ap.parse_args()
    rows = []
    serve = ["--serve-with", args.serve_with] if args.serve_with else []
    for out in args.outs:
        common = ["--native", str(args.native), "--device", args.device, "--json"]
        smoke = ["smoke", str(out), "--tokens", str(args.tokens), *common]
        for command in (smoke, ["check", str(out), *common, *serve]):
            rows.append(run(command, args.device))
            print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| command | exit | wall s | GPU peak allocated / reserved MiB | peak RSS MiB | Triton launches "
        "(fused input, shared head) | verdict |\n|---|---:|---:|---|---:|---|---|",
        file=sys.stderr,
    )
    for row in rows:
        n = row["triton_launches"]
        print(
            f"| `{row['command']}` | {row['exit_code']} | {row['wall_s']:.1f} "
            f"| {row.get('gpu_peak_allocated_MiB', '-')} / {row.get('gpu_peak_reserved_MiB', '-')} "
            f"| {row['peak_rss_MiB']} | {n['fused_input']}, {n['shared_head']} | {verdict(row)} |",
            file=sys.stderr,
        )
    if args.same_logits_as is not None:
        for row in same_logits(args.same_logits_as, [args.same_logits_as, *args.outs], args.device, args.tokens):
            print(json.dumps(row), flush=True)
            print(
                f"{row['out']} against {row['against']}: bit for bit {row['bit_for_bit']}, logits max|diff| "
                f"{row['logits_max_abs_diff']:g} of {row['logits_max_abs']:g}",
                file=sys.stderr,
            )


if __name__ == "__main__":
    main()
