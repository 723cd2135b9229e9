"""The parts of scripts/verify_runtimes.py (the command; its docstring says what runs and what
is stubbed): the wheel cache (wheels), cutting code out of a wheel's file (cut), the
recording stand-ins and one loader run's report (recording), the vLLM runs (vllm_runs), the
SGLang runs (sglang_runs)."""


class UsageError(Exception):
    """A missing directory or wheel: exit 2 with one line."""
