"""The errors of the converter, the hub and batch jobs, and `check` (exit codes:
convert/exit_codes.py). The model layer's errors (reading checkpoint files, loading the
model) and the table's are in dsv4.model.errors and dsv4.mapping.errors."""

from __future__ import annotations

from dsv4.model.errors import DSV4Error


# --- planning ---------------------------------------------------------------------------
class PlanError(DSV4Error):
    """The checkpoint cannot be converted by the table as it stands."""


class UncoveredKeyError(PlanError):
    pass


class MissingSourceError(PlanError):
    pass


class LayoutMismatchError(PlanError):
    pass


class DuplicateTargetError(PlanError):
    pass


class QuantCarryError(PlanError):
    """The source quantization_config cannot be carried to the draft's layer names unchanged."""


# --- writing the output -------------------------------------------------------------------
class OutputError(DSV4Error):
    """OUT cannot be (or was not) written safely."""


class OutputExistsError(OutputError):
    pass


class WriteFailedError(OutputError):
    """An OSError while writing or publishing OUT; the message names the path, the OS
    reason and what became of OUT."""


class OutputIsSourceError(OutputError):
    """OUT is the source directory (after resolving symlinks)."""


class OutputInSourceError(OutputError):
    pass


class SourceInOutputError(OutputError):
    """The source lies inside OUT (or inside one of OUT's hidden working directories)."""


class OutputParentError(OutputError):
    """OUT's parent is not a directory, or cannot be created."""


class OutputLockedError(OutputError):
    """Another run holds OUT's lock; the message names it (pid, host)."""


class OverwriteRefusedError(OutputError):
    """--overwrite given, but OUT is not a previous output of this tool."""


# --- model hub and batch --------------------------------------------------------------------
class HubError(DSV4Error):
    """The hub refused or failed a request."""


class RepoNotFound(HubError):
    pass


class RevisionNotFound(HubError):
    pass


class DownloadError(HubError):
    """A planned byte range could not be fetched whole (wrong length, retries exhausted)."""


class ManifestError(HubError):
    pass


class PushError(HubError):
    pass


class BatchFailedError(HubError):
    """At least one repository of a batch failed; the others were still processed."""


# --- check: one class per failed check, so CI can tell the failures apart -----------------------
class CheckError(DSV4Error):
    pass


class IndexCheckError(CheckError):
    """Index and shard headers disagree: names, missing or stray shards, offsets, gaps."""


class UnreadableTensorError(CheckError):
    pass


class SizeCheckError(CheckError):
    """index total_size or conversion.json sizes/files disagree with the shards."""


class ChecksumMismatchError(CheckError):
    pass


class ConfigCheckError(CheckError):
    """config.json lacks the conversion record or disagrees with the tensors."""


class MissingTensorsError(CheckError):
    pass


class UnexpectedTensorsError(CheckError):
    pass


class TensorShapeError(CheckError):
    pass


class TensorDtypeError(CheckError):
    pass


class QuantSchemeError(CheckError):
    """A linear of the draft resolves to no scheme, or to several, and is not ignored."""


class EmptyQuantNameError(CheckError):
    """A linear with an empty quantisation layer name (vLLM issue #44817)."""


class SmokeFailedError(CheckError):
    """The strict load or the few-token forward failed."""


class NativeParityError(CheckError):
    """The converted draft disagrees with the reference run on the native checkpoint."""


class ServeMismatchError(CheckError):
    """The target model a draft directory is to be served beside would build the draft's
    layers differently: vLLM 0.33.0 builds an MTP or DSpark draft from the target's config
    and quantisation, so the draft's tensors would not load (NOTES.md, "Serving a draft").
    `field` is the first config field that differs."""

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None) -> None:
        super().__init__(message, path=path)
        self.field = field
