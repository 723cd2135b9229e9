"""The errors of a mapping table: found when the table is loaded, before any checkpoint is
read (exit codes: convert/exit_codes.py)."""

from __future__ import annotations

from dsv4.model.errors import DSV4Error


class TableError(DSV4Error):
    """A table that is not valid TOML, not installed, or breaks the table format."""

    KINDS = (
        "malformed_table",  # not TOML, not installed, a section or field of the wrong shape
        "unknown_op",
        "unbound_placeholder",
        "duplicate_target_rule",  # two rules write one target
        "dead_rule",  # a rule no native name of any supported config can match
        "unknown_target",  # a rule writes a parameter the bundled model does not have
    )
