"""Checkpoints: DeepSpeed engine state + the training state beside it, complete-or-absent, resumable.

Layout of `<output_dir>/checkpoints/`:

    latest                      text: the newest complete tag; replaced atomically, moved last
    step_00001000/              one tag = one checkpoint
      mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt, ...   DeepSpeed's own files
      train_state.pt            `TrainState`: step, consumed samples, tokens, guard counters,
                                objective extra state (CAPT's memory queue)
      pipeline_meta.json        `RunMeta`: config + hashes, encoder/objectives, data, world size
      COMPLETE.json             written after every rank finished: every file's size and sha256
      universal/                (only after a resume with another rank count or ZeRO stage)

A tag counts only with `COMPLETE.json` and every listed file at its recorded size (and, checked
once before resuming, its sha256: garbage is caught, not only truncation). `latest` moves only
after that marker exists, so a crash mid-save leaves the previous checkpoint in charge. A partial
tag directory is deleted and rewritten when that step is saved again; a complete one is never
overwritten. The last `keep_last` complete checkpoints are kept.

Off the critical path: once every rank's files are written (the barrier), the last stage — fsync,
the sha256 of every file, `COMPLETE.json`, `latest`, pruning — only reads what is already on disk,
so the training loop hands it to a `CheckpointFinisher` thread (rank 0) and goes on with the next
step. The order inside the thread is the same as inline, so `latest` still moves only after the
complete record with hashes exists; the next save, and the end of the run (also after a
preemption), wait for it, so a run never exits with its last checkpoint unfinished.

RNG: no generator state needs saving: every random number comes from a named stream of
`pipeline.seeding`, keyed by the run seed and the position in the run (sample index, step, rank),
so a resumed step draws exactly the numbers the uninterrupted run drew.

Resume with a different number of ranks (or ZeRO stage 1 <-> 2): DeepSpeed refuses to re-partition
ZeRO optimizer states directly, so the checkpoint is converted once to DeepSpeed's *universal*
format (`deepspeed.checkpoint.ds_to_universal`, one file per parameter and optimizer moment) into
`<tag>/universal/` and loaded with `checkpoint.load_universal`. ZeRO-3 checkpoints must be resumed
on the rank count that wrote them: DeepSpeed 0.19's universal loading restores their weights but
not a trajectory-preserving optimizer state (measured: losses drift by 1e-4 within 2 steps).

Preemption (`pipeline.train.preemption`) checkpoints through `save_checkpoint` and exits with
`REQUEUE_EXIT_CODE` (75), which job scripts read as "requeue".
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from pipeline.config.checks import ConfigError
from pipeline.config.run import config_differences, config_hash
from pipeline.distributed import barrier, broadcast_object
from pipeline.train.run_meta import META_FILE, RunMeta

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest"
COMPLETE_FILE = "COMPLETE.json"
TRAIN_STATE_FILE = "train_state.pt"
UNIVERSAL_TAG = "universal"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (partial, corrupt, or from a different config/data)."""


def tag_for_step(step: int) -> str:
    return f"step_{step:08d}"


def step_of_tag(tag: str) -> Optional[int]:
    if tag.startswith("step_") and tag[5:].isdigit():
        return int(tag[5:])
    return None


@dataclass
class TrainState:
    """What the loop needs beyond the engine to continue exactly where it stopped."""

    step: int = 0
    consumed_samples: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0  # steps whose update was dropped (non-finite loss/gradients, fp16 overflow)
    nonfinite_steps: int = 0  # steps with a non-finite loss, in total
    nonfinite_in_row: int = 0  # ... and consecutively up to `step`
    objective_state: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict) -> "TrainState":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})


# --------------------------------------------------------------------------------------------
# Atomic small files and completeness
# --------------------------------------------------------------------------------------------
def _write_text_atomic(path: Path, text: str) -> None:
    from pipeline.data.shards import write_atomic

    write_atomic(path, text)


def _fsync_tree(directory: Path) -> None:
    """Flush every file below `directory` (written by any rank) to stable storage."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def _listing(tag_dir: Path) -> dict[str, dict]:
    """Relative path -> {bytes, sha256} of every file of a tag (the universal sub-directory excluded)."""
    from pipeline.data.shards import sha256_file

    return {
        p.relative_to(tag_dir).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(tag_dir.rglob("*"))
        if p.is_file() and p.name != COMPLETE_FILE and p.relative_to(tag_dir).parts[0] != UNIVERSAL_TAG
    }


def verify_checkpoint(tag_dir: Path, check_hashes: bool = False) -> dict:
    """The completeness record of `tag_dir`, or a `CheckpointError` saying what is wrong.

    Always checks that every recorded file exists with its recorded size (cheap); with
    `check_hashes` also its sha256 (reads everything: done once, by rank 0, before resuming).
    """
    from pipeline.data.shards import sha256_file

    marker = tag_dir / COMPLETE_FILE
    if not tag_dir.is_dir():
        raise CheckpointError(f"{tag_dir}: no such checkpoint directory")
    if not marker.is_file():
        raise CheckpointError(f"{tag_dir}: partial checkpoint (no {COMPLETE_FILE}: the save did not finish); "
                              "resume from an older tag with train.resume=<tag dir>")
    try:
        record = json.loads(marker.read_text())
        files = record["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{marker}: unreadable completeness record ({err}); the checkpoint is corrupt") from err
    for name, expected in files.items():
        path = tag_dir / name
        if not path.is_file():
            raise CheckpointError(f"{tag_dir}: file {name} listed in {COMPLETE_FILE} is missing; the checkpoint is "
                                  "incomplete")
        if path.stat().st_size != expected["bytes"]:
            raise CheckpointError(f"{tag_dir}: file {name} has {path.stat().st_size} bytes, {expected['bytes']} were "
                                  "written; the checkpoint is truncated or corrupt")
        if check_hashes and sha256_file(path) != expected["sha256"]:
            raise CheckpointError(f"{tag_dir}: file {name} does not match the sha256 recorded when it was written; "
                                  "the checkpoint is corrupt — resume from an older tag with train.resume=<tag dir>")
    for required in (TRAIN_STATE_FILE, META_FILE):
        if required not in files:
            raise CheckpointError(f"{tag_dir}: {required} missing from the checkpoint")
    return record


def is_complete(tag_dir: Path) -> bool:
    try:
        verify_checkpoint(tag_dir)
    except CheckpointError:
        return False
    return True


def read_latest(root: Path) -> Optional[Path]:
    """The tag directory `root/latest` points to, or None when there is no pointer."""
    pointer = root / LATEST_FILE
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    if not tag or "/" in tag:
        raise CheckpointError(f"{pointer}: does not name a tag ({tag!r})")
    return root / tag


def list_tags(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every `step_*` directory under root, oldest first (complete or not)."""
    if not root.is_dir():
        return []
    tags = [(step_of_tag(p.name), p) for p in root.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in tags if s is not None)


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------
class CheckpointFinisher:
    """Runs rank 0's completion stage of a save on a background thread, one at a time.

    `wait()` joins the running one and re-raises its failure as a `CheckpointError` (the tag then
    stays partial and `latest` still names the previous checkpoint).
    """

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._tag: Optional[Path] = None

    def start(self, tag_dir: Path, work: Any) -> None:
        self.wait()
        self._tag = tag_dir

        def run() -> None:
            try:
                work()
            except BaseException as err:  # noqa: BLE001 - handed to the training thread by wait()
                self._error = err

        self._thread = threading.Thread(target=run, name=f"checkpoint-complete-{tag_dir.name}", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"{self._tag}: completing the checkpoint failed ({type(error).__name__}: {error}); "
                                  "it stays partial and 'latest' still names the previous one") from error


def _complete(root: Path, tag_dir: Path, step: int, keep_last: int) -> None:
    """Rank 0's last stage of a save: flush, record sizes and hashes, then move `latest`, then prune."""
    _fsync_tree(tag_dir)
    record = {"tag": tag_dir.name, "step": step, "files": _listing(tag_dir)}
    _write_text_atomic(tag_dir / COMPLETE_FILE, json.dumps(record, indent=1, sort_keys=True))
    _write_text_atomic(root / LATEST_FILE, tag_dir.name)
    prune_checkpoints(root, keep_last)


def save_checkpoint(engine: Any, root: Path, state: TrainState, meta: RunMeta, keep_last: int, is_main: bool,
                    finisher: Optional[CheckpointFinisher] = None) -> Path:
    """Save tag `step_<state.step>` (collective: every rank calls it). Returns the tag directory.

    With a `finisher`, rank 0 completes the tag (hashes, `COMPLETE.json`, `latest`) on its thread
    and this returns as soon as every rank's files are written; without, before returning."""
    tag = tag_for_step(state.step)
    tag_dir = root / tag
    skip = False
    if finisher is not None and is_main:
        finisher.wait()  # the previous tag's completion owns `latest` and pruning until it is done
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tag_dir.exists():
            if is_complete(tag_dir):
                skip = True  # the same step is already safely on disk: never overwrite it
            else:
                log.warning("removing partial checkpoint %s before saving it again", tag_dir)
                shutil.rmtree(tag_dir)
    if broadcast_object(skip):
        log.info("checkpoint %s already complete; not rewritten", tag_dir)
        return tag_dir
    barrier()
    engine.save_checkpoint(str(root), tag=tag, client_state={}, save_latest=False)
    if is_main:
        tmp = tag_dir / (TRAIN_STATE_FILE + ".tmp")
        torch.save(asdict(state), tmp)
        os.replace(tmp, tag_dir / TRAIN_STATE_FILE)
        meta.write(tag_dir)
    barrier()  # every rank's DeepSpeed files are written
    if finisher is not None:
        if is_main:
            step = state.step  # the loop moves on while the thread runs: bind the value now
            finisher.start(tag_dir, lambda: _complete(root, tag_dir, step, keep_last))
        return tag_dir
    if is_main:
        _complete(root, tag_dir, state.step, keep_last)
    barrier()
    return tag_dir


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete tags, and partial tags older than `latest`."""
    latest = read_latest(root)
    latest_step = step_of_tag(latest.name) if latest is not None else None
    complete = [(s, p) for s, p in list_tags(root) if is_complete(p)]
    doomed = [p for _, p in complete[:-keep_last] if p != latest] if keep_last > 0 else []
    if latest_step is not None:
        doomed += [p for s, p in list_tags(root) if s < latest_step and not is_complete(p)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


# --------------------------------------------------------------------------------------------
# Resuming
# --------------------------------------------------------------------------------------------
@dataclass
class ResumeTarget:
    tag_dir: Path
    meta: RunMeta
    universal: bool  # rank count or ZeRO stage changed: load through the universal format


def find_resume_checkpoint(resume: str, root: Path) -> Optional[Path]:
    """The tag directory to resume from per `train.resume`, verified complete; None = fresh start."""
    latest = read_latest(root)
    if resume == "never":
        if latest is not None:
            raise ConfigError(f"train.resume=never but {root} already holds checkpoints (latest: {latest.name}); "
                              "use a new train.output_dir, or train.resume=auto to continue")
        return None
    if resume == "auto":
        if latest is None:
            return None
        tag_dir = latest
    else:
        tag_dir = Path(resume)
        if (tag_dir / LATEST_FILE).is_file():  # a checkpoints/ directory
            tag_dir = read_latest(tag_dir)  # type: ignore[assignment]
        elif (tag_dir / CHECKPOINT_DIR / LATEST_FILE).is_file():  # a run directory
            tag_dir = read_latest(tag_dir / CHECKPOINT_DIR)  # type: ignore[assignment]
        if latest is not None and latest.resolve() != tag_dir.resolve():
            raise ConfigError(f"train.resume={resume}: {root} already holds other checkpoints (latest: {latest.name}); "
                              "resume into a new train.output_dir so that no good checkpoint is overwritten")
    verify_checkpoint(tag_dir)
    return tag_dir


def plan_resume(tag_dir: Path, config: dict, manifest_hash: str, world_size: int, zero_stage: int,
                allow_config_change: bool) -> ResumeTarget:
    """Read the checkpoint's meta and refuse a different config or data unless allowed."""
    try:
        meta = RunMeta.read(tag_dir)
    except (FileNotFoundError, ValueError, TypeError) as err:
        raise CheckpointError(f"{tag_dir}: unreadable {META_FILE} ({err})") from err
    problems = []
    if meta.config_hash != config_hash(config):
        problems += config_differences(meta.config, config) or ["(config hash differs)"]
    if meta.manifest_hash != manifest_hash:
        problems.append(f"data manifest: {meta.manifest_hash[:12]} ({meta.data_dir}) -> {manifest_hash[:12]}")
    if problems:
        text = "; ".join(problems)
        if not allow_config_change:
            raise CheckpointError(f"{tag_dir} was written with a different config or data: {text}. Pass "
                                  "train.allow_config_change=true to resume anyway")
        log.warning("resuming %s despite changes (train.allow_config_change=true): %s", tag_dir, text)
    universal = (meta.world_size != world_size or meta.zero_stage != zero_stage) and max(meta.zero_stage, zero_stage) > 0
    if universal and 3 in (meta.zero_stage, zero_stage):
        raise CheckpointError(
            f"{tag_dir}: written by {meta.world_size} rank(s) under ZeRO {meta.zero_stage}; resuming it on "
            f"{world_size} rank(s) under ZeRO {zero_stage} is supported for ZeRO 1 and 2 only (DeepSpeed's universal "
            "loading of ZeRO-3 optimizer states does not continue the same trajectory). Resume with "
            f"{meta.world_size} rank(s), or warm-start from the converted weights")
    return ResumeTarget(tag_dir, meta, universal)


def ensure_universal(tag_dir: Path, is_main: bool) -> Path:
    """Convert `tag_dir` to DeepSpeed's universal format once (rank 0), under `<tag>/universal`."""
    target = tag_dir / UNIVERSAL_TAG
    if is_main and not (target / COMPLETE_FILE).is_file():
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        tmp = tag_dir / (UNIVERSAL_TAG + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        log.info("converting %s to DeepSpeed's universal format (rank count or ZeRO stage changed)", tag_dir)
        try:
            ds_to_universal(argparse.Namespace(input_folder=str(tag_dir), output_folder=str(tmp), num_extract_workers=1,
                                               num_merge_workers=1, keep_temp_folder=False, strict=True,
                                               inject_missing_state=True))
        except Exception as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"{tag_dir}: conversion to the universal format failed ({err})") from err
        (tag_dir / "latest_universal").unlink(missing_ok=True)  # the converter's pointer; we load by tag
        (tmp / COMPLETE_FILE).write_text("{}")
        os.replace(tmp, target)
    barrier()
    return target


def load_checkpoint(engine: Any, target: ResumeTarget, is_main: bool) -> TrainState:
    """Verify (rank 0, sha256 of every file) and load engine + train state (collective).
    Any failure is a `CheckpointError` naming the tag, raised on every rank."""
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
        path, _ = engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                         load_lr_scheduler_states=False)
        raw = torch.load(target.tag_dir / TRAIN_STATE_FILE, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointError(f"{target.tag_dir}: failed to load ({type(err).__name__}: {err}); the checkpoint is "
                              "corrupt — resume from an older tag with train.resume=<tag dir>") from err
    if path is None:
        raise CheckpointError(f"{target.tag_dir}: DeepSpeed found no checkpoint to load")
    return TrainState.from_dict(raw)
