"""The bundled MTP draft model: the authority on the target layout."""
