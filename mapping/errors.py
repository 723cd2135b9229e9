"""The errors of a mapping table: found when the table is loaded, before any checkpoint is
read (exit codes: convert/exit_codes.py)."""

from __future__ import annotations

from dsv4.model.errors import DSV4Error


class TableError(DSV4Error):
    """A table that is not valid TOML, not installed, or breaks the table format."""


class UnknownOpError(TableError):
    pass


class UnboundPlaceholderError(TableError):
    pass


class DuplicateTargetRuleError(TableError):
    pass


class DeadRuleError(TableError):
    """A rule no native name of any supported config can match."""


class UnknownTargetError(TableError):
    """A rule writes a parameter the bundled model does not have."""
