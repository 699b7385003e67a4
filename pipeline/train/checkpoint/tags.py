"""Checkpoints: DeepSpeed engine state + the training state beside it, complete-or-absent, resumable.

Layout of `<output_dir>/checkpoints/`:

    latest                      text: the newest complete tag; replaced atomically, moved last
    step_00001000/              one tag = one checkpoint
      mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt, ...   DeepSpeed's own files
      train_state.pt            `TrainState`: step, consumed samples, tokens, guard counters,
                                objective extra state (CAPT's memory queue), the phase it is in
      pipeline_meta.json        `RunMeta`: config + hashes, encoder/objectives, data, world size
      COMPLETE.json             written after every rank finished: every file's size and sha256
      universal/                (only after a resume with another rank count or ZeRO stage)

A tag counts only with `COMPLETE.json` and every listed file at its recorded size (and, checked
once before resuming, its sha256: garbage is caught, not only truncation). `latest` moves only
after that marker exists, so a crash mid-save leaves the previous checkpoint in charge. A partial
tag directory is deleted and rewritten when that step is saved again; a complete one is never
overwritten. The last `keep_last` complete checkpoints are kept, and never fewer than the newest
*confirmed healthy* one: a tag's weights are judged only by the loss of the step after it (a
blow-up in its last update shows there), so pruning after a save keeps, besides the newest
`keep_last`, the newest earlier tag that was saved healthy (`COMPLETE.json` `"healthy"`: false
only for a preemption save inside a streak of non-finite steps). With `keep_last=1` that is two
tags on disk; a diverging run thus always leaves a good checkpoint (`pipeline.train.guard`).

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
`<tag>/universal/` and loaded with `checkpoint.load_universal` (`pipeline.train.checkpoint.load`, which
also loads every tag: verified, and unpickled only by the restricted unpickler, `pipeline.safe_load`). ZeRO-3 checkpoints must be resumed
on the rank count that wrote them: DeepSpeed 0.19's universal loading restores their weights but
not a trajectory-preserving optimizer state (measured: losses drift by 1e-4 within 2 steps).

Preemption (`pipeline.train.preemption`) checkpoints through `save_checkpoint` and exits with
`REQUEUE_EXIT_CODE` (75), which job scripts read as "requeue".

A save that fails (disk full, quota, I/O error) raises `CheckpointWriteError` on every rank with
the failing file ("no space left on device: PATH"), after removing the partial tag: `latest`
still names the previous checkpoint (`pipeline.train.checkpoint.writes`).

`train.resume=<older tag of this run>` resumes from it in the same output directory: the newer
tags are moved (not deleted) to `checkpoints/superseded/` once the older one has loaded, and
`latest` points at it, so the run goes on from there without colliding with them.

`best.json` (`train.keep_best`, `pipeline.train.checkpoint.best`) names the best tag by a logged
metric; pruning never deletes it. When to save, the health gate before a save, resume and the best
tag are decided by `pipeline.train.checkpoint.checkpointer.Checkpointer`; this module does what it decides.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from pipeline.config.checks import ConfigError
from pipeline.train.run_config import config_differences, config_hash
from pipeline.train.checkpoint.schedule_branch import schedule_branch
from pipeline.distributed import barrier, broadcast_object, first_problem
from pipeline.model.arch import arch_of_fields
from pipeline.train.checkpoint.best import BEST_FILE, BestRecord, read_best, write_best
from pipeline.train.checkpoint.writes import CheckpointWriteError, object_bytes, recording_writes, write_or_describe
from pipeline.train.run_meta import META_FILE, RunMeta
from pipeline.safe_load import unsafe_checkpoint_problem
from pipeline.io import sha256_file, write_atomic

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest"
COMPLETE_FILE = "COMPLETE.json"
TRAIN_STATE_FILE = "train_state.pt"
UNIVERSAL_TAG = "universal"
SUPERSEDED_DIR = "superseded"
MODEL_STATES_FILE = "mp_rank_00_model_states.pt"


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
    loss_ema: float = 0.0  # running mean of the finite step losses (the divergence guard's reference)
    weight_norm: float = 0.0  # weights' L2 norm at the previous checkpoint (ditto; 0 = none yet)
    objective_state: dict[str, Any] = field(default_factory=dict)
    phase: str = ""  # the phase (`phases[i].name`, `pipeline.train.phases.schedule`) of the last step; "" without phases
    phase_start_samples: int = 0  # the run's consumed samples when that phase began (its reader's origin)

    @classmethod
    def from_dict(cls, raw: dict) -> "TrainState":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})


# --------------------------------------------------------------------------------------------
# Atomic small files and completeness
# --------------------------------------------------------------------------------------------
def _fsync_tree(directory: Path) -> None:
    """Flush every file below `directory` (written by any rank) to stable storage."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def _listing(tag_dir: Path) -> dict[str, dict]:
    """Relative path -> {bytes, sha256} of every file of a tag (the universal sub-directory excluded)."""
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
    if check_hashes and (unsafe := unsafe_checkpoint_problem(tag_dir)):  # before anything unpickles (safe_load)
        raise CheckpointError(unsafe)
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


def saved_healthy(tag_dir: Path) -> bool:
    """Whether a complete tag was saved outside a streak of non-finite steps (records from before the
    flag count as healthy: the guard never let an unhealthy regular save through)."""
    try:
        return bool(json.loads((tag_dir / COMPLETE_FILE).read_text()).get("healthy", True))
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def last_good_tag(root: Path, before_step: int) -> Optional[Path]:
    """The newest complete, healthy tag of `root` with a step below `before_step`, or None."""
    good = [p for s, p in list_tags(root) if s < before_step and is_complete(p) and saved_healthy(p)]
    return good[-1] if good else None


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
    """Runs rank 0's completion stage of a save (hashes, `COMPLETE.json`, `latest`, pruning) on a
    background thread, one at a time, so hashing a large checkpoint stays off the training step.

    The work reports a failed write as text, never as an exception (`writes`); `wait()`
    joins the running completion and returns that text once ("" when it succeeded). The failure is
    turned into the same `CheckpointWriteError` on every rank by `settle_pending_save`.
    """

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._problem = ""

    def start(self, tag_dir: Path, work: Callable[[], str]) -> None:
        if self._thread is not None:
            raise RuntimeError("CheckpointFinisher.start: the previous completion was not waited for")

        def run() -> None:
            try:
                self._problem = work()
            except BaseException as err:  # noqa: BLE001 - handed to the training thread by wait()
                self._problem = f"{tag_dir}: completing the checkpoint failed ({type(err).__name__}: {err})"

        self._thread = threading.Thread(target=run, name=f"checkpoint-complete-{tag_dir.name}", daemon=False)
        self._thread.start()

    def wait(self) -> str:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        problem, self._problem = self._problem, ""
        return problem


def settle_pending_save(finisher: Optional[CheckpointFinisher], root: Path, is_main: bool) -> None:
    """Collective: wait for rank 0's background completion of the last save; when it failed, every
    rank raises the same `CheckpointWriteError` (the tag was removed; `latest` names the one before)."""
    problem = finisher.wait() if finisher is not None and is_main else ""
    _fail_together(problem, root, None, is_main)


def _complete_or_describe(root: Path, tag_dir: Path, step: int, keep_last: int, healthy: bool = True,
                          best: Optional[BestRecord] = None, keep: Sequence[str] = ()) -> str:
    """Rank 0's last stage of a save: flush, record sizes and hashes, move `latest`, `best.json` (`best`:
    the run's best as of this tag, written when the file does not already say it: a new best, or a file
    damaged since), prune (never `best`'s tag nor `keep`'s). Returns "" or what went wrong, after
    removing the unfinished tag (`latest` still names the previous one)."""
    problem = write_or_describe(tag_dir / COMPLETE_FILE, lambda: _complete(root, tag_dir, step, healthy))
    if not problem and best is not None and read_best(root) != best:
        problem = write_or_describe(root / BEST_FILE, lambda: write_best(root, best))
    if problem:
        shutil.rmtree(tag_dir, ignore_errors=True)
        (root / (LATEST_FILE + ".tmp")).unlink(missing_ok=True)  # `latest` is replaced last: never this tag
        return f"{problem}. Checkpoint {tag_dir.name} was not completed (its files were removed)"
    prune_checkpoints(root, keep_last, [*keep, *([best.tag] if best is not None else [])])
    return ""


def save_checkpoint(engine: Any, root: Path, state: TrainState, meta: RunMeta, keep_last: int, is_main: bool,
                    finisher: Optional[CheckpointFinisher] = None, healthy: bool = True,
                    best: Optional[BestRecord] = None, keep: Sequence[str] = ()) -> Path:
    """Save tag `step_<state.step>` (collective: every rank calls it). Returns the tag directory.

    With a `finisher`, rank 0 completes the tag (hashes, `COMPLETE.json`, `latest`) on its thread
    and this returns as soon as every rank's files are written; without, before returning.
    `healthy` is recorded in `COMPLETE.json` (pruning keeps the newest healthy tag); `best`: the run's
    best as of this tag (this tag, or an earlier complete one), written to `best.json` once the tag is
    complete when the file does not say it already (`pipeline.train.checkpoint.best`); pruning keeps
    it and the tags `keep` names."""
    tag = tag_for_step(state.step)
    tag_dir = root / tag
    skip = False
    settle_pending_save(finisher, root, is_main)  # the previous completion owns `latest` and pruning until done
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
        pointer = read_latest(root) if is_main else None  # older if a kill fell between COMPLETE.json and `latest`
        move = is_main and (pointer is None or (step_of_tag(pointer.name) or 0) < state.step)
        pointer_file = root / LATEST_FILE
        problem = write_or_describe(pointer_file, lambda: write_atomic(pointer_file, tag)) if move else ""
        if is_main and best is not None and not problem and read_best(root) != best:
            problem = write_or_describe(root / BEST_FILE, lambda: write_best(root, best))
        _fail_together(problem, root, None, is_main)  # `latest` names the newest complete tag, as after a save
        return tag_dir
    barrier()
    with recording_writes(engine) as writes:  # a failed write is recorded, so every rank reaches the end
        engine.save_checkpoint(str(root), tag=tag, client_state={}, save_latest=False)
    problem = writes.problem
    if is_main and not problem:
        problem = (_write_run_files(tag_dir, state, meta)
                   or write_conversion_readme(root, arch_of_fields(meta.encoder_config)))
    _fail_together(problem, root, tag_dir, is_main)  # also waits until every rank's files are written
    if finisher is not None:
        if is_main:
            step = state.step  # the loop moves on while the thread runs: bind the value now
            finisher.start(tag_dir, lambda: _complete_or_describe(root, tag_dir, step, keep_last, healthy, best, keep))
        return tag_dir
    if is_main:
        problem = _complete_or_describe(root, tag_dir, state.step, keep_last, healthy, best, keep)
    _fail_together(problem, root, None, is_main)
    barrier()
    return tag_dir


def write_conversion_readme(root: Path, arch: str) -> str:
    """`checkpoints/README.md`: how to convert these checkpoints of family `arch` (beside DeepSpeed's
    zero_to_fp32.py, which alone yields no Hugging Face model; `pipeline.train.checkpoint.readme`); "" or
    what went wrong."""
    from pipeline.train.checkpoint.readme import README_FILE, render_checkpoint_readme

    path = root / README_FILE
    text = render_checkpoint_readme(root, arch)
    if path.is_file() and path.read_text() == text:
        return ""
    return write_or_describe(path, lambda: write_atomic(path, text))


def _write_run_files(tag_dir: Path, state: TrainState, meta: RunMeta) -> str:
    """Rank 0's own files of a tag (train state, meta); "" or what went wrong."""
    tmp, raw = tag_dir / (TRAIN_STATE_FILE + ".tmp"), asdict(state)

    def write_state() -> None:
        torch.save(raw, tmp)
        os.replace(tmp, tag_dir / TRAIN_STATE_FILE)

    return (write_or_describe(tag_dir / TRAIN_STATE_FILE, write_state, object_bytes(raw))
            or write_or_describe(tag_dir / META_FILE, lambda: meta.write(tag_dir)))


def _complete(root: Path, tag_dir: Path, step: int, healthy: bool = True) -> None:
    """Flush the tag, write its completeness record, then move `latest` to it."""
    _fsync_tree(tag_dir)
    record = {"tag": tag_dir.name, "step": step, "healthy": healthy, "files": _listing(tag_dir)}
    write_atomic(tag_dir / COMPLETE_FILE, json.dumps(record, indent=1, sort_keys=True))
    write_atomic(root / LATEST_FILE, tag_dir.name)


def _fail_together(problem: str, root: Path, tag_dir: Optional[Path], is_main: bool) -> None:
    """Collective: when any rank's write failed, every rank raises the same `CheckpointWriteError`,
    after rank 0 removed the partial tag (its space is freed; `latest` never pointed at it). With
    `tag_dir` None the tag was already removed (a failed completion says so in `problem`)."""
    problem = first_problem(problem)
    if not problem:
        return
    if is_main and tag_dir is not None:
        shutil.rmtree(tag_dir, ignore_errors=True)
        (root / (LATEST_FILE + ".tmp")).unlink(missing_ok=True)  # `latest` is replaced last: never the failed tag
    barrier()
    latest = read_latest(root)
    removed = f". Checkpoint {tag_dir.name} was not written (its partial files were removed)" if tag_dir else ""
    raise CheckpointWriteError(
        f"{problem}{removed}; checkpoints/latest "
        f"{'still names ' + latest.name if latest else 'does not exist yet (nothing was saved before)'}. Free space "
        f"in {root} (or choose another train.output_dir) and resume")


def prune_checkpoints(root: Path, keep_last: int, protect: Sequence[str] = ()) -> list[Path]:
    """Delete all but the newest `keep_last` complete tags, and partial tags older than `latest`;
    never `latest`, nor the newest healthy tag before the newest one (the newest's weights have not
    produced a loss yet, so the one before is the newest known good), nor the best tag (`best.json`,
    `train.keep_best`), nor a tag `protect` names (the run's own best record and the tags kept beside
    it: a `best.json` damaged during the run protects nothing by itself)."""
    latest = read_latest(root)
    latest_step = step_of_tag(latest.name) if latest is not None else None
    complete = [(s, p) for s, p in list_tags(root) if is_complete(p)]
    confirmed = [p for _, p in complete[:-1] if saved_healthy(p)]
    best = read_best(root)
    keep = {latest, confirmed[-1] if confirmed else None, root / best.tag if best is not None else None,
            *(root / tag for tag in protect)}
    doomed = [p for _, p in complete[:-keep_last] if p not in keep] if keep_last > 0 else []
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
    changed: bool = False  # config or data differ (allowed by train.allow_config_change)
    set_aside: list[Path] = field(default_factory=list)  # newer tags of this run, moved away once loaded


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
        own_tag = tag_dir.resolve().parent == root.resolve()
        if latest is not None and latest.resolve() != tag_dir.resolve() and not own_tag:
            raise ConfigError(f"train.resume={resume}: {root} already holds checkpoints of another run (latest: "
                              f"{latest.name}); resume into a new train.output_dir, or name one of {root}'s own tags")
    verify_checkpoint(tag_dir)
    return tag_dir


def set_aside(root: Path, tags: list[Path], resumed: Path) -> None:
    """Move `tags` to `root/superseded/` (kept, never deleted) and point `latest` at `resumed`."""
    target = root / SUPERSEDED_DIR
    target.mkdir(exist_ok=True)
    for tag in tags:
        dest, n = target / tag.name, 0
        while dest.exists():
            n += 1
            dest = target / f"{tag.name}.{n}"
        os.replace(tag, dest)
        log.warning("train.resume=%s: newer checkpoint %s moved to %s", resumed, tag.name, dest)
    write_atomic(root / LATEST_FILE, resumed.name)


#: Hashes of configs whose differences from their checkpoint are the overrides `cpt-train --resume` was
#: given (`pipeline.train.checkpoint.resume_run` allows those without `train.allow_config_change=true`): `plan_resume`
#: reports them as the changes asked for, not as an allowance the user never set (issue 42).
_RESUME_OVERRIDE_CONFIGS: set[str] = set()


def note_resume_overrides(config: dict) -> None:
    """Mark `config` (a `RunConfig.to_dict()`) as `--resume`'s saved config changed by its overrides."""
    _RESUME_OVERRIDE_CONFIGS.add(config_hash(config))


def plan_resume(tag_dir: Path, config: dict, manifest_hash: str, world_size: int, zero_stage: int,
                allow_config_change: bool, legacy_manifest_hash: str = "") -> ResumeTarget:
    """Read the checkpoint's meta and refuse a different config or data unless allowed.
    `legacy_manifest_hash`: the manifest file's sha256, the data identity older checkpoints recorded."""
    try:
        meta = RunMeta.read(tag_dir)
    except (FileNotFoundError, ValueError, TypeError) as err:
        raise CheckpointError(f"{tag_dir}: unreadable {META_FILE} ({err})") from err
    total_steps = int(config.get("train", {}).get("total_steps", 0))
    if meta.step > total_steps:
        raise CheckpointError(
            f"train.total_steps={total_steps} is below step {meta.step} of the checkpoint it resumes ({tag_dir}): "
            f"nothing would be trained. To extend the run: cpt-train --resume {tag_dir.parent.parent} "
            f"train.total_steps=N with N above {meta.step}; to train fewer steps, start a new train.output_dir")
    problems = []
    if meta.config_hash != config_hash(config):
        problems += config_differences(meta.config, config) or ["(config hash differs)"]
    data_changed = meta.manifest_hash not in (manifest_hash, legacy_manifest_hash or manifest_hash)
    if data_changed:
        problems.append(f"data manifest: {meta.manifest_hash[:12]} ({meta.data_dir}) -> {manifest_hash[:12]}")
    if problems:
        text = "; ".join(problems)
        # a decay branched off a stable-phase checkpoint: only later steps' rates change (pipeline.train.checkpoint.schedule_branch)
        branch, why = (False, "") if data_changed else schedule_branch(meta.config, config, meta.step)
        if branch:
            _RESUME_OVERRIDE_CONFIGS.discard(config_hash(config))  # (a --resume override of the schedule)
            log.info("resuming %s on a new LR schedule from step %d (the rate of every trained step unchanged): %s",
                     tag_dir, meta.step + 1, text)
        elif not allow_config_change:
            raise CheckpointError(f"{tag_dir} was written with a different config or data: {text}"
                                  f"{f' ({why})' if why else ''}. Pass train.allow_config_change=true to resume anyway")
        elif config_hash(config) in _RESUME_OVERRIDE_CONFIGS:  # noted for this resume only: taken once
            _RESUME_OVERRIDE_CONFIGS.discard(config_hash(config))
            log.info("resuming %s with the changes --resume's overrides asked for: %s", tag_dir, text)
        else:
            log.warning("resuming %s despite changes (train.allow_config_change=true): %s", tag_dir, text)
    universal = (meta.world_size != world_size or meta.zero_stage != zero_stage) and max(meta.zero_stage, zero_stage) > 0
    if universal and 3 in (meta.zero_stage, zero_stage):
        raise CheckpointError(
            f"{tag_dir}: written by {meta.world_size} rank(s) under ZeRO {meta.zero_stage}; resuming it on "
            f"{world_size} rank(s) under ZeRO {zero_stage} is supported for ZeRO 1 and 2 only (DeepSpeed's universal "
            "loading of ZeRO-3 optimizer states does not continue the same trajectory). Resume with "
            f"{meta.world_size} rank(s), or warm-start from the converted weights")
    return ResumeTarget(tag_dir, meta, universal, changed=bool(problems))
