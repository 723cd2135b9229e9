"""The errors of the model layer, and the root every error of the tool derives from.

Each class is one failure a user must tell apart; the message is one line naming the file
and/or tensor at fault. Exit codes are not decided here: the command line's table
(convert/exit_codes.py) maps each class to its documented code.
"""

from __future__ import annotations


class DSV4Error(Exception):
    """Any refusal of this tool. `path` (the file at fault) and `tensor` are there for a
    program to read; the message already says them."""

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.tensor = tensor

    def fields(self) -> dict[str, str]:
        """The structured fields that are set (the file at fault, the tensor, a config
        field), for JSON reports: what a program reads instead of parsing the message."""
        named = {"path": self.path, "tensor": self.tensor, "field": getattr(self, "field", None)}
        return {k: v for k, v in named.items() if isinstance(v, str)}


class OutOfMemoryError(DSV4Error):
    """The memory the command needs is not there (an address-space limit too small to load
    torch, or an allocation that failed)."""


# --- reading a checkpoint's files: the inventory of a source, the index, the loader -----
class CheckpointError(DSV4Error):
    """A checkpoint directory's files are missing or malformed."""


class MissingShardError(CheckpointError):
    pass


class TruncatedShardError(CheckpointError):
    pass


class IndexMismatchError(CheckpointError):
    pass


class DuplicateTensorError(CheckpointError):
    pass


class UnknownDtypeError(CheckpointError):
    pass


class UnsafeShardPathError(CheckpointError):
    pass


class MalformedHeaderError(CheckpointError):
    pass


class MissingConfigError(CheckpointError):
    pass


class MalformedConfigError(CheckpointError):
    """config.json is not strict JSON, not an object, or a field the tool uses is missing,
    of the wrong type or out of range (the message names the field)."""


class SourceNotFoundError(CheckpointError):
    pass


class UnsupportedLayoutError(DSV4Error):
    """A well-formed checkpoint whose layout this tool has no conversion or model for."""


# --- loading into the bundled model and running it --------------------------------------
class LoadError(DSV4Error):
    """A converted checkpoint does not load strictly into the bundled draft model."""


class MissingKeyError(LoadError):
    pass


class UnexpectedKeyError(LoadError):
    pass


class ShapeMismatchError(LoadError):
    pass


class DtypeMismatchError(LoadError):
    pass


class SmokeCheckError(DSV4Error):
    """A loaded model ran but its output failed a check (shape, finiteness, agreement)."""
