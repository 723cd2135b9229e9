"""Error classes, one per failure a user must tell apart; each carries its CLI exit code.

Every message is one line that names the file and/or tensor at fault.
"""

from __future__ import annotations


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


# --- writing the output -----------------------------------------------------------------
class OutputError(DSV4Error):
    exit_code = 40


class OutputExistsError(OutputError):
    exit_code = 41


class WriteFailedError(OutputError):
    exit_code = 42




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
