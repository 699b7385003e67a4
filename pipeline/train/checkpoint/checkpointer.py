"""`Checkpointer`: every checkpoint decision of a run, in one place (torchtitan's CheckpointManager shape).

It owns, for one run directory (`<train.output_dir>/checkpoints/`, layout: `pipeline.train.checkpoint.tags`):

* **resume**: which tag to continue from (`train.resume`), whether its config and data allow it
  (`plan_resume`, the checkpoint's own phase's data), the newer tags an explicit older tag sets
  aside, the model-shape check, and loading it (engine, train state, objective state, best record);
* **when to save**: every `train.checkpoint_every` steps, the last step, a step any rank was asked to
  stop at (SIGTERM/SIGUSR1), and a step whose metric is a new best (`train.keep_best`);
* **the health gate** before a save (`pipeline.train.guard`): no weights holding NaN/Inf, no save
  inside a streak of non-finite steps (a preemption save inside one is written, marked unhealthy),
  the weights' norm within `train.max_weight_norm_ratio` of the previous checkpoint's;
* the background completion (`CheckpointFinisher`: hashes, `COMPLETE.json`, `latest`, pruning to
  `train.keep_last`), settled before the next save and at the end of the run;
* **the best tag** (`train.keep_best` / `train.keep_best_mode`, `pipeline.train.checkpoint.best`):
  `observe_metric(step, values)` is offered every logged metric set (the loop's, and validation's);
  a strictly better value makes that step's checkpoint due and, once it is complete, `best.json`
  names it; pruning never deletes it; the record survives resume.

The loop calls `step_end` after every step, `last_good` for the divergence guard's message, and
`close` on its way out; the entry point calls the resume methods before the first step.
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch

from pipeline.distributed import all_reduce_sum, broadcast_object
from pipeline.train.checkpoint.tags import (
    CHECKPOINT_DIR,
    MODEL_STATES_FILE,
    CheckpointError,
    CheckpointFinisher,
    ResumeTarget,
    TrainState,
    find_resume_checkpoint,
    last_good_tag,
    list_tags,
    plan_resume,
    save_checkpoint,
    settle_pending_save,
    step_of_tag,
    tag_for_step,
)
from pipeline.train.checkpoint.load import load_checkpoint
from pipeline.train.checkpoint.best import BEST_FILE, BestRecord, better, read_best, write_best
from pipeline.train.checkpoint.best_resume import eval_set_change, reconcile_best
from pipeline.train.config import TrainConfig
from pipeline.train.guard import weight_stats
from pipeline.train.optim import check_optimizer_kept
from pipeline.train.checkpoint.run_lock import check_still_held
from pipeline.train.validation import EVAL_SET_KEY, PREFIX
from pipeline.safe_load import UnsafeCheckpointError, load_pt

log = logging.getLogger(__name__)


class Checkpointer:
    """The checkpoint decisions of one run (see the module docstring). `is_main`: this is rank 0."""

    def __init__(self, train: TrainConfig, is_main: bool) -> None:
        self.root = Path(train.output_dir) / CHECKPOINT_DIR
        self.every, self.total, self.keep_last = train.checkpoint_every, train.total_steps, train.keep_last
        self.resume, self.allow_config_change = train.resume, train.allow_config_change
        self.metric, self.mode = train.keep_best, train.keep_best_mode
        self.is_main = is_main
        self.finisher = CheckpointFinisher()  # hashes saved tags off the training step (rank 0)
        self.best: Optional[BestRecord] = None  # the best tag saved (best.json), as of the last save
        self.pending_best: Optional[BestRecord] = None  # a better value seen, its tag not saved yet
        self.keep: set[str] = set()  # tags kept from pruning besides the best (`best_resume`)

    # ---- resume ---------------------------------------------------------------------------------
    def find_resume(self) -> Optional[Path]:
        """The tag to resume from per `train.resume`, verified complete; None = a fresh start."""
        return find_resume_checkpoint(self.resume, self.root)

    def plan_resume(self, resume_dir: Path, config: dict, plan: Any, world_size: int, data_dir: str) -> ResumeTarget:
        """Whether `resume_dir` may be resumed by this run (`config`, `plan`: a `RunPlan`) on
        `world_size` ranks: its data is compared with that of the phase it was written in; an
        explicit older tag of this run sets the newer ones aside."""
        from pipeline.data.shards import manifest_file_sha256
        from pipeline.train.phases.resume import check_resume
        from pipeline.train.run_meta import RunMeta

        try:
            meta = RunMeta.read(resume_dir)
        except (FileNotFoundError, ValueError, TypeError):
            meta = None  # (plan_resume names the problem)
        if meta is not None:  # trained phases and the mixture read so far stay as they were, even if allowed
            check_resume(plan.schedule, meta)
        data_hash, data_dir = plan.schedule.data_identity(resume_dir, plan.manifest_hash, data_dir)
        target = plan_resume(resume_dir, config, data_hash, world_size, plan.zero_stage, self.allow_config_change,
                             manifest_file_sha256(data_dir) if data_dir else "")
        check_optimizer_kept(target.meta.config, config)  # its moments are the saved optimizer's
        step = step_of_tag(resume_dir.name)
        if self.resume not in ("auto", "never") and step is not None and resume_dir.resolve().parent == self.root.resolve():
            target.set_aside = [p for s, p in list_tags(self.root) if s > step]  # moved away once it loaded
        return target

    @staticmethod
    def check_shapes(target: ResumeTarget, model: torch.nn.Module) -> None:
        """With a changed config (`train.allow_config_change=true`), refuse a checkpoint whose tensors
        have other shapes than `model`'s, naming them (before any engine is built)."""
        if not target.changed:
            return  # same config and data: same shapes
        try:
            saved = load_pt(target.tag_dir / MODEL_STATES_FILE)  # weights_only, allow-listed (safe_load)
        except UnsafeCheckpointError as err:
            raise CheckpointError(str(err)) from None
        except Exception as err:
            raise CheckpointError(f"{target.tag_dir / MODEL_STATES_FILE}: unreadable ({type(err).__name__}: {err})") from err
        shapes: dict[str, tuple] = {}
        for group in saved.get("param_shapes") or []:
            shapes.update({name: tuple(shape) for name, shape in group.items()})
        if not shapes and isinstance(saved.get("module"), dict):
            shapes = {name: tuple(t.shape) for name, t in saved["module"].items()}
        current = {name: tuple(p.shape) for name, p in model.named_parameters()}
        differ = [f"{n} {list(shapes[n])} -> {list(current[n])}" for n in current if n in shapes and shapes[n] != current[n]]
        differ += [f"{n} (new)" for n in current if n not in shapes] + [f"{n} (gone)" for n in shapes if n not in current]
        if differ:
            raise CheckpointError(
                f"{target.tag_dir}: this run's model has other tensors than the checkpoint ({len(differ)}: "
                f"{'; '.join(differ[:8])}{' ...' if len(differ) > 8 else ''}); train.allow_config_change=true resumes "
                "changed settings, not a changed model shape. Start a new run (train.output_dir) for a new shape")

    def load(self, engine: Any, target: Optional[ResumeTarget], model: Any, eval_set: str = "",
             eval_dir: str = "") -> TrainState:
        """Collective: the train state to start from (a fresh one without `target`), the engine and the
        objectives' state loaded from `target`, and the best record carried on, reconciled with the
        checkpoint's own and `metrics.jsonl` (`pipeline.train.checkpoint.best_resume`). `eval_set` /
        `eval_dir`: this run's validation set (`Validator.identity`, `eval.shards_dir`; "" without)."""
        if target is None:
            return TrainState()
        state = load_checkpoint(engine, target, self.is_main)
        model.load_extra_state_from_checkpoint(state.objective_state)
        log.info("resumed from %s at step %d (%d samples)", target.tag_dir, state.step, state.consumed_samples)
        if self.is_main and (note := eval_set_change(target.meta, state.step, eval_set, eval_dir)):
            log.warning("%s", note)
        if target.tag_dir.parent.resolve() == self.root.resolve():
            self._resume_best(state.step, target.meta, eval_set)
        return state

    def _resume_best(self, step: int, meta: Any, eval_set: str) -> None:
        """This run's best record and the tags kept beside it, as of resumed step `step`; rank 0 says what
        it rebuilt and rewrites (or, without a best, removes) `best.json` (collective: rank 0 decides)."""
        resumed = reconcile_best(self.root, self.metric, self.mode, step, meta.best, eval_set) if self.is_main else None
        resumed = broadcast_object(resumed)
        self.best, self.keep = resumed.best, set(resumed.keep)
        if not self.is_main:
            return
        for note in resumed.notes:
            log.warning("%s", note)
        stale = read_best(self.root)
        if self.best is not None and stale != self.best:
            write_best(self.root, self.best)
        elif self.best is None and (self.root / BEST_FILE).exists():
            log.info("%s: %s is not this run's best (train.keep_best=%r %s, resumed at step %d): dropped",
                     self.root / BEST_FILE, f"{stale.metric} at step {stale.step}" if stale else "a damaged record",
                     self.metric, self.mode, step)
            (self.root / BEST_FILE).unlink(missing_ok=True)

    # ---- during the run ---------------------------------------------------------------------------
    def observe_metric(self, step: int, values: dict) -> bool:
        """Offer metric values of step `step` (after its update) for the best tag (`train.keep_best`);
        returns whether it is a new best, whose tag is then saved at this step (`step_end`). Collective
        when `train.keep_best` is set: every rank calls it at the same steps; rank 0's values decide."""
        if not self.metric:
            return False
        value = values.get(self.metric) if self.is_main else None
        eval_set = str(values.get(EVAL_SET_KEY, "")) if self.metric.startswith(PREFIX) else ""
        new = None
        if isinstance(value, (int, float)) and better(self.best, self.metric, self.mode, float(value)):
            new = BestRecord(self.metric, self.mode, float(value), step, tag_for_step(step), eval_set)
        new = broadcast_object(new)
        if new is not None:
            self.pending_best = new
        return new is not None

    def due(self, step: int, stop_requested: bool) -> bool:
        """Whether step `step` is saved: every `train.checkpoint_every`, the last, a stop, a new best."""
        new_best = self.pending_best is not None and self.pending_best.step == step
        return step % self.every == 0 or step == self.total or stop_requested or new_best

    def step_end(self, run: Any, step: int, stop_requested: bool, last_metrics: dict) -> bool:
        """Collective, after step `step` of `run` (a `pipeline.train.loop.Run`): when it is due, the
        health gate, then the save (`last_metrics`: the newest logged metrics, for the model card).
        After the last step, or a stop (`stop_requested`), the save is settled (complete, `latest`
        moved) before this returns: the run ends next.
        Returns whether the step was due (the caller keeps the save time out of its throughput)."""
        if not self.due(step, stop_requested):
            return False
        state, final = run.state, step == self.total
        nonfinite_weights, norm_sq = all_reduce_sum(weight_stats(run.model, run.device, self.is_main)).tolist()
        run.guard.check_savable(state, step, final, nonfinite_weights)
        if state.nonfinite_in_row and not stop_requested:  # these weights just gave a non-finite loss
            log.warning("step %d: not saving a checkpoint inside a streak of %d non-finite step(s)",
                        step, state.nonfinite_in_row)
        else:
            if not state.nonfinite_in_row:  # a preemption save inside a streak judges nothing
                run.guard.check_weight_norm(state, step, norm_sq ** 0.5, lambda: self.last_good(step))
            self.save(run, last_metrics, healthy=not state.nonfinite_in_row)
        if stop_requested or final:
            self.settle()
        return True

    def save(self, run: Any, last_metrics: dict, healthy: bool = True) -> Path:
        """Collective: checkpoint `run` at its current step (`healthy`: recorded for pruning); a new
        best of this step goes with it into `best.json` once the tag is complete."""
        state, meta = run.state, run.meta
        state.objective_state = run.model.extra_state_for_checkpoint()
        meta.step, meta.consumed_samples, meta.tokens_seen = state.step, state.consumed_samples, state.tokens_seen
        meta.last_metrics = {k: v for k, v in last_metrics.items() if isinstance(v, (int, float))}
        check_still_held(self.root.parent, self.is_main)  # no second writer took the directory (run_lock)
        dataset, batches = run.batches.dataset, run.batches  # a mixture: where each source stands
        meta.mixture = dataset.record(batches.seed, batches.consumed_samples, state.phase) \
            if hasattr(dataset, "record") else {}
        best = self.pending_best if healthy and self.pending_best and self.pending_best.step == state.step else None
        current = best or self.best  # the best as of this tag: recorded in it, written to best.json, never pruned
        meta.best = {"record": asdict(current) if current else None, "keep": sorted(self.keep)}
        tag_dir = save_checkpoint(run.engine, self.root, state, meta, self.keep_last, self.is_main, self.finisher,
                                  healthy, current, sorted(self.keep))
        if best is not None:
            self.best, self.pending_best = best, None
        return tag_dir

    def settle(self) -> None:
        """Collective: the background completion of the last save has finished; if it failed, every
        rank raises `CheckpointWriteError` (exit 4, `latest` names the checkpoint before)."""
        settle_pending_save(self.finisher, self.root, self.is_main)

    def last_good(self, before_step: int) -> str:
        """Collective: once the last save is complete, the newest healthy checkpoint below
        `before_step` (for the divergence guard's message)."""
        self.settle()
        tag = last_good_tag(self.root, before_step)
        return str(tag) if tag is not None else "none (this run saved no checkpoint before it)"

    def close(self) -> None:
        """On the way out (also with an error on its way: no collective): rank 0 waits for the last
        completion; its failure is logged (the error already leaving wins)."""
        if self.is_main and (problem := self.finisher.wait()):
            log.error("the last checkpoint's completion failed too: %s", problem)
