"""Error classes, one per failure a user must tell apart; each carries its CLI exit code.

Every message is one line that names the file and/or tensor at fault.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dsv4.model.config import ConfigError, UnsupportedConfig


class DSV4Error(Exception):
    exit_code = 1


# --- reading a native checkpoint (inventory) ------------------------------------------
class InventoryError(DSV4Error):
    exit_code = 10


class MissingShardError(InventoryError):
    exit_code = 11


class TruncatedShardError(InventoryError):
    exit_code = 12


class IndexMismatchError(InventoryError):
    exit_code = 13


class DuplicateTensorError(InventoryError):
    exit_code = 14


class UnknownDtypeError(InventoryError):
    exit_code = 15


class UnsafeShardPathError(InventoryError):
    exit_code = 16


class MalformedHeaderError(InventoryError):
    exit_code = 17


class MissingConfigError(InventoryError):
    exit_code = 18


class MalformedConfigError(InventoryError):
    """config.json is not strict JSON, not an object, or a field the tool uses is missing,
    of the wrong type or out of range (the message names the field)."""

    exit_code = 18


class SourceNotFoundError(InventoryError):
    exit_code = 19


# --- the mapping table ------------------------------------------------------------------
class TableError(DSV4Error):
    exit_code = 20


class UnknownOpError(TableError):
    exit_code = 21


class UnboundPlaceholderError(TableError):
    exit_code = 22


class DuplicateTargetRuleError(TableError):
    exit_code = 23


class DeadRuleError(TableError):
    exit_code = 24


class UnknownTargetError(TableError):
    exit_code = 25


# --- planning -------------------------------------------------------------------------
class PlanError(DSV4Error):
    exit_code = 30


class UncoveredKeyError(PlanError):
    exit_code = 31


class MissingSourceError(PlanError):
    exit_code = 32


class LayoutMismatchError(PlanError):
    exit_code = 33


class DuplicateTargetError(PlanError):
    exit_code = 34


class UnsupportedLayoutError(PlanError):
    exit_code = 35


@contextmanager
def config_errors(where: str) -> Iterator[None]:
    """The one place where the model layer's config verdicts (dsv4.model.config) become exit
    codes: unsupported -> UnsupportedLayoutError (35), anything else -> MalformedConfigError
    (18); `where` (the config.json's path) heads the one-line message."""
    try:
        yield
    except UnsupportedConfig as exc:
        raise UnsupportedLayoutError(f"{where}: {exc}") from None
    except ConfigError as exc:
        raise MalformedConfigError(f"{where}: {exc}") from None


# --- writing the output -----------------------------------------------------------------
class OutputError(DSV4Error):
    exit_code = 40


class OutputExistsError(OutputError):
    exit_code = 41


class WriteFailedError(OutputError):
    """An OSError while writing or publishing OUT; the message names the path, the OS
    reason and what became of OUT."""

    exit_code = 42


class OutputIsSourceError(OutputError):
    """OUT is the source directory (after resolving symlinks)."""

    exit_code = 43


class OutputInSourceError(OutputError):
    exit_code = 44


class SourceInOutputError(OutputError):
    """The source lies inside OUT (or inside one of OUT's hidden working directories)."""

    exit_code = 45


class OutputParentError(OutputError):
    """OUT's parent is not a directory, or cannot be created."""

    exit_code = 46


class OutputLockedError(OutputError):
    """Another run holds OUT's lock; the message names it (pid, host)."""

    exit_code = 47


class OverwriteRefusedError(OutputError):
    """--overwrite given, but OUT is not a previous output of this tool."""

    exit_code = 48




# --- loading into the bundled model -----------------------------------------------------
class LoadError(DSV4Error):
    exit_code = 50


class MissingKeyError(LoadError):
    exit_code = 51


class UnexpectedKeyError(LoadError):
    exit_code = 52


class ShapeMismatchError(LoadError):
    exit_code = 53


class DtypeMismatchError(LoadError):
    exit_code = 54


class SmokeCheckError(DSV4Error):
    """A loaded model ran but its output failed a check (shape, finiteness, agreement)."""

    exit_code = 55


# --- model hub and batch ----------------------------------------------------------------
class HubError(DSV4Error):
    exit_code = 60


class RepoNotFound(HubError):
    exit_code = 61


class RevisionNotFound(HubError):
    exit_code = 62


class DownloadError(HubError):
    """A planned byte range could not be fetched whole (wrong length, retries exhausted)."""

    exit_code = 63


class ManifestError(HubError):
    exit_code = 64


class PushError(HubError):
    exit_code = 65


class BatchFailedError(HubError):
    """At least one repository of a batch failed; the others were still processed."""

    exit_code = 66


# --- check ------------------------------------------------------------------------------
# `convert-dsv4 check`: one class per failed check, each with its own exit code, so CI can
# tell the failures apart. The quantisation classes also serve the converter, which carries
# a compressed-tensors quantization_config into the output (convert/quant.py).
class CheckError(DSV4Error):
    exit_code = 70


class IndexCheckError(CheckError):
    """Index and shard headers disagree: names, missing or stray shards, offsets, gaps."""

    exit_code = 71


class UnreadableTensorError(CheckError):
    exit_code = 72


class SizeCheckError(CheckError):
    """index total_size or conversion.json sizes/files disagree with the shards."""

    exit_code = 73


class ChecksumMismatchError(CheckError):
    exit_code = 74


class ConfigCheckError(CheckError):
    """config.json lacks the conversion record or disagrees with the tensors."""

    exit_code = 75


class MissingTensorsError(CheckError):
    exit_code = 76


class UnexpectedTensorsError(CheckError):
    exit_code = 77


class TensorShapeError(CheckError):
    exit_code = 78


class TensorDtypeError(CheckError):
    exit_code = 79


class QuantSchemeError(CheckError):
    """A linear of the draft resolves to no scheme, or to several, and is not ignored."""

    exit_code = 80


class EmptyQuantNameError(CheckError):
    """A linear with an empty quantisation layer name (vLLM issue #44817)."""

    exit_code = 81


class QuantCarryError(CheckError):
    """The source quantization_config cannot be carried to the draft's layer names unchanged."""

    exit_code = 82


class SmokeFailedError(CheckError):
    """The strict load or the few-token forward failed."""

    exit_code = 84


class NativeParityError(CheckError):
    """The converted draft disagrees with the reference run on the native checkpoint."""

    exit_code = 85
