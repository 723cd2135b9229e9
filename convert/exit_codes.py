"""The exit code of every outcome of `convert-dsv4`: the one table (README "Exit codes"
documents it; users' CI scripts depend on these numbers, so a code is never reused or
renumbered, only added).

An error without a row of its own takes its nearest listed ancestor's code."""

from __future__ import annotations

import signal

from dsv4.convert import errors as convert
from dsv4.convert.interrupts import EXIT_CODES as SIGNAL_EXIT_CODES
from dsv4.mapping import errors as mapping
from dsv4.model import errors as model

OK = 0
INTERNAL_ERROR = 1  # a bug, or an OS error no part of the tool classified
USAGE = 2  # click's usage errors
# a signal ended the command (convert/interrupts.py keeps them: it must load before anything else)
INTERRUPTED = SIGNAL_EXIT_CODES[signal.SIGINT]  # 130, Ctrl-C
TERMINATED = SIGNAL_EXIT_CODES[signal.SIGTERM]  # 143, SIGTERM (CI runners, Slurm, Kubernetes)

EXIT_CODES: dict[type[BaseException], int] = {
    model.DSV4Error: 1,
    model.OutOfMemoryError: 3,
    # 10-19 reading the source checkpoint
    model.CheckpointError: 10,
    model.MissingShardError: 11,
    model.TruncatedShardError: 12,
    model.IndexMismatchError: 13,
    model.DuplicateTensorError: 14,
    model.UnknownDtypeError: 15,
    model.UnsafeShardPathError: 16,
    model.MalformedHeaderError: 17,
    model.MissingConfigError: 18,
    model.MalformedConfigError: 18,
    model.SourceNotFoundError: 19,
    # 20-25 the mapping table
    mapping.TableError: 20,
    mapping.UnknownOpError: 21,
    mapping.UnboundPlaceholderError: 22,
    mapping.DuplicateTargetRuleError: 23,
    mapping.DeadRuleError: 24,
    mapping.UnknownTargetError: 25,
    # 30-36 planning
    convert.PlanError: 30,
    convert.UncoveredKeyError: 31,
    convert.MissingSourceError: 32,
    convert.LayoutMismatchError: 33,
    convert.DuplicateTargetError: 34,
    model.UnsupportedLayoutError: 35,
    convert.SourceChangedError: 36,
    # 40-48 the output directory
    convert.OutputError: 40,
    convert.OutputExistsError: 41,
    convert.WriteFailedError: 42,
    convert.OutputIsSourceError: 43,
    convert.OutputInSourceError: 44,
    convert.SourceInOutputError: 45,
    convert.OutputParentError: 46,
    convert.OutputLockedError: 47,
    convert.OverwriteRefusedError: 48,
    # 50-55 loading and running the bundled model
    model.LoadError: 50,
    model.MissingKeyError: 51,
    model.UnexpectedKeyError: 52,
    model.ShapeMismatchError: 53,
    model.DtypeMismatchError: 54,
    model.SmokeCheckError: 55,
    # 60-66 model hub and batch
    convert.HubError: 60,
    convert.RepoNotFound: 61,
    convert.RevisionNotFound: 62,
    convert.DownloadError: 63,
    convert.ManifestError: 64,
    convert.PushError: 65,
    convert.BatchFailedError: 66,
    # 70-86 check (82: the converter refuses to carry a quantization_config)
    convert.CheckError: 70,
    convert.IndexCheckError: 71,
    convert.UnreadableTensorError: 72,
    convert.SizeCheckError: 73,
    convert.ChecksumMismatchError: 74,
    convert.ConfigCheckError: 75,
    convert.MissingTensorsError: 76,
    convert.UnexpectedTensorsError: 77,
    convert.TensorShapeError: 78,
    convert.TensorDtypeError: 79,
    convert.QuantSchemeError: 80,
    convert.EmptyQuantNameError: 81,
    convert.QuantCarryError: 82,
    convert.SmokeFailedError: 84,
    convert.NativeParityError: 85,
    convert.ServeMismatchError: 86,
}


def code_of(error: type[BaseException]) -> int:
    """The documented code of an error class: its row, else its nearest ancestor's."""
    for cls in error.__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return INTERNAL_ERROR


def exit_code(exc: BaseException) -> int:
    """The documented code of the error `exc`."""
    return code_of(type(exc))
