"""Kernel tests run the Triton kernels on CPU tensors under the Triton interpreter.

`TRITON_INTERPRET=1` must be in the environment before the kernel modules are imported (that is
when `triton.jit` picks the interpreter), so it is set here, at collection time. It is set only
when there is no CUDA device: on a GPU machine the same tests run the compiled kernels on CUDA.
Leaking the variable into other test directories changes nothing there: `get_op(..., "auto")`
picks Triton only for CUDA tensors, and nothing else runs Triton on CPU.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    _stale = [m for m in ("pipeline.kernels.linear_cross_entropy", "pipeline.kernels.token_contrastive",
                          "pipeline.kernels.sequence_contrastive") if m in sys.modules]
    if _stale:  # imported before the interpreter was switched on: their kernels would need a GPU
        raise RuntimeError(f"{_stale} were imported before tests/kernels/conftest.py set TRITON_INTERPRET=1")


@pytest.fixture
def device() -> torch.device:
    """Where the kernels run: CUDA when present, else the CPU through the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
