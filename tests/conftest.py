"""Shared test set-up. Triton kernels run in the interpreter on machines without a GPU."""

import os

import torch

if not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")
