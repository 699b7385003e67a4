"""Reading a checkpoint's `.pt` files without running code from them.

A `.pt` file is a zip holding a pickle, and a pickle may name any importable callable
(`os.system`, a class whose `__reduce__` writes a file): `torch.load(weights_only=False)`, which
DeepSpeed's `engine.load_checkpoint`, its `zero_to_fp32` and `ds_to_universal` all use, calls it.
The completeness record's sha256 values do not help against a checkpoint handed over whole: it
carries its own consistent `COMPLETE.json`.

So before DeepSpeed, the converter or the resume path opens any file of a checkpoint, every `.pt`
below the tag directory (its `universal/` conversion included, which is loaded without being
rebuilt once it exists) is unpickled with `torch.load(weights_only=True)`: torch's restricted
unpickler, which builds tensors, containers and primitive values only, plus exactly the classes
listed in `ALLOWED_GLOBALS` — the ones DeepSpeed 0.19 and this project put into a checkpoint
(found by saving checkpoints at ZeRO 0/1/2/3, fp32, with every objective and StableAdamW, and
listing what `weights_only` refused; fp16/bf16's loss scalers from DeepSpeed's optimizer sources).
A file that needs any other global is refused, naming the file and the global, before any of it
runs (the restricted unpickler stops at the first disallowed GLOBAL opcode). Files are mapped, not
read (`mmap=True`): the scan costs the pickles' size, not the tensors'.

The project's own loads of checkpoint files (`load_pt`) use the same restricted unpickler, so
they stay safe however they are reached.
"""
from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import Any, Optional

import torch

#: "module.qualname" of every non-builtin global a checkpoint of this project may hold, and why.
ALLOWED_GLOBAL_NAMES = (
    # ZeRO 1/2 and bf16: `_param_slice_mappings`, {param name: fragment_address(numel, start)}
    "deepspeed.utils.tensor_fragment.fragment_address",
    # ZeRO optimizers' `loss_scaler` (fp32/bf16: static scale 1; fp16: dynamic, with a torch dtype)
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    # ZeRO optimizers' `zero_stage` entry (an Enum member)
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)


class UnsafeCheckpointError(ValueError):
    """A checkpoint file whose pickle names a global outside `ALLOWED_GLOBAL_NAMES` (or is unreadable)."""


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def allowed_globals() -> list[Any]:
    """The classes of `ALLOWED_GLOBAL_NAMES` (DeepSpeed imported on first use only)."""
    return [_resolve(name) for name in ALLOWED_GLOBAL_NAMES]


def _refused_globals(path: Path) -> list[str]:
    """The globals of `path`'s pickle that neither torch's weights-only set nor ours allows (read, not run)."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip checkpoint: the unpickler's own message says what it met
        return []
    return [name for name in found if name not in ALLOWED_GLOBAL_NAMES]


def load_pt(path: Path, mmap: bool = False) -> Any:
    """`torch.load(path)` on the CPU with the restricted unpickler and `ALLOWED_GLOBAL_NAMES`;
    `UnsafeCheckpointError` naming the file and the refused global(s), or why it is unreadable."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        refused = _refused_globals(path)
        what = ", ".join(refused) if refused else str(err).strip().splitlines()[0]
        raise UnsafeCheckpointError(
            f"{path}: refused: its pickle needs {what}, which is not a type DeepSpeed or this project saves "
            "(a checkpoint file that would run code when loaded); not loading this checkpoint") from err
    except Exception as err:  # a torn zip, a foreign format: torch raises many types
        raise UnsafeCheckpointError(f"{path}: unreadable ({type(err).__name__}: {err})") from err


def unsafe_checkpoint_problem(tag_dir: Path) -> Optional[str]:
    """None when every `.pt` below `tag_dir` loads with `load_pt`, else the one-line reason for the first
    that does not (checked in sorted order; nothing of any file runs)."""
    for path in sorted(Path(tag_dir).rglob("*.pt")):
        try:
            load_pt(path, mmap=True)
        except UnsafeCheckpointError as err:
            return str(err)
    return None
