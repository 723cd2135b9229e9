"""Opening a source, the checkpoint a command reads: a local directory or a hub repository
(convert/location.py says which), as its inventory (every tensor, from headers alone) and a
reader of its bytes."""

from __future__ import annotations

from pathlib import Path

from dsv4.convert.inventory import Inventory, read_inventory
from dsv4.convert.location import HubSpec, locate
from dsv4.convert.readers import ByteReader, LocalReader


def open_source(source: str | Path | HubSpec, *, quiet: bool = True) -> tuple[Inventory, ByteReader]:
    """Any source behind one open: a local checkpoint directory or a hub repository
    (convert/location.py says which, unless `source` is already located), as its inventory
    and a reader of its bytes. Unless `quiet`, a hub source's header reads (a request per
    shard: seconds) show a bar; local headers take well under a second."""
    where = source if isinstance(source, HubSpec) else locate(source)
    if isinstance(where, Path):
        reader = LocalReader(where)  # first: it notes each file before a header is read
        return read_inventory(where), reader
    from dsv4.convert.hub import open_hub_source  # start-up time: only hub sources load the network client

    return open_hub_source(where, quiet=quiet)
