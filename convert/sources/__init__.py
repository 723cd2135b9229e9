"""Where a conversion reads from: a Source (location, inventory, reader) opened from a local
directory (local.py) or a hub repository (hub_source.py over hub.py's checked reads and a
backend of hub_protocol.py: hf_backend.py); location.py tells which one the user typed."""
