"""Reading native checkpoints, planning and streaming the conversion, checking the result."""
