"""Reading pickled `.pt` / `.bin` files without running code from them: the one home of every unpickling.

A `.pt` file is a zip holding a pickle, and a pickle may name any importable callable
(`os.system`, a class whose `__reduce__` writes a file): `torch.load(weights_only=False)`, which
DeepSpeed's `engine.load_checkpoint`, its universal loading, `zero_to_fp32` and `ds_to_universal`
all use, calls it. The completeness record's sha256 values do not help against a checkpoint handed
over whole: it carries its own consistent `COMPLETE.json`.

Two layers, one loader (`load_pt`: torch's restricted unpickler, `weights_only=True`, which builds
tensors, containers and primitive values only, plus exactly the classes of `ALLOWED_GLOBAL_NAMES`,
the ones DeepSpeed 0.19 and this project put into a checkpoint — found by saving checkpoints at
ZeRO 0/1/2/3, fp32, with every objective and StableAdamW, and listing what `weights_only` refused;
fp16/bf16's loss scalers from DeepSpeed's optimizer sources):

* the guarantee, `safe_unpickling()`: while DeepSpeed (or anything) loads a checkpoint, every
  `torch.load` of the process *is* `load_pt`, whatever `weights_only` the caller passed (torch's
  `TORCH_FORCE_WEIGHTS_ONLY_LOAD` is set too, for a caller holding `torch.serialization.load`
  itself). So nothing below a tag is unpickled unless this loader reads that very file at that
  moment: a file swapped after a scan, a directory the scan never saw, a file of DeepSpeed's own
  temporary conversion — all read the same way. A refused file raises `UnsafeCheckpointError`;
* the early, clear refusal, `unsafe_checkpoint_problem(tag)`: before anything loads, every `.pt`
  below the tag (its `universal/` conversion included) is read with `load_pt` (mapped, not read:
  the cost is the pickles', not the tensors'), and a symbolic link anywhere below the tag that
  leads outside it is refused by name (`foreign_link`): a tag's files are its own, so a
  `universal/` linked to another directory cannot bring in weights or a completion marker from
  elsewhere.

A refused file is one line, naming the file and the global its pickle needs (never torch's advice to
re-run with `weights_only=False`). The weights of a converted directory (`pytorch_model.bin`, read by
`model.init_from`, `cpt-convert --weights`, `cpt-finetune`, `cpt-sts`) go through `load_pt` too.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import pickle
from pathlib import Path
from typing import Any, Iterator, Optional

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
#: torch's switch that makes every `torch.load` restricted, whatever its caller asked for.
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


class UnsafeCheckpointError(ValueError):
    """A pickled file whose pickle names a global outside `ALLOWED_GLOBAL_NAMES`, or is unreadable."""


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def allowed_globals() -> list[Any]:
    """The classes of `ALLOWED_GLOBAL_NAMES` (DeepSpeed imported on first use only)."""
    return [_resolve(name) for name in ALLOWED_GLOBAL_NAMES]


def _refused_globals(source: Any) -> list[str]:
    """The globals of `source`'s pickle that neither torch's weights-only set nor ours allows (read, not run)."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except Exception:  # not a zip checkpoint: the unpickler's own message says what it met
        return []
    return [name for name in found if name not in ALLOWED_GLOBAL_NAMES]


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _name(source: Any) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else str(getattr(source, "name", repr(source)))


def load_pt(source: Any, mmap: bool = False, map_location: Any = "cpu") -> Any:
    """`torch.load(source)` with the restricted unpickler and `ALLOWED_GLOBAL_NAMES` (a path or a file
    object); `UnsafeCheckpointError` in one line naming the file and the refused global(s), or why it is
    unreadable."""
    if isinstance(source, (str, os.PathLike)):
        source = Path(source)
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.serialization.load(source, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        if hasattr(source, "seek"):
            source.seek(0)
        refused = _refused_globals(source)
        what = ", ".join(refused) if refused else _first_line(err)
        raise UnsafeCheckpointError(
            f"{_name(source)}: refused: its pickle needs {what}, which is not a type DeepSpeed or this project saves "
            "(a file that would run code when loaded); not loading it") from None
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # a torn zip, a foreign format: torch raises many types
        raise UnsafeCheckpointError(f"{_name(source)}: unreadable ({type(err).__name__}: {_first_line(err)})") from err


def _guarded_load(f: Any, map_location: Any = None, pickle_module: Any = None, *, weights_only: Any = None,
                  mmap: Any = None, **_pickle_args: Any) -> Any:
    """`torch.load` inside `safe_unpickling`: `load_pt`, whatever the caller asked for."""
    if pickle_module is not None:
        raise UnsafeCheckpointError(f"{_name(f)}: refused: loaded with a pickle module of its caller's "
                                    f"({getattr(pickle_module, '__name__', pickle_module)}), which the restricted "
                                    "unpickler cannot vouch for")
    return load_pt(f, mmap=bool(mmap), map_location=map_location)


@contextlib.contextmanager
def safe_unpickling() -> Iterator[None]:
    """Within: every `torch.load` of this process is `load_pt` (module doc); restored on the way out.
    Re-entrant. Meant around a library's load of files it unpickles with `weights_only=False`."""
    if torch.load is _guarded_load:
        yield
        return
    previous_env = os.environ.get(FORCE_WEIGHTS_ONLY)
    original = torch.load
    torch.load = _guarded_load  # type: ignore[assignment]
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            yield
    finally:
        torch.load = original  # type: ignore[assignment]
        if previous_env is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = previous_env


def foreign_link(tag_dir: Path) -> Optional[str]:
    """None when no symbolic link below `tag_dir` leads outside it, else the one-line refusal naming the
    first (walked without following links, so a linked directory is reported, not entered)."""
    root = Path(tag_dir).resolve()
    for directory, dirs, files in os.walk(tag_dir, followlinks=False):
        for name in sorted(dirs + files):
            path = Path(directory) / name
            if not path.is_symlink():
                continue
            target = path.resolve()
            if target != root and root not in target.parents:
                return (f"{path}: a symbolic link to {target}, outside the checkpoint {tag_dir}: refused (a checkpoint's "
                        "files are its own; copy them into the tag, or remove the link)")
    return None


def unsafe_checkpoint_problem(tag_dir: Path) -> Optional[str]:
    """None when no link below `tag_dir` leads outside it and every `.pt` below it loads with `load_pt`;
    else the one-line reason for the first that does not (files in sorted order; nothing of any runs)."""
    link = foreign_link(tag_dir)
    if link:
        return link
    for path in sorted(Path(tag_dir).rglob("*.pt")):
        try:
            load_pt(path, mmap=True)
        except UnsafeCheckpointError as err:
            return str(err)
    return None
