"""What an output is for is visible (issue 19, item 6): `convert-dsv4 targets` lists the
installed targets and their tables, and `--version` and `plan` name the runtime a layout is
that of (the tables' [table] runtime and runtime_class, mapping/*.toml)."""

from __future__ import annotations

import json

from inprocess import run_main

# vLLM 0.33.0's classes for xpu (vllm/models/deepseek_v4/xpu/mtp.py:265, xpu/dspark.py:220); the draft
# tables' runtimes as their [table] sections give them
EXPECTED = [
    {
        "target": "draft",
        "table": "draft",
        "drafter": "mtp",
        "table_version": "1",
        "runtime": "vLLM 0.33.0, SGLang 0.5.23",
        "runtime_class": "vLLM DeepSeekV4MTP (xpu, nvidia, amd); SGLang DeepseekV4ForCausalLMNextN",
    },
    {
        "target": "draft",
        "table": "draft_dspark",
        "drafter": "dspark",
        "table_version": "1",
        "runtime": "vLLM 0.33.0, SGLang 0.5.23",
        "runtime_class": "vLLM DSparkDeepseekV4ForCausalLM; SGLang DeepseekV4ForCausalLMDSpark",
    },
    {
        "target": "xpu",
        "table": "xpu",
        "drafter": "mtp",
        "table_version": "1",
        "runtime": "vLLM 0.33.0",
        "runtime_class": "DeepSeekV4MTP",
    },
    {
        "target": "xpu",
        "table": "xpu_dspark",
        "drafter": "dspark",
        "table_version": "1",
        "runtime": "vLLM 0.33.0",
        "runtime_class": "DSparkDeepseekV4ForCausalLM",
    },
]


def test_targets_lists_each_table_with_its_drafter_version_and_runtime(monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "targets", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == EXPECTED
    code, out, _ = run_main(monkeypatch, capsys, "targets")
    assert code == 0 and out.splitlines() == [
        "draft    draft        drafter mtp     v1    vLLM 0.33.0, SGLang 0.5.23 (vLLM DeepSeekV4MTP (xpu, nvidia, amd); SGLang DeepseekV4ForCausalLMNextN)",
        "draft    draft_dspark drafter dspark  v1    vLLM 0.33.0, SGLang 0.5.23 (vLLM DSparkDeepseekV4ForCausalLM; SGLang DeepseekV4ForCausalLMDSpark)",
        "xpu      xpu          drafter mtp     v1    vLLM 0.33.0 (DeepSeekV4MTP)",
        "xpu      xpu_dspark   drafter dspark  v1    vLLM 0.33.0 (DSparkDeepseekV4ForCausalLM)",
    ]


def test_version_names_the_runtime_of_each_target(monkeypatch, capsys):
    code, out, _ = run_main(monkeypatch, capsys, "--version")
    assert code == 0 and out.endswith("(target draft: vLLM 0.33.0, SGLang 0.5.23; target xpu: vLLM 0.33.0)\n")


def test_plan_names_the_runtime_and_its_class(tiny_native, monkeypatch, capsys):
    code, out, _ = run_main(monkeypatch, capsys, "plan", tiny_native)
    assert (
        code == 0
        and "  draft layout:         MTP (no dspark_* fields in config.json): vLLM 0.33.0 DeepSeekV4MTP\n" in out
    )
    code, out, _ = run_main(monkeypatch, capsys, "plan", tiny_native, "--json")
    plan = json.loads(out)
    assert (plan["runtime"], plan["runtime_class"]) == ("vLLM 0.33.0", "DeepSeekV4MTP")
