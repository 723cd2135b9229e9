"""Which config group (or ignore) vLLM 0.33.0 gives each draft module beside a compressed-tensors
target, on each platform, by vLLM's own rules, re-written here because vLLM is not a dependency
(tests/convert/test_schemes_ct.py runs the wheel's functions beside these on every name):

* the target's configure_quant_config maps exact-path entries (a "." in it, no "re:") of
  `ignore` and the targets with the V4 rename mapper (model_loader/utils.py:367-387;
  compressed_tensors.py:129-157; nvidia/model.py:1226-1269, utils.py:180-199): `layers.` ->
  `model.layers.`, `mtp.` -> `model.mtp.`, `.shared_experts.w2` -> `.shared_experts.down_proj`;
  AMD's MTP then re-keys `model.mtp.{i}.` to `model.layers.{N+i}.` (amd/mtp.py:301,
  deepseek_v4/quant_config.py:33-57);
* ignore first (get_scheme_dict, compressed_tensors.py:1012-1015): an entry equal to the name or
  an `re:` entry re.match-ing it; a fused layer's shards all ignored or none, a mix raises
  (utils.py:53-70, config_utils.py:384-420);
* then targets in order: the name (equal or re.match), the fused shards all matching, then the
  class name (an `re:` entry re.match-ing it, any other entry contained in it, ignoring case)
  (utils.py:73-176, config_utils.py:431-452); "RoutedExperts" takes the "Linear" scheme
  (compressed_tensors.py:221-232);
* routed experts are probed as `experts.0.{gate,up,down}` under the checkpoint names: w1/w3/w2
  on NVIDIA (nvidia/model.py:435), gate_proj/up_proj/down_proj on XPU and AMD, whose
  FusedMoEFactory calls pass none (xpu/model.py:722-737, amd/model.py:749-763;
  fused_moe/layer.py:125); the three must agree (compressed_tensors_moe.py:36-58).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from dsv4.convert.schemes.base import ErrorFactory
from dsv4.convert.schemes.bounded_re import match_table
from dsv4.convert.schemes.ct_config import CtConfig, Group
from dsv4.model.layout import LayerKind

Platform = Literal["nvidia", "amd", "xpu"]
PLATFORMS: tuple[Platform, ...] = ("nvidia", "amd", "xpu")
# the target model's packed_modules_mapping, which the draft's quant config keeps
# (nvidia/model.py:1323-1327, xpu/model.py:1308-1312, amd/model.py:1524-1527 via amd/mtp.py:295)
FUSED: dict[Platform, dict[str, tuple[str, ...]]] = {
    "nvidia": {"gate_up_proj": ("w1", "w3"), "fused_wqa_wkv": ("wq_a", "wkv"), "fused_wkv_wgate": ("wkv", "wgate")},
    "xpu": {"gate_up_proj": ("w1", "w3"), "fused_wqa_wkv": ("wq_a", "wkv"), "fused_wkv_wgate": ("wkv", "wgate")},
    "amd": {"gate_up_proj": ("w1", "w3"), "fused_wqa_wkv": ("wq_a", "wkv")},
}
EXPERT_PROBES: dict[Platform, tuple[str, str, str]] = {
    "nvidia": ("w1", "w3", "w2"),
    "xpu": ("gate_proj", "up_proj", "down_proj"),
    "amd": ("gate_proj", "up_proj", "down_proj"),
}
# each module's vLLM class and its bases (linear.py:245-1653, vocab_parallel_embedding.py:578,
# fused_moe/routed_experts.py:73): matched by name in targets, by the MRO in transforms
MRO = {
    "ReplicatedLinear": ("ReplicatedLinear", "LinearBase", "PluggableLayer", "Module"),
    "ColumnParallelLinear": ("ColumnParallelLinear", "LinearBase", "PluggableLayer", "Module"),
    "MergedColumnParallelLinear": (
        "MergedColumnParallelLinear",
        "ColumnParallelLinear",
        "LinearBase",
        "PluggableLayer",
        "Module",
    ),
    "RowParallelLinear": ("RowParallelLinear", "LinearBase", "PluggableLayer", "Module"),
    "ParallelLMHead": ("ParallelLMHead", "VocabParallelEmbedding", "PluggableLayer", "Module"),
    "RoutedExperts": ("RoutedExperts", "PluggableLayer", "Module"),
}
# by the module's last name (attention.py:252-287, nvidia/mtp.py:103-118, nvidia/model.py:153-168,
# deepseek_mtp.py:65-70, nvidia/dspark.py:115-121, 142-150)
CLASS_OF = {
    "e_proj": "ReplicatedLinear",
    "h_proj": "ReplicatedLinear",
    "main_proj": "ReplicatedLinear",
    "fused_wqa_wkv": "MergedColumnParallelLinear",
    "context_wkv_proj": "MergedColumnParallelLinear",
    "gate_up_proj": "MergedColumnParallelLinear",
    "wq_b": "ColumnParallelLinear",
    "wo_a": "ColumnParallelLinear",
    "wo_b": "RowParallelLinear",
    "down_proj": "RowParallelLinear",
    "head": "ParallelLMHead",
    "experts": "RoutedExperts",
}
# built without a quant_config, so no config reaches them: the router (nvidia/model.py:268-274),
# the MTP embedding (nvidia/mtp.py:245-248), DSpark's heads (nvidia/dspark.py:108-113, 168-180, 369-373)
NEVER_QUANTISED = re.compile(r"(^|\.)(gate|embed_tokens|lm_head|markov_w1|markov_w2)$")
# the V4 rename mapper's renames of a module path (nvidia/model.py:1249-1268, get_rename_mapper
# dropping the None entries, utils.py:180-199); its `.scale` regexes and `.weight` suffixes name
# tensors, never a module path a config entry can hold
PREFIXES = (("layers.", "model.layers."), ("embed.", "model.embed."), ("norm.", "model.norm."))
PREFIXES += (("hc_head", "model.hc_head"), ("mtp.", "model.mtp."))
SUBSTR = ((".shared_experts.w2", ".shared_experts.down_proj"),)
SUFFIXES = ((".ffn.gate.bias", ".ffn.gate.e_score_correction_bias"),)


def v4_renamed(entry: str) -> str:
    """`entry` as the V4 rename mapper (above) maps one module path: substrings, then
    prefixes, then suffixes, each once."""
    for old, new in SUBSTR:
        entry = entry.replace(old, new, 1) if old in entry else entry
    for old, new in PREFIXES:
        entry = entry.replace(old, new, 1) if entry.startswith(old) else entry
    for old, new in SUFFIXES:
        entry = new.join(entry.rsplit(old, 1)) if entry.endswith(old) else entry
    return entry


IGNORED = "ignored"


class Refused(ValueError):
    """Where vLLM raises for a module: the message and the config field at fault."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def vllm_name(module: str) -> str:
    """The quantisation prefix vLLM gives a module of the repo's layer map: SharedHead is built
    with the layer's prefix, so its head is `model.layers.{L}.head` (nvidia/mtp.py:136-138,
    deepseek_mtp.py:65-70), not `.shared_head.head`."""
    return module.replace(".shared_head.head", ".head")


def class_of(module: str) -> str:
    return CLASS_OF[module.rsplit(".", 1)[-1]]


def _map_path(entry: str, platform: Platform, n: int, n_mtp: int) -> str:
    if "." not in entry or entry.startswith("re:"):
        return entry
    entry = v4_renamed(entry)
    if platform == "amd":
        for i in range(n_mtp):
            old = f"model.mtp.{i}."
            entry = entry.replace(old, f"model.layers.{n + i}.", 1) if entry.startswith(old) else entry
    return entry


@dataclass(frozen=True)
class DraftModule:
    name: str  # vLLM's quantisation prefix
    kind: LayerKind


def probe_names(module: DraftModule, platform: Platform) -> list[str]:
    """The names vLLM asks the config about for `module` on `platform` (shards and expert probes
    included): every string a target's regular expression is matched against."""
    if module.kind == "moe":
        return [f"{module.name}.0.{p}" for p in EXPERT_PROBES[platform]]
    leaf = module.name.rsplit(".", 1)[-1]
    return [module.name, *(module.name.replace(leaf, s) for s in FUSED[platform].get(leaf, ()))]


class Resolver:
    """The target's config as vLLM holds it on one platform, answering get_scheme_dict."""

    def __init__(
        self,
        config: CtConfig,
        platform: Platform,
        n: int,
        n_mtp: int,
        regex: Mapping[str, frozenset[str]],
        *,
        target_model: bool = True,
    ) -> None:
        """`target_model`: the config was mapped by the target model (an MTP draft shares it);
        False for a DSpark draft's own, which no mapper or fused mapping touches
        (nvidia/dspark.py:348-373 has neither)."""
        self.platform = platform
        self.fused = FUSED[platform] if target_model else {}
        keep = not target_model
        self.ignore = [e if keep else _map_path(e, platform, n, n_mtp) for e in config.ignore]
        targets: dict[str, Group] = {}
        for t, g in config.targets.items():
            targets[t if keep else _map_path(t, platform, n, n_mtp)] = g
        if "Linear" in targets and "RoutedExperts" not in targets:
            targets["RoutedExperts"] = targets["Linear"]
        self.targets = targets
        self.regex = regex

    def _hits(self, value: str, entry: str, contains: bool = False) -> bool:
        if entry.startswith("re:"):
            return value in self.regex[entry[3:]]
        return entry.lower() in value.lower() if contains else entry == value

    def ignored(self, name: str) -> bool | None:
        """True/False, or None where the shards of a fused name disagree (vLLM raises)."""
        if any(self._hits(name, e) for e in self.ignore):
            return True
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in self.fused:
            return False
        shards = [any(self._hits(name.replace(leaf, s), e) for e in self.ignore) for s in self.fused[leaf]]
        return shards[0] if len(set(shards)) == 1 else None

    def target(self, name: str, cls: str) -> str | None:
        first = next((t for t in self.targets if self._hits(name, t)), None)
        if first is not None:
            return first
        key = next((k for k in self.fused if name.endswith(k)), None)
        if key is not None:
            found = [
                next((t for t in self.targets if self._hits(name.replace(key, u), t)), None) for u in self.fused[key]
            ]
            if all(found):
                return found[0]
        return next((t for t in self.targets if self._hits(cls, t, contains=True)), None)

    def scheme_dict(self, name: str, cls: str) -> Group | str | None:
        """The group vLLM's get_scheme_dict finds, IGNORED, None (no target), or raises
        ValueError where vLLM does (mixed shards)."""
        ignored = self.ignored(name)
        if ignored is None:
            raise Refused(
                f"ignore covers some shards of {name} but not all, which vLLM refuses", "quantization_config.ignore"
            )
        if ignored:
            return IGNORED
        t = self.target(name, cls)
        return self.targets[t] if t is not None else None

    def resolve(self, module: DraftModule) -> Group | str | None:
        cls = class_of(module.name)
        if module.kind != "moe":
            return self.scheme_dict(module.name, cls)
        found = [self.scheme_dict(p, cls) for p in probe_names(module, self.platform)]
        keys = {_same(f) for f in found}
        if len(keys) > 1:
            probes = ", ".join(probe_names(module, self.platform))
            raise Refused(
                f"the routed experts {module.name} are probed as {probes} and these get different schemes, "
                "which vLLM refuses",
                "quantization_config.config_groups",
            )
        return found[0]


def _same(found: Group | str | None) -> object:
    # vLLM compares the scheme dicts' contents (compressed_tensors_moe.py:51), not which group
    return (found.scheme, repr(found.weights), found.format, found.static_input) if isinstance(found, Group) else found


def regex_table(
    config: CtConfig, modules: Iterable[DraftModule], where: str, error: ErrorFactory
) -> dict[str, frozenset[str]]:
    """Every `re:` entry of `config` matched against every name vLLM asks about (all platforms,
    class names included), in bounded time."""
    modules = list(modules)
    names = {c for mro in MRO.values() for c in mro}
    for m in modules:
        for p in PLATFORMS:
            names.update(probe_names(m, p))
    fields: list[tuple[str, str]] = [(f"quantization_config.ignore[{k}]", e) for k, e in enumerate(config.ignore)]
    for g in config.groups.values():
        fields += [(f"{g.field}.targets[{k}]", t) for k, t in enumerate(g.targets)]
    for tf in config.transforms:
        fields += [(f"{tf.field}.targets[{k}]", t) for k, t in enumerate(tf.targets)]
        fields += [(f"{tf.field}.ignore[{k}]", t) for k, t in enumerate(tf.ignore)]
    patterns = [(f, e[3:]) for f, e in fields if e.startswith("re:")]
    return match_table(patterns, sorted(names), where, error)


def transformed(
    config: CtConfig, module: DraftModule, platform: Platform, regex: Mapping[str, frozenset[str]]
) -> str | None:
    """The field of the first online transform vLLM wraps `module` in (compressed-tensors'
    is_match on each partition: name equal or re.match, or a class of the MRO equal, LinearBase
    also as "Linear"; transform/linear.py:194-263, compressed_tensors/utils/match.py:344-466)."""
    if module.kind == "moe":
        return None  # transforms wrap linears only (compressed_tensors.py:159-181)
    mro = MRO[class_of(module.name)]
    classes = set(mro) | ({"Linear"} if "LinearBase" in mro else set())
    leaf = module.name.rsplit(".", 1)[-1]
    parts = [module.name.replace(leaf, s) for s in FUSED[platform].get(leaf, ())] or [module.name]

    def hit(name: str, entry: str) -> bool:
        return name in regex[entry[3:]] if entry.startswith("re:") else entry == name or entry in classes

    for tf in config.transforms:
        if tf.online and any(
            any(hit(p, t) for t in tf.targets) and not any(hit(p, i) for i in tf.ignore) for p in parts
        ):
            return tf.field
    return None
