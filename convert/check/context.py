"""What the checks of `convert-dsv4 check` (convert/check/run.py) share: the options, what earlier
checks found, and the one-line helpers their reasons use."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4.model.checkpoint import CONFIG, Checkpoint, ShardHeaders
from dsv4.model.config import ModelConfig
from dsv4.model.errors import DSV4Error
from dsv4.model.record import ConversionRecord

if TYPE_CHECKING:
    from dsv4.convert.plan import Plan

LIST_AT_MOST = 3  # names quoted in a one-line reason; the JSON details list all of them


class Skipped(Exception):
    """A check that did not run, and why."""


@dataclass
class Context:
    """What the checks share: options, and what earlier checks found."""

    root: Path
    fast: bool
    smoke: bool
    native: Path | None
    device: str
    tokens: int
    min_top1: float
    max_rel_diff: float
    config: dict[str, Any] | None = None
    config_error: str | None = None
    headers: ShardHeaders | None = None  # the index and shard headers (the index check's finding)
    hashes: dict[str, str] = field(default_factory=dict)
    unreadable: set[str] = field(default_factory=set)
    cfg: ModelConfig | None = None
    record: ConversionRecord | None = None  # conversion.json
    target: str | None = None  # the layout the checkpoint is in (the config check's finding)
    checksum_error: str | None = None  # a malformed sha256 in conversion.json (the checksums check's finding)
    smoke_report: dict[str, Any] | None = None
    passed: set[str] = field(default_factory=set)
    serve_with: str | None = None  # the target model: its directory, config.json or hub repo (--serve-with)
    checkpoint: Checkpoint = field(init=False)  # the one reader of config.json, the index and the headers
    # a native-named directory's plan into the bundled layout (quant and smoke), or why there is none
    _bundled_plan: Plan | DSV4Error | None = field(default=None, init=False)

    def where(self, file: str) -> str:
        return str(self.root / file)

    @property
    def config_where(self) -> str:
        return self.where(CONFIG)

    def __post_init__(self) -> None:
        self.checkpoint = Checkpoint(self.root)

    def need_headers(self) -> ShardHeaders:
        if self.headers is None:
            raise Skipped("needs the index and shard headers (index check failed)")
        return self.headers

    def need_config(self) -> ModelConfig:
        if self.cfg is None:
            raise Skipped(f"needs a model config: {self.config_error}")
        return self.cfg

    def bundled_plan(self) -> Plan:
        """The plan of converting this native-named directory into the bundled model's layout
        (convert/inmemory.py), made once for the quant and smoke checks; the planner's error
        again if it failed."""
        if self._bundled_plan is None:
            from dsv4.convert.inmemory import bundled_plan

            try:
                self._bundled_plan = bundled_plan(self.root)
            except DSV4Error as exc:
                self._bundled_plan = exc
        if isinstance(self._bundled_plan, DSV4Error):
            raise self._bundled_plan
        return self._bundled_plan


def short(names: list[str]) -> str:
    head = ", ".join(names[:LIST_AT_MOST])
    return head + (f" and {len(names) - LIST_AT_MOST} more" if len(names) > LIST_AT_MOST else "")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
