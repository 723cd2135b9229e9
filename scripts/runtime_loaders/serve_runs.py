"""vLLM's V4 MTP loaders (nvidia, amd, xpu) feeding a draft into the parameters vLLM builds
beside a target (vllm_build, vllm_layer): every parameter filled once, and the values
compared with the native checkpoint's."""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dsv4.convert.schemes.base import module_of
from dsv4.mapping.patterns import expand
from dsv4.mapping.table import Table, load_table, rule_bindings
from dsv4.model.checkpoint import local_weight_map
from dsv4.model.config import ModelConfig
from dsv4.model.reference import fp4_weight, fp8_weight

from .lossy import check_module, measured_record, modules_of
from .recording import Recorder, attrs, read_tensors
from .vllm_build import build_namespace, imports_from, quant_config_for
from .vllm_layer import Built, build_layer
from .vllm_runs import VLLM_CUTS, stand_in_layer, table_facts, vllm_namespace
from .wheels import Wheel

FLOAT_PARAMS = (torch.bfloat16, torch.float16, torch.float32)
# compressed-tensors' weight_shape, a module's logical [rows, cols]: every shard of a fused linear
# writes the whole parameter, the last one stays (BasevLLMParameter, parameter.py:91-104); an expert's
# shards write its row (routed_experts.py:633-639, 983-988) of a parameter in the model dtype
# (compressed_tensors_moe_wna16.py:346-355), which the loader's copy casts the int64 shape into
WHOLE = ".weight_shape"
# NVFP4A16 experts' activation scale: registered in A16 mode, read by no A16 kernel, written 1.0 by the
# converter (convert/schemes/ct_schemes.py); no native value is it
UNREAD_SCALE = "input_global_scale"
# the FP8 block the converter re-blocks FP4 experts into (the FP8_BLOCK preset's block_structure,
# compressed_tensors/quantization/quant_scheme.py:447-454)
FP8_BLOCK = (128, 128)


@dataclass
class Fill:
    tensor: str
    shard: Any
    expert: int | None


@dataclass
class ServeReport:
    loader: str
    methods: dict[str, str] = field(default_factory=dict)  # quant prefix -> vLLM method
    fed: int = 0
    params: int = 0
    filled: int = 0
    errors: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # fed, reaching no parameter
    unfilled: list[str] = field(default_factory=list)  # parameter parts no tensor filled
    twice: list[str] = field(default_factory=list)
    inexact: list[str] = field(default_factory=list)
    # parameters filled from tensors conversion.json records as lossy -> [max abs, rel RMS] error of
    # their modules' decoded weights against the native ones (the worst), and the tensors (lossy, or
    # exact ones re-expressed, recorded 0.0) whose measured error is not the recorded one (lossy.py)
    lossy: dict[str, list[float]] = field(default_factory=dict)
    off_record: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not (self.errors or self.skipped or self.unfilled or self.twice or self.inexact or self.off_record)

    def summary(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"passed": self.passed}


class _Table(dict):
    """params_dict: the built modules' parameters, and the draft's unquantised parameters
    (norms, hc_*, attn_sink, gate: `plain`), each of these taking what it is first fed.
    Any other name is the KeyError vLLM raises."""

    def __init__(self, built: list[Built], plain: list[str], fills: dict[str, list[Fill]], rec: Recorder):
        super().__init__({n: p for b in built for n, p in b.params.items()})
        for name in plain:
            param = types.SimpleNamespace(data=None)
            param.weight_loader = lambda p, loaded, *a, _n=name, **k: self._plain(_n, p, loaded)
            self[name] = param
        self.fills, self.rec = fills, rec

    def _plain(self, name: str, param: Any, loaded: torch.Tensor) -> None:
        self.fills.setdefault(name, []).append(Fill(self.rec.current, None, None))
        param.data = loaded.clone()


class _Named:
    """What named_parameters() returns: (name, parameter) pairs, and the table itself to
    the loader's dict() (both uses are in the wheel: routed_experts.py:1150 iterates,
    nvidia/mtp.py:382 takes a dict)."""

    def __init__(self, table: _Table) -> None:
        self.table = table

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(list(self.table.items()))


def _recording(param: Any, name: str, fills: dict[str, list[Fill]], rec: Recorder) -> None:
    """The parameter's own weight_loader, noting which fed tensor filled which part."""
    real = param.weight_loader

    def load(p: Any, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        shard = kwargs.get("shard_id", args[-1] if args and not isinstance(args[-1], str) else None)
        done = real(p, loaded, *args, **kwargs)  # raises where vLLM raises: then nothing was filled
        if done is not False:  # an expert loader's False: not this rank's expert
            fills.setdefault(name, []).append(Fill(rec.current, shard, kwargs.get("expert_id")))
        return done

    param.weight_loader = load


def unquantised_names(table: Table, config: dict[str, Any], built: list[Built]) -> list[str]:
    """The draft's parameters outside the built modules: the repo's table's targets (vLLM's
    in-memory names, mapping/xpu.toml and xpu_dspark.toml, the names the loaders were verified
    to fill) bound for this config, less those under a built module and the shared
    embedding and head (the target's)."""
    cfg = ModelConfig.from_dict(config)
    _droppable, shared = table_facts(table, config)
    modules = tuple(b.path + "." for b in built)
    names = {
        expand(rule.target, binding)
        for rule in table.rules
        if rule.target and rule.applies(cfg.expert_dtype)
        for binding in rule_bindings(rule, cfg)
    }
    return sorted(n for n in names - shared if not n.startswith(modules))


def expected_parts(b: Built, name: str, n_experts: int) -> set[tuple[Any, Any]]:
    leaf = name.rsplit(".", 1)[1]
    if b.kind == "experts":
        shards = ("w1", "w3") if leaf.startswith("w13_") else ("w2",)
        return {(s, e) for e in range(n_experts) for s in shards}
    return {(s, None) for s in b.shards}


def native_value(fed: str, native: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
    """What the parameter part fed from `fed` holds when it equals the native weights: FP8
    bytes, 2^e for an E8M0 scale in an F32 parameter, the E8M0/e2m1 bytes in a U8 one, the
    dequantised native weight in a bf16 one; None where no native value corresponds (a
    requantised leaf)."""
    base, _, leaf = fed.rpartition(".")
    weight, scale = native.get(base + ".weight"), native.get(base + ".scale")
    if leaf == UNREAD_SCALE:
        return torch.ones(1, dtype=dtype)
    if leaf == "weight_scale" and scale is not None:
        return scale.float() if dtype.is_floating_point else scale.view(torch.uint8)
    if leaf == "weight_packed" and weight is not None and weight.dtype == torch.int8:
        return weight.view(torch.uint8)
    if leaf == "weight" and dtype in FLOAT_PARAMS and weight is not None and scale is not None:
        if weight.dtype == torch.int8:
            return fp4_weight(weight, scale).to(dtype)
        return fp8_weight(weight, scale, (128, 128)).to(dtype)
    same = native.get(fed)
    if same is not None and dtype == torch.uint8 and same.dtype in (torch.float8_e8m0fnu, torch.int8):
        return same.view(torch.uint8)  # the loader's own reinterpretation (nvidia/mtp.py:458-462)
    return same


def _assembled(
    param: Any,
    fills: list[Fill],
    native: dict[str, torch.Tensor],
    held: dict[str, torch.Tensor] | None = None,
    value: Any = native_value,
    dtype: Any = None,
) -> torch.Tensor | None:
    """The parameter as the native values (`value` of each fed tensor, in `dtype`, default the
    parameter's) would fill it at TP 1 (shards stacked in id order on dim 0, w13 = w1 then w3,
    experts by id); a part fed from a tensor held to its record (`held`: no native value is it)
    holds that tensor as the draft has it, of the parameter's dtype (a loader's cast would change
    its bits: not the format the converter wrote)."""
    dtype = dtype or param.data.dtype
    held = held or {}
    if fills and all(f.tensor in held and f.tensor.endswith(WHOLE) for f in fills):
        return _written_whole(param, fills, held)

    def one(fed: str) -> torch.Tensor | None:
        if fed in held:
            return held[fed] if held[fed].dtype == dtype else None
        return value(fed, native, dtype)

    values = {(f.shard, f.expert): one(f.tensor) for f in fills}
    if any(v is None for v in values.values()):
        return None
    if all(f.expert is None for f in fills):
        parts = [values[k] for k in sorted(values, key=lambda k: -1 if k[0] is None else k[0])]
        return torch.cat([p.reshape(-1, *p.shape[1:]) if p.dim() else p.reshape(1) for p in parts]).to(dtype)
    out = param.data.to(dtype, copy=True)
    for e in sorted({f.expert for f in fills}):
        shards = [values[(s, e)] for s in ("w1", "w3", "w2") if (s, e) in values]
        out[e] = torch.cat(shards).to(dtype) if len(shards) > 1 else shards[0].to(dtype)
    return out


def _written_whole(param: Any, fills: list[Fill], held: dict[str, torch.Tensor]) -> torch.Tensor:
    """A WHOLE parameter after its fills, in feeding order: each one overwrites it (per expert a row)."""
    out = param.data.clone()
    for f in fills:
        value = held[f.tensor].to(out.dtype)
        if f.expert is None:
            out = value.reshape(out.shape)
        else:
            out[f.expert] = value
    return out


def _fp4_as_fp8_block(
    name: str, table: dict[str, Any], fills: dict[str, list[Fill]], native: dict[str, torch.Tensor]
) -> bool | None:
    """For an FP8 block weight, or its weight_scale, fed from native FP4 weights (FP4 experts
    re-blocked into FP8): whether weight x its per-128x128 F32 scale equals the native FP4
    weights dequantised (e2m1 x E8M0), the two parameters judged together (their bytes have
    no native counterpart); None for any other parameter."""
    weight = name.removesuffix("_scale")
    w, s, fed = table.get(weight), table.get(f"{weight}_scale"), fills.get(weight)
    # a per-tensor scale (ModelOpt FP8's [experts, shards], modelopt.py:555-572) is no FP8 block's
    if w is None or s is None or not fed or w.data.dtype != torch.float8_e4m3fn or s.data.dim() != w.data.dim():
        return None
    packed = native.get(fed[0].tensor.rpartition(".")[0] + ".weight")
    if packed is None or packed.dtype != torch.int8:
        return None

    def fp4(tensor: str, held: dict[str, torch.Tensor], _dtype: Any) -> torch.Tensor:
        base = tensor.rpartition(".")[0]
        return fp4_weight(held[base + ".weight"], held[base + ".scale"])

    expected = _assembled(w, fed, native, value=fp4, dtype=torch.float32)
    matrices = zip(w.data.reshape(-1, *w.data.shape[-2:]), s.data.reshape(-1, *s.data.shape[-2:]), strict=True)
    got = torch.stack([fp8_weight(m, scale, FP8_BLOCK) for m, scale in matrices]).view(w.data.shape)
    return expected is not None and bool(fills.get(f"{weight}_scale")) and torch.equal(got, expected)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def serve_run(
    wheel: Wheel,
    loader: str,
    draft: Path,
    quantization_config: dict[str, Any],
    native: Path,
    config: dict[str, Any],
    target_quantization: dict[str, Any],
) -> ServeReport:
    """vLLM's `loader` (VLLM_CUTS) on DRAFT, its parameters those vLLM builds under
    `quantization_config` (MTP: the target's effective one; DSpark: the draft's own) with the
    config class `target_quantization` (the target's effective one) names."""
    platform, layout = loader.split("-")[1:]
    report = ServeReport(loader)
    cfg = attrs(config)
    build_ns = build_namespace(wheel, platform)
    qc = quant_config_for(build_ns, quantization_config, target_quantization, platform, layout, cfg)
    start = config["num_hidden_layers"]
    if layout == "mtp":
        n = config.get("num_nextn_predict_layers", 1)
        indices = [start + i for i in range(n)]
    else:
        n = config.get("n_mtp_layers") or 3  # xpu/dspark.py:57, nvidia/dspark.py:106, amd/dspark.py:73
        indices = list(range(n))
    built = [b for i in indices for b in build_layer(build_ns, qc, cfg, layout, i, platform)]
    report.methods = {b.prefix: b.method or b.error for b in built}
    report.errors += [f"{b.prefix}: {b.error}" for b in built if b.error]
    rec, fills = Recorder(), {}
    mapping = load_table("xpu" if layout == "mtp" else "xpu_dspark")
    plain = unquantised_names(mapping, config, built)
    if layout == "dspark" and platform != "xpu" and config.get("vision_n_layers", 0) > 0:
        # a vision model's routers (Vision-Exp): every MoE has a bias_vl, which the xpu table skips
        # (deepseek_v4/nvidia/model.py:311-318, amd/model.py:652-656; XPU's router has none)
        plain += [f"model.layers.{i}.ffn.gate.bias_vl" for i in indices]
    table = _Table(built, plain, fills, rec)
    for name, param in ((n, p) for b in built for n, p in b.params.items()):
        _recording(param, name, fills, rec)
    spec = VLLM_CUTS[loader]
    completeness = [True]
    ns = vllm_namespace(wheel, spec.cuts, rec, completeness)
    ns["dict"] = lambda x=(), **k: x.table if isinstance(x, _Named) else dict(x, **k)

    class StandIn:
        def named_parameters(self) -> _Named:
            return _Named(table)

    model = type(spec.cls, (ns[spec.cls], StandIn), {})()
    model.config, model.quant_config = cfg, qc
    if layout == "mtp":
        layers = {str(i): stand_in_layer() for i in indices}
        model.model = types.SimpleNamespace(layers=layers, mtp_start_layer_idx=start, num_mtp_layers=n)
    else:
        # NVIDIA's and AMD's loaders test whether the class built a confidence head
        # (nvidia/dspark.py:584-585, amd/dspark.py:498-499)
        head = types.SimpleNamespace() if getattr(cfg, "enable_confidence_head", True) else None
        model.model = types.SimpleNamespace(layers=[stand_in_layer() for _ in indices], confidence_head=head)
    # nvidia/mtp.py:308-310, nvidia/dspark.py:362-364: a compressed-tensors config has no weight_block_size
    model.pad_shared_expert = getattr(qc, "weight_block_size", None) is not None
    with imports_from(build_ns):  # RoutedExperts.weight_loader imports inside (routed_experts.py:697-699)
        fed = _feed(model, draft, rec, report, completeness)
    droppable, _shared = table_facts(mapping, config)
    reached = {f.tensor for fs in fills.values() for f in fs}
    errored = {e.split(":", 1)[0] for e in report.errors}
    report.skipped = [t for t in fed if t not in reached and t not in errored and not droppable(t)]
    recorded = _record_checked(draft, native, reached, ModelConfig.from_dict(config), report)
    _account(built, table, fills, _native(native, reached), recorded, config["n_routed_experts"], report)
    return report


@dataclass
class _Recorded:
    values: dict[str, torch.Tensor]  # fed tensor held to its record -> as the draft holds it
    errors: dict[str, tuple[float, float]]  # draft module -> (max abs, rel RMS) measured
    lossy: set[str]  # the fed tensors recorded as lossy


def _record_checked(draft: Path, native: Path, reached: set[str], cfg: ModelConfig, report: ServeReport) -> _Recorded:
    """The fed tensors DRAFT's conversion.json records a measured error of, as the draft holds them;
    each of their modules' error measured and compared with the record (report.off_record)."""
    record = measured_record(draft)
    modules = modules_of(reached & set(record))
    weight_map, _ = local_weight_map(draft)
    held = _read(draft, {n for n in weight_map if module_of(n) in modules})
    natives = _read(native, {f"{m}.{leaf}" for m in modules for leaf in ("weight", "scale")})
    errors = {}
    for m, names in modules.items():
        leaves = {n.rsplit(".", 1)[1]: t for n, t in held.items() if module_of(n) == m}
        checked = check_module(m, leaves, natives, {n: record[n] for n in names}, cfg)
        report.off_record += checked.off_record
        errors[m] = (checked.max_abs_error, checked.rel_rms_error)
    values = {n: held[n] for names in modules.values() for n in names}
    return _Recorded(values, errors, {n for n in values if record[n]["exact"] is False})


def _feed(model: Any, draft: Path, rec: Recorder, report: ServeReport, completeness: list[bool]) -> list[str]:
    """Every DRAFT tensor through load_weights, read as it is fed; an exception is recorded
    against the tensor being loaded and the rest go on (a fresh call, its completeness
    check off: only the first call's is the runtime's)."""
    fed: list[str] = []
    exhausted = False

    def feed() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal exhausted
        for name, tensor in read_tensors(draft):
            rec.current = name
            fed.append(name)
            yield name, tensor
        rec.current, exhausted = "", True

    stream = feed()
    while True:
        try:
            model.load_weights(stream)
            break
        except Exception as exc:  # noqa: BLE001 - the runtime's error is the finding
            report.errors.append(f"{rec.current or '(after the last tensor)'}: {type(exc).__name__}: {exc}")
            completeness[0] = False
            if exhausted:
                break
    report.fed = len(fed)
    return fed


def _native(native: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The native checkpoint's tensors behind the fed names (X.weight and X.scale for X.*)."""
    return _read(native, {n for f in names for n in (f, module_of(f) + ".weight", module_of(f) + ".scale")})


def _read(root: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of checkpoint `root` among `names`."""
    from safetensors import safe_open

    weight_map, _ = local_weight_map(root)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(names & set(weight_map)):
        with safe_open(root / weight_map[name], framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def filled_parameters(
    built: list[Built], table: dict[str, Any], fills: dict[str, list[Fill]], n_experts: int, report: Any
) -> Iterator[tuple[str, Any]]:
    """Each parameter of `table` every part of which (shard, expert) was filled, with the count of
    parameters, those filled, filled twice or not whole recorded in `report` (a ServeReport or a
    V4.1 report: the same fields)."""
    owner = {n: b for b in built for n in b.params}
    report.params = len(table)
    for name, param in sorted(table.items()):
        got = [(f.shard, f.expert) for f in fills.get(name, [])]
        want = expected_parts(owner[name], name, n_experts) if name in owner else {(None, None)}
        if len(got) != len(set(got)):
            report.twice.append(name)
        missing = want - set(got)
        if missing:
            report.unfilled.append(f"{name} ({len(missing)} of {len(want)} parts)")
            continue
        report.filled += 1
        yield name, param


def _account(
    built: list[Built],
    table: _Table,
    fills: dict[str, list[Fill]],
    native: dict[str, torch.Tensor],
    recorded: _Recorded,
    n_experts: int,
    report: ServeReport,
) -> None:
    for name, param in filled_parameters(built, table, fills, n_experts, report):
        try:
            exact = _fp4_as_fp8_block(name, table, fills, native)
            if exact is None:
                expected = _assembled(param, fills[name], native, recorded.values)
                exact = expected is not None and _same(expected.reshape(param.data.shape), param.data)
        except RuntimeError:  # the native values do not even have the parameter's shape
            exact = False
        if not exact:
            report.inexact.append(name)
        errors = [recorded.errors[module_of(f.tensor)] for f in fills[name] if f.tensor in recorded.lossy]
        if errors:  # held as placed (above) and to the recorded error (_record_checked), not to the native value
            report.lossy[name] = [max(e[0] for e in errors), max(e[1] for e in errors)]
