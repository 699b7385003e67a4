"""What this machine can run: CUDA, Triton, NVIDIA apex. The one home of capability probes.

Config validation asks these before any compute (`model.kernels=triton`, `optim.impl=apex`, ...),
and the code paths that use a capability ask the same function, so a check and its use never
disagree. Every probe is cheap and side-effect free.
"""
from __future__ import annotations

import importlib
import os


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def triton_usable(device_type: str) -> bool:
    """Triton runs on CUDA, or anywhere under TRITON_INTERPRET=1 (the CPU test path)."""
    if device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    return False


def apex_available() -> bool:
    """True when NVIDIA apex (its fused optimizers and LayerNorm) is importable.

    The unrelated PyPI package named `apex` has no `apex.optimizers`, so it is reported absent."""
    try:
        importlib.import_module("apex.optimizers")
        importlib.import_module("apex.normalization")
    except Exception:  # ImportError, or apex's own import-time CUDA errors
        return False
    return True
