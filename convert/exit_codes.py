"""The exit code of every outcome of `convert-dsv4`: the one table (docs/exit-codes.md
documents it; users' CI scripts depend on these numbers, so a code is never reused or
renumbered, only added).

An error is a family and a kind (model/errors.py); kinds are unique across the tool, so the
table maps each kind to its code. tests/test_exit_codes.py pins that every kind of every
family has its row and no row is left without a kind."""

from __future__ import annotations

import signal

from dsv4.convert.interrupts import EXIT_CODES as SIGNAL_EXIT_CODES
from dsv4.model.errors import DSV4Error

OK = 0
INTERNAL_ERROR = 1  # a bug, or an OS error no part of the tool classified
USAGE = 2  # click's usage errors
# a signal ended the command (convert/interrupts.py keeps them: it must load before anything else)
INTERRUPTED = SIGNAL_EXIT_CODES[signal.SIGINT]  # 130, Ctrl-C
TERMINATED = SIGNAL_EXIT_CODES[signal.SIGTERM]  # 143, SIGTERM (CI runners, Slurm, Kubernetes)

EXIT_CODES: dict[str, int] = {
    # OutOfMemoryError
    "out_of_memory": 3,
    # 10-19 reading the source checkpoint (CheckpointError)
    "missing_shard": 11,
    "truncated_shard": 12,
    "index_mismatch": 13,
    "duplicate_tensor": 14,
    "unknown_dtype": 15,
    "unsafe_shard_path": 16,
    "malformed_header": 17,
    "missing_config": 18,
    "malformed_config": 18,
    "source_not_found": 19,
    # 20-25 the mapping table (TableError)
    "malformed_table": 20,
    "unknown_op": 21,
    "unbound_placeholder": 22,
    "duplicate_target_rule": 23,
    "dead_rule": 24,
    "unknown_target": 25,
    # 30-38 planning (PlanError; CheckpointError's unsupported_layout)
    "plan_failed": 30,
    "uncovered_key": 31,
    "missing_source": 32,
    "layout_mismatch": 33,
    "duplicate_target": 34,
    "unsupported_layout": 35,
    "unsupported_drafter": 35,  # unsupported_layout's code: a recognised drafter had it before it was named
    "no_drafter": 35,
    "source_changed": 36,
    "inexact_transform": 37,
    "non_finite_agreement": 38,
    # 40-48 the output directory (OutputError)
    "output_exists": 41,
    "write_failed": 42,
    "output_is_source": 43,
    "output_in_source": 44,
    "source_in_output": 45,
    "output_parent": 46,
    "output_locked": 47,
    "overwrite_refused": 48,
    # 50-55 loading and running the bundled model (LoadError)
    "load_failed": 50,
    "missing_key": 51,
    "unexpected_key": 52,
    "shape_mismatch": 53,
    "dtype_mismatch": 54,
    "smoke_output": 55,
    # 60-66 model hub and batch (HubError)
    "hub_request_failed": 60,
    "repo_not_found": 61,
    "revision_not_found": 62,
    "download_failed": 63,
    "bad_manifest": 64,
    "push_failed": 65,
    "batch_failed": 66,
    # 71-86 check (CheckError; 82: PlanError's quant_carry, the converter refuses to carry a quantization_config)
    "index_check": 71,
    "unreadable_tensor": 72,
    "size_check": 73,
    "checksum_mismatch": 74,
    "config_check": 75,
    "missing_tensors": 76,
    "unexpected_tensors": 77,
    "tensor_shape": 78,
    "tensor_dtype": 79,
    "quant_scheme": 80,
    "empty_quant_name": 81,
    "quant_carry": 82,
    "smoke_failed": 84,
    "native_parity": 85,
    "serve_mismatch": 86,
}


def code_of(kind: str) -> int:
    """The documented code of the failure `kind`."""
    return EXIT_CODES[kind]


def exit_code(exc: BaseException) -> int:
    """The documented code of the error `exc`; INTERNAL_ERROR for an exception that is not
    one of the tool's refusals."""
    return EXIT_CODES[exc.kind] if isinstance(exc, DSV4Error) else INTERNAL_ERROR
