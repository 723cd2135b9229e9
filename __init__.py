"""dsv4-convert: DeepSeek V4 MTP draft checkpoints in vLLM's XPU layout."""

__version__ = "0.1.0"
