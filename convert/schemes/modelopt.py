"""A ModelOpt serving target (`quant_method: modelopt`).

vLLM 0.33.0 reads the config in ModelOptQuantConfigBase.from_config (modelopt.py:324-410): the
algorithm is `quant_algo` (under `quantization`, or beside quant_method), upper-cased; the
layers left alone are `exclude_modules` (or `ignore`). One algorithm covers every layer not
excluded: linears and the lm-head-like ParallelLMHead (modelopt.py:228-264) and the routed
experts. An excluded layer is matched (is_layer_excluded, modelopt.py:191-226) by
quant_utils.is_layer_skipped's exact rule with fused shards (quant_utils.py:619-692), then as a
substring of the name, then as an fnmatch wildcard; the list is first split (`x*` -> `x`,
`x.*`) and mapped with the V4 rename mapper (apply_vllm_mapper, modelopt.py:266-285), and on
AMD re-keyed from `model.mtp.{i}.` to `model.layers.{N+i}.` (amd/mtp.py:301).

What the draft can be: NVFP4 W4A4 needs activation scales (`input_scale`) that only calibration
gives; requantising into ModelOpt's NVFP4 tensors is not written here. So the exact route is
bf16: the draft's layers excluded through `--hf-overrides`, weights dequantised. There is no
per-layer group to add, so no overlay. NVFP4 targets do not run on XPU (its
supported_quantization has no modelopt_fp4, platforms/xpu.py:113-131), so wo_a in bf16
(readable on NVIDIA, nvidia/ops/o_proj.py:61-103) is refused only for the FP8 algorithms.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from fnmatch import fnmatch
from typing import Any

from dsv4.convert.schemes.base import UNQUANTISED, Decision, ErrorFactory, LayerMap, ServePlan, TargetMethod
from dsv4.convert.schemes.ct_match import FUSED, NEVER_QUANTISED, PLATFORMS, v4_renamed, vllm_name

METHOD = "modelopt"
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")  # modelopt_fp4 (modelopt.py:114-131, 776-783)
FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO")  # modelopt, which XPU runs too
MAX_ENTRY = 1000  # characters of one exclude entry (a module path or a wildcard)


def _refuse(error: ErrorFactory, where: str, field: str, said: str) -> Exception:
    return error(f"{where}: {field} {said}", path=where, field=field)


def _section(qc: Mapping[str, Any]) -> tuple[Mapping[str, Any], str, str]:
    """(where the algorithm and the exclude list live, the field prefix, the exclude key)."""
    if "quantization" in qc:
        return qc["quantization"], "quantization_config.quantization", "exclude_modules"
    return qc, "quantization_config", "ignore" if "ignore" in qc else "exclude_modules"


def parse(qc: Mapping[str, Any], where: str, error: ErrorFactory) -> tuple[str, list[str]]:
    """(algorithm, exclude list) as vLLM reads them; what this converter cannot serve refused."""
    section, prefix, key = _section(qc)
    if not isinstance(section, Mapping):
        raise _refuse(error, where, prefix, f"is {type(section).__name__}, expected an object")
    algo = str(section.get("quant_algo") or "").upper()
    if algo == "NVFP4" and isinstance(qc.get("config_groups"), Mapping) and qc["config_groups"]:
        # weights-only NVFP4 under the W4A4 name is read as W4A16 (modelopt.py:797-812)
        if all(isinstance(g, Mapping) and g.get("input_activations") is None for g in qc["config_groups"].values()):
            algo = "W4A16_NVFP4"
    if algo not in (*NVFP4_ALGOS, *FP8_ALGOS):
        raise _refuse(
            error, where, f"{prefix}.quant_algo", f"{algo or None!r} is not a ModelOpt algorithm this converter serves"
        )
    exclude = section.get(key, [])
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise _refuse(error, where, f"{prefix}.{key}", f"is {type(exclude).__name__}, expected a list of strings")
    for k, entry in enumerate(exclude):
        if len(entry) > MAX_ENTRY:
            raise _refuse(
                error, where, f"{prefix}.{key}[{k}]", f"is {len(entry)} characters long (at most {MAX_ENTRY})"
            )
    return algo, exclude


def _split_wildcards(entries: list[str]) -> list[str]:
    # an entry ending in `x*` also stands for `x.*` (modelopt.py:266-285)
    wild = [len(e) >= 2 and e[-1] == "*" and e[-2] != "." for e in entries]
    return [y for e, w in zip(entries, wild, strict=True) for y in ((e[:-1], e[:-1] + ".*") if w else (e,))]


def _mapped(exclude: list[str], platform: str, n: int, n_mtp: int) -> list[str]:
    # WeightsMapper.apply_list maps every entry (models/utils.py:166-171)
    out = [v4_renamed(e) for e in _split_wildcards(exclude)]
    if platform == "amd":  # align_mtp_quant_config runs apply_vllm_mapper again with the re-keying
        rekey = [(f"model.mtp.{i}.", f"model.layers.{n + i}.") for i in range(n_mtp)]
        out = [next((e.replace(o, r, 1) for o, r in rekey if e.startswith(o)), e) for e in _split_wildcards(out)]
    return out


def excluded(name: str, exclude: list[str], fused: Mapping[str, tuple[str, ...]]) -> bool:
    """is_layer_excluded (modelopt.py:191-226); ValueError where vLLM raises (mixed shards)."""
    if not exclude:
        return False
    leaf = name.rsplit(".", 1)[-1]
    if leaf in fused and name in exclude:
        return True
    if leaf in fused:
        shards = {name.replace(leaf, s) in exclude for s in fused[leaf]}
        if len(shards) > 1:
            raise ValueError(f"exclude_modules covers some shards of {name} but not all, which vLLM refuses")
        skipped = shards.pop()
    elif "experts" in name:
        skipped = any(name in e for e in exclude if "experts" in e)
    else:
        skipped = name in exclude
    return skipped or any(e != name and e in name for e in exclude) or any(fnmatch(name, e) for e in exclude)


def _decisions(
    algo: str, exclude: list[str], layers: LayerMap, where: str, field: str, error: ErrorFactory, why: str
) -> list[Decision]:
    n = layers.num_hidden_layers
    n_mtp = len({m.split(".")[2] for m in layers.parts if m.startswith("model.layers.")})
    out = []
    for m, parts in layers.parts.items():
        name = vllm_name(m)
        said = {}
        for platform in PLATFORMS:
            try:
                said[platform] = NEVER_QUANTISED.search(name) is not None or excluded(
                    name, _mapped(exclude, platform, n, n_mtp), FUSED[platform]
                )
            except ValueError as exc:
                raise error(f"{where}: {exc} (on {platform})", path=where, field=field) from None
        if len(set(said.values())) > 1:
            raise error(
                f"{where}: {field} excludes {name} on {', '.join(p for p in PLATFORMS if said[p])} only; "
                "one draft directory cannot serve both",
                path=where,
                field=field,
            )
        if not said["nvidia"]:
            needs = (
                "the calibrated activation scale input_scale" if algo == "NVFP4" else f"a requantisation into {algo}"
            )
            raise error(
                f"{where}: quantization_config ({algo}) quantises the draft's {name}, which needs {needs}; "
                "this converter does not write it (take --draft-format bf16)",
                path=where,
                field=field.rsplit(".", 1)[0] + ".quant_algo",
            )
        if name.endswith(".attn.wo_a") and algo in FP8_ALGOS:
            raise error(
                f"{where}: the draft's {name} would be bf16, which vLLM's V4 O-projection cannot read on xpu",
                path=where,
                field=field,
            )
        out.append(Decision(name, layers.kinds[m], parts, UNQUANTISED, f"{why}: excluded, bf16"))
    return out


def _with_exclude(qc: Mapping[str, Any], entries: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(dict(qc))
    section = out["quantization"] if "quantization" in out else out
    _, _, key = _section(qc)
    section[key] = [*(section.get(key) or []), *entries]
    return out


def decide(
    qc: Mapping[str, Any] | None, layers: LayerMap, native: Any, where: str, error: ErrorFactory
) -> list[Decision]:
    assert qc is not None
    algo, exclude = parse(qc, where, error)
    _, prefix, key = _section(qc)
    return _decisions(algo, exclude, layers, where, f"{prefix}.{key}", error, "the target's config")


def serve(
    qc: Mapping[str, Any], layers: LayerMap, native: Any, where: str, error: ErrorFactory, route: str, allow_lossy: bool
) -> ServePlan:
    algo, exclude = parse(qc, where, error)
    _, prefix, key = _section(qc)
    field = f"{prefix}.{key}"
    if any(m == "model.main_proj" for m in layers.parts):  # DSpark: its own config (dspark/utils.py:115-117)
        if route not in ("auto", "bf16"):
            raise error(
                f"{where}: --draft-format {route}: a DSpark draft beside a ModelOpt target takes bf16",
                field="--draft-format",
            )
        own = _with_exclude(qc, ["model.*"])  # no mapper touches a DSpark draft's config
        decisions = _decisions(algo, _section(own)[0][key], layers, where, field, error, "dspark")
        return ServePlan(
            "bf16", decisions, None, own, f"{route}: the DSpark draft's own config excludes its layers (bf16, exact)"
        )
    if route == "match-target":
        decisions = _decisions(algo, exclude, layers, where, field, error, "match-target")
        return ServePlan("match-target", decisions, None, dict(qc), f"{route}: the target's config excludes the draft")
    if route != "auto" and route != "bf16":
        raise error(
            f"{where}: --draft-format {route} is not a route for a ModelOpt target: one algorithm covers every layer "
            "it does not exclude (take bf16)",
            path=where,
            field="quantization_config.quant_method",
        )
    numbers = sorted({m.split(".")[2] for m in layers.parts if m.startswith("model.layers.")}, key=int)
    effective = _with_exclude(qc, [f"model.layers.{k}.*" for k in numbers])
    decisions = _decisions(algo, _section(effective)[0][key], layers, where, field, error, "bf16")
    return ServePlan(
        "bf16",
        decisions,
        {"quantization_config": effective},
        effective,
        f"{route}: the draft's layers excluded at launch (bf16, exact)",
    )


ENTRY = TargetMethod(METHOD, "ModelOpt (NVFP4, W4A16_NVFP4, FP8)", decide, serve)
