"""`convert-dsv4 check`: run.py runs the checks in order over one Context (context.py); the
files, config, model and serve checks each have a module; report.py writes their results."""
