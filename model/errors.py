"""The errors of the model layer, and the root every error of the tool derives from.

An error is a family (the class: what went wrong where) and a `kind` (which failure of
the family: a short stable identifier such as "missing_shard", unique across the tool, so
a kind alone names the failure). The message is one line naming the file and/or tensor at
fault; `path`, `tensor` and `field` say them again for a program to read. Exit codes are
not decided here: the command line's one table (convert/exit_codes.py) maps each kind to
its documented code.
"""

from __future__ import annotations

from typing import ClassVar


class DSV4Error(Exception):
    """Any refusal of this tool. A family subclasses it and lists its kinds in `KINDS`; an
    error of a kind its family does not list is a bug of the tool (ValueError)."""

    KINDS: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        path: str | None = None,
        tensor: str | None = None,
        field: str | None = None,
    ) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"{type(self).__name__} has no kind {kind!r} (its kinds: {', '.join(self.KINDS)})")
        super().__init__(message)
        self.kind = kind
        self.path = path
        self.tensor = tensor
        self.field = field

    def fields(self) -> dict[str, str]:
        """The kind and the structured fields that are set (the file at fault, the tensor, a
        config field), for JSON reports: what a program reads instead of parsing the message."""
        named = {"kind": self.kind, "path": self.path, "tensor": self.tensor, "field": self.field}
        return {k: v for k, v in named.items() if isinstance(v, str)}


class OutOfMemoryError(DSV4Error):
    """The memory the command needs is not there (an address-space limit too small to load
    torch, or an allocation that failed)."""

    KINDS = ("out_of_memory",)


class CheckpointError(DSV4Error):
    """A checkpoint directory (the source, or a converted one the loader reads) cannot be
    used: its files are missing or malformed, its config.json is missing, malformed (`field`
    names the field) or describes a layout this tool has no conversion or model for."""

    KINDS = (
        "missing_shard",
        "truncated_shard",
        "index_mismatch",  # index and shard headers disagree
        "duplicate_tensor",  # one tensor name in two shards
        "unknown_dtype",
        "unsafe_shard_path",  # a shard name that leaves the directory
        "malformed_header",  # a shard header or the index
        "missing_config",
        "malformed_config",  # not strict JSON, not an object, a field missing, mistyped or out of range
        "source_not_found",
        "unsupported_layout",  # well-formed, but no conversion or model for it (V4.1, unknown expert_dtype, ...)
        "unsupported_drafter",  # a drafter family recognised, but not convertible to the target yet
        "no_drafter",  # no draft layers at all (a re-export without mtp.*)
    )


class LoadError(DSV4Error):
    """A converted checkpoint does not load strictly into the bundled model, or the loaded
    model's output fails a check (shape, finiteness, agreement)."""

    KINDS = (
        "load_failed",  # an unreadable file (a shard, target features)
        "missing_key",
        "unexpected_key",
        "shape_mismatch",
        "dtype_mismatch",
        "smoke_output",  # the model ran, its output failed a check
    )
