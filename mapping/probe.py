"""The small configuration a table is validated against, for every expert storage: which
native names the source format allows (model/native.py) and which tensors its target's
layout has (the target registry, mapping/targets.py: the bundled model's parameters for `xpu`,
a native draft directory's tensors for `draft`), for the table's drafter kind (MTP or DSpark)."""

from __future__ import annotations

from functools import cache

from dsv4.mapping.targets import require_target
from dsv4.model import native
from dsv4.model.config import ModelConfig
from dsv4.model.presets import preset_config
from dsv4.model.storage import expert_dtypes

# the tiny releases of each drafter kind a table of that kind covers together: a DSpark table
# also maps V4-Flash-Vision-Exp, whose routers carry a gate.bias_vl and whose main model a tower
PROBE_RELEASES = {"mtp": ("instruct",), "dspark": ("dspark", "vision")}
# a table of one drafter family ([table] family) is validated against that family's tiny release alone
FAMILY_PROBE_RELEASES = {"v41-dspark": ("v41",)}


def probe_config(expert_dtype: str, drafter: str = "mtp", release: str | None = None) -> ModelConfig:
    """The tiny `release` (default: the first) of `drafter` with its experts stored as
    `expert_dtype` (an unknown one is refused by name, as the config loader refuses it; V4.1,
    whose experts are FP4 only, keeps its own)."""
    release = release or PROBE_RELEASES[drafter][0]
    tiny = preset_config("tiny", release)
    return ModelConfig.from_dict(tiny if release == "v41" else {**tiny, "expert_dtype": expert_dtype})


def native_keys(cfg: ModelConfig) -> set[str]:
    """Every name a native checkpoint with this config may hold (Base's optional MTP
    emb/head included)."""
    keys = set(native.draft_layout(cfg, with_emb_head=native.expert_storage(cfg).mtp_emb_head))
    keys |= set(native.vision_layout(cfg))
    for j in range(cfg.num_hidden_layers):
        keys |= set(native.main_layer_layout(cfg, j))
    return keys


def stage_binding(cfg: ModelConfig) -> dict[str, int]:
    """What {first} and {last} stand for: stage 0 and stage S-1 of a DSpark drafter."""
    return {"first": 0, "last": cfg.dspark_stages - 1}


def draft_bindings(cfg: ModelConfig) -> list[dict[str, int]]:
    """One binding per draft block: {i} and {L} = N + i for each MTP block, or {s} for each
    DSpark stage (with {first} and {last})."""
    if cfg.is_dspark:
        return [{"s": s, **stage_binding(cfg)} for s in range(cfg.dspark_stages)]
    return [{"i": i, "L": cfg.mtp_layer_index(i)} for i in range(cfg.num_nextn_predict_layers)]


@cache
def probe_keys(
    drafter: str, target: str, family: str | None = None
) -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, ModelConfig], dict[str, int]]:
    """(native names, the target layout's names) per expert dtype, over every probe release of
    the drafter kind (or of the one `family`), the probe configuration per expert dtype (what a
    target pattern's placeholders are bound for: the releases bind them alike), and its
    {first}/{last} stages (none for MTP: the same for every expert dtype). Only the expert dtypes
    the releases store experts in are probed (V4.1's FP4 alone: its table's FP8 rules never apply)."""
    probes = FAMILY_PROBE_RELEASES[family] if family is not None else PROBE_RELEASES[drafter]
    releases = {d: [probe_config(d, drafter, r) for r in probes] for d in expert_dtypes()}
    releases = {d: cs for d, cs in releases.items() if all(c.expert_dtype == d for c in cs)}
    natives = {d: set().union(*map(native_keys, cs)) for d, cs in releases.items()}
    targets = {d: set().union(*(require_target(target).layout(c) for c in cs)) for d, cs in releases.items()}
    cfgs = {d: cs[0] for d, cs in releases.items()}
    cfg = next(iter(cfgs.values()))
    return natives, targets, cfgs, stage_binding(cfg) if cfg.is_dspark else {}
