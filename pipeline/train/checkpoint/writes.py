"""Checkpoint writes that fail cleanly: a full disk (or any other write error) while a checkpoint is
saved becomes one clear `CheckpointWriteError` on every rank ("no space left on device: PATH"),
the partial tag is removed, and `latest` keeps naming the previous checkpoint (nothing is lost).

Each rank writes its files through DeepSpeed's `engine.checkpoint_engine.save` (torch.save), and
rank 0 writes the train state, meta and completeness record. torch reports a full disk as a C++
error without an errno (`[enforce fail at inline_container.cc] unexpected pos ...`,
`basic_ios::clear`), so a failed write is diagnosed here (`describe_write_failure`): ENOSPC or
EDQUOT in the exception chain, or less free space on the file system than the object being
written occupies. `RecordingWrites` records a failed DeepSpeed write instead of raising it, so that
DeepSpeed's save still reaches its closing barrier on every rank; `save_checkpoint` then lets the
ranks agree (`pipeline.distributed.first_problem`) and every rank raises the same error.
"""
from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import torch


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, quota, I/O error); the previous one is intact."""


def _exception_chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def free_bytes(path: Path) -> int:
    """Bytes this process may still write on the file system holding `path` (or its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    stat = os.statvfs(probe)
    blocks = stat.f_bfree if os.geteuid() == 0 else stat.f_bavail  # root may use the reserved blocks
    return blocks * stat.f_frsize


def object_bytes(obj: Any) -> int:
    """Bytes of the tensors (and byte strings) inside a nested state dict: what writing it needs, at least."""
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (bytes, bytearray, str)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(object_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(object_bytes(v) for v in obj)
    return 0


def describe_write_failure(path: Path, err: BaseException, needed_bytes: Optional[int] = None) -> str:
    """One line saying why writing `path` failed: "no space left on device: PATH" when the disk (or
    quota) is full, else the error itself."""
    for cause in _exception_chain(err):
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"{os.strerror(cause.errno).lower()}: {cause.filename or path}"
        if "no space left on device" in str(cause).lower():
            return f"no space left on device: {path}"
    try:
        free = free_bytes(path)
    except OSError:
        free = None
    if free is not None and needed_bytes is not None and free < needed_bytes:
        return (f"no space left on device: {path} ({free / 2**20:.1f} MiB free, the file needs about "
                f"{needed_bytes / 2**20:.1f} MiB; {type(err).__name__}: {str(err).strip()[:200]})")
    return f"cannot write {path}: {type(err).__name__}: {str(err).strip()[:300]}"


def write_or_describe(path: Path, write: Any, needed_bytes: Optional[int] = None) -> str:
    """Run `write()`; "" on success, else `describe_write_failure` (never raises for write errors)."""
    try:
        write()
    except Exception as err:  # torch.save raises RuntimeError for I/O failures, Python OSError
        return describe_write_failure(path, err, needed_bytes)
    return ""


def check_output_dir(output_dir: Path, rank: int = 0) -> None:
    """Before any compute: `output_dir` (and its `checkpoints/`) exists or can be created, is a
    directory, and takes a file; else a one-line `CheckpointWriteError` naming the path (exit 4, as
    a save that fails later), instead of a traceback at the first save. Each rank probes with its own
    file name (ranks may share the directory)."""
    for directory in (output_dir, output_dir / "checkpoints"):
        blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise CheckpointWriteError(f"train.output_dir={output_dir}: {blocker} exists and is not a directory; "
                                       "choose another train.output_dir (or move that file away)")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".write_probe.{rank}.{os.getpid()}"
            probe.write_bytes(b"\0")
            probe.unlink()
        except OSError as err:
            reason = os.strerror(err.errno).lower() if err.errno else str(err)
            raise CheckpointWriteError(f"train.output_dir={output_dir}: cannot write in {err.filename or directory} "
                                       f"({reason}); make it writable or choose another train.output_dir") from err


class RecordingWrites:
    """A DeepSpeed checkpoint engine whose `save` and `makedirs` record the first failure instead of
    raising it (and skip later writes of the doomed tag); everything else is the wrapped engine's.
    `makedirs` too: DeepSpeed's `save_checkpoint` creates the checkpoint root on rank 0 alone before
    a barrier, so a raise there (disk full, read-only parent) would leave the other ranks waiting."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.problem = ""

    def save(self, state_dict: Any, path: str) -> None:
        if not self.problem:
            self.problem = write_or_describe(Path(path), lambda: self._inner.save(state_dict, path),
                                             object_bytes(state_dict))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if not self.problem:
            self.problem = write_or_describe(Path(path), lambda: self._inner.makedirs(path, exist_ok=exist_ok))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def recording_writes(engine: Any) -> Iterator[RecordingWrites]:
    """Route the engine's checkpoint writes through a `RecordingWrites` for the duration, and also
    DeepSpeed's copy of its recovery scripts (`zero_to_fp32.py`, rank 0, into the checkpoint root,
    at every save: the first file a first save writes), which is not a checkpoint-engine write and
    would otherwise raise on rank 0 alone while the other ranks wait in DeepSpeed's barrier."""
    inner = engine.checkpoint_engine
    recorder = RecordingWrites(inner)
    engine.checkpoint_engine = recorder
    copy_scripts = getattr(engine, "_copy_recovery_script", None)
    if copy_scripts is not None:
        def record_copy(save_path: str) -> None:
            if not recorder.problem:
                recorder.problem = write_or_describe(Path(save_path) / "zero_to_fp32.py",
                                                     lambda: copy_scripts(save_path))
        engine._copy_recovery_script = record_copy
    try:
        yield recorder
    finally:
        engine.checkpoint_engine = inner
        if copy_scripts is not None:
            del engine._copy_recovery_script  # the instance attribute: the class's method shows again
