"""Write a synthetic native DeepSeek V4 checkpoint; the same as `convert-dsv4 synth`.

python scripts/synth.py OUT [--preset tiny|flash|pro] [--config config.json]
    [--variant instruct|base|dspark] [--main-layers K|all] [--seed N] [--sparse]
"""

import sys

from dsv4.convert.cli.main import main

if __name__ == "__main__":
    sys.argv[1:1] = ["synth"]
    main()
