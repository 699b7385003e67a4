"""What this machine can run: CUDA, Triton, NVIDIA apex. The one home of capability probes.

Config validation asks these before any compute (`model.kernels=triton`, `optim.impl=apex`, ...),
and the code paths that use a capability ask the same function, so a check and its use never
disagree. Every probe is cheap and side-effect free.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import sys
from pathlib import Path
from typing import Optional


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


def private_extensions_dir() -> Path:
    """Where torch / DeepSpeed JIT-compile their C++/CUDA ops for *this* Python environment:
    `~/.cache/torch_extensions/<env>-<hash of sys.prefix>-torch<version>`. torch's default
    (`~/.cache/torch_extensions/py311_cu124`) is shared by every environment of a user, so one
    environment's build holds the lock another waits on, and builds for other torch/DeepSpeed
    versions collide."""
    import torch

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    prefix = os.path.realpath(sys.prefix)
    tag = hashlib.sha256(prefix.encode()).hexdigest()[:12]
    return cache / "torch_extensions" / f"{Path(prefix).name}-{tag}-torch{torch.__version__}"


#: DeepSpeed's shared-memory all-reduce for CPU ranks, JIT-built with g++ the first time a process group
#: starts on the CPU accelerator (`deepspeed.comm.torch.build_shm_op`).
SHM_COMM_OP = "deepspeed_shm_comm"


def extensions_dir() -> Path:
    """Where the JIT-built ops of this process go: `TORCH_EXTENSIONS_DIR`, else `private_extensions_dir()`
    (what `use_private_extensions_dir` sets for training)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or private_extensions_dir())


def op_built(name: str, directory: Optional[Path] = None) -> bool:
    """Has the JIT op `name` been built (linked: its `.so` is there) in `directory` (default `extensions_dir()`)?
    A build that stopped before linking left only sources and `build.ninja`: not built."""
    folder = (directory or extensions_dir()) / name
    return folder.is_dir() and any(folder.glob("*.so"))


def use_private_extensions_dir() -> str:
    """Point `TORCH_EXTENSIONS_DIR` at `private_extensions_dir()` unless it is set; returns the value."""
    return os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(private_extensions_dir()))
