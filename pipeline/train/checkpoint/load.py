"""Loading a checkpoint tag into a DeepSpeed engine: verified, converted to the universal format when
the rank count or ZeRO stage changed, and never running code from a file of it.

Order of a load (`load_checkpoint`, collective):

1. rank 0 verifies the tag (`verify_checkpoint(check_hashes=True)`: every recorded file at its size
   and sha256; no symbolic link below the tag leading outside it; every `.pt` below it readable by the
   restricted unpickler, `pipeline.safe_load`), and every rank raises the same `CheckpointError`;
2. with another rank count or ZeRO stage, rank 0 converts the tag once to DeepSpeed's universal format
   (`ensure_universal`, `<tag>/universal/`);
3. DeepSpeed loads the engine (its own files, or the universal ones) and the loop's `train_state.pt`
   is read, all inside `safe_unpickling()`: every `torch.load` DeepSpeed makes is the restricted
   unpickler's, so a file swapped after step 1, or one step 1 never saw, runs nothing either.

The universal conversion records what it was made from (`universal/COMPLETE.json`: the sha256 of the
tag's own `COMPLETE.json`, and the size and sha256 of every file it wrote). A conversion is reused
only when that record matches the tag and every file in it; anything else (a record from another
tag, a file changed, added or missing, the old `{}` marker) is converted again, said in one line. So
a `universal/` copied in from elsewhere is never loaded as this tag's state.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from pipeline.distributed import barrier, broadcast_object
from pipeline.io import sha256_file
from pipeline.safe_load import UnsafeCheckpointError, foreign_link, load_pt, safe_unpickling
from pipeline.train.checkpoint.tags import (
    COMPLETE_FILE,
    TRAIN_STATE_FILE,
    UNIVERSAL_TAG,
    CheckpointError,
    ResumeTarget,
    TrainState,
    set_aside,
    verify_checkpoint,
)

log = logging.getLogger(__name__)


def _universal_listing(target: Path) -> dict[str, dict]:
    return {p.relative_to(target).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(target.rglob("*")) if p.is_file() and p.name != COMPLETE_FILE}


def _source_id(tag_dir: Path) -> str:
    return hashlib.sha256((tag_dir / COMPLETE_FILE).read_bytes()).hexdigest()


def universal_mismatch(tag_dir: Path) -> str:
    """'' when `<tag>/universal/` is a conversion of this very tag, intact; else why it is not."""
    target = tag_dir / UNIVERSAL_TAG
    if target.is_symlink():
        return f"{target} is a symbolic link"
    marker = target / COMPLETE_FILE
    if not marker.is_file():
        return f"{target} has no {COMPLETE_FILE} (unfinished)"
    try:
        record = json.loads(marker.read_text())
        source, files = record["source"], record["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{marker} does not record what it was converted from"
    if source != _source_id(tag_dir):
        return f"{target} was converted from another checkpoint than {tag_dir.name}"
    if _universal_listing(target) != files:
        return f"{target}: its files are not the ones the conversion wrote"
    return ""


def _convert(tag_dir: Path) -> None:
    """Rank 0: (re)build `<tag>/universal/` with DeepSpeed's `ds_to_universal`, under `safe_unpickling`."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    target, tmp = tag_dir / UNIVERSAL_TAG, tag_dir / (UNIVERSAL_TAG + ".tmp")
    why = universal_mismatch(tag_dir) if target.exists() or target.is_symlink() else ""
    if target.is_symlink() or target.is_file():  # (a link was refused before if it led out of the tag)
        target.unlink()
    shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("converting %s to DeepSpeed's universal format (rank count or ZeRO stage changed)%s", tag_dir,
             f"; the conversion there is not reused: {why}" if why else "")
    try:
        with safe_unpickling():
            ds_to_universal(argparse.Namespace(input_folder=str(tag_dir), output_folder=str(tmp),
                                               num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                               strict=True, inject_missing_state=True))
    except UnsafeCheckpointError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(str(err)) from None
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{tag_dir}: conversion to the universal format failed ({err})") from err
    (tag_dir / "latest_universal").unlink(missing_ok=True)  # the converter's pointer; we load by tag
    record = {"source": _source_id(tag_dir), "files": _universal_listing(tmp)}
    (tmp / COMPLETE_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, target)


def ensure_universal(tag_dir: Path, is_main: bool) -> Path:
    """Collective: `<tag>/universal/`, converted by rank 0 unless an intact conversion of this tag is
    there (module doc); a failure is the same `CheckpointError` on every rank."""
    problem = ""
    if is_main:
        try:
            link = foreign_link(tag_dir)
            if link:
                raise CheckpointError(link)
            if universal_mismatch(tag_dir):
                _convert(tag_dir)
        except CheckpointError as err:
            problem = str(err)
    problem = broadcast_object(problem)
    if problem:
        raise CheckpointError(problem)
    return tag_dir / UNIVERSAL_TAG


def load_checkpoint(engine: Any, target: ResumeTarget, is_main: bool) -> TrainState:
    """Verify (rank 0, sha256 of every file) and load engine + train state (collective, module doc).
    Any failure is a `CheckpointError` naming the tag (or the refused file), raised on every rank."""
    problem = ""
    if is_main:
        try:
            verify_checkpoint(target.tag_dir, check_hashes=True)
        except CheckpointError as err:
            problem = str(err)
    problem = broadcast_object(problem)
    if problem:
        raise CheckpointError(problem)
    load_dir, tag = target.tag_dir.parent, target.tag_dir.name
    if target.universal:
        ensure_universal(target.tag_dir, is_main)
        load_dir, tag = target.tag_dir, UNIVERSAL_TAG
    try:
        with safe_unpickling():  # whatever DeepSpeed opens, the restricted unpickler reads it
            path, _ = engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                             load_lr_scheduler_states=False)
        raw = load_pt(target.tag_dir / TRAIN_STATE_FILE)
    except UnsafeCheckpointError as err:
        raise CheckpointError(str(err)) from None
    except Exception as err:
        raise CheckpointError(f"{target.tag_dir}: failed to load ({type(err).__name__}: {err}); the checkpoint is "
                              "corrupt — resume from an older tag with train.resume=<tag dir>") from err
    if path is None:
        raise CheckpointError(f"{target.tag_dir}: DeepSpeed found no checkpoint to load")
    if target.set_aside:
        if is_main:
            set_aside(target.tag_dir.parent, target.set_aside, target.tag_dir)
        barrier()
    return TrainState.from_dict(raw)
