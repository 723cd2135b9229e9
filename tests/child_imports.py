"""Which heavy modules a whole `convert-dsv4` run loads, in a child process (start-up tests)."""

import json
import subprocess
import sys

# Imports a whole conversion (or plan) in a child process and reports which heavy modules
# it loaded; the child inherits the session's layout cache.
IMPORTED = """
import sys
from dsv4.convert.cli.main import main
sys.argv = ["convert-dsv4", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
HEAVY = ("torch", "triton", "safetensors", "huggingface_hub.hf_api", "httpx")
print("\\nIMPORTED", [m for m in HEAVY if m in sys.modules])
"""


def imported_by(*args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", IMPORTED, *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.rsplit("IMPORTED", 1)[1].strip().replace("'", '"'))
