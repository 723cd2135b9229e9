"""Write a synthetic native DeepSeek V4 checkpoint; the same as `convert-dsv4 synth`.

    python scripts/synth.py OUT [--preset tiny|flash|pro] [--config config.json]
        [--variant instruct|base|dspark] [--main-layers K|all] [--seed N] [--sparse]
"""

from dsv4.convert.synth import synth_command

if __name__ == "__main__":
    synth_command()
