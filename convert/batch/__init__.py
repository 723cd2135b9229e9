"""`convert-dsv4 batch`: run.py converts (and pushes) every repository of a manifest
(manifest.py); card.py is the model card a push writes."""
