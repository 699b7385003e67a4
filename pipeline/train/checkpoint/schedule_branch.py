"""Branching a learning-rate decay off a stable-phase checkpoint (`optim.schedule=wsd`).

A warmup-stable-decay run (Hägele et al. 2024; ModernBERT's "trapezoidal" schedule) keeps its
stable-phase checkpoints so that a decay can start from any of them: `train.resume=<stable tag>`
with a schedule override (a new `train.total_steps`, `optim.decay_steps` / `optim.decay_fraction`
or `optim.decay_shape`). `plan_resume` accepts such a resume without
`train.allow_config_change=true` when `schedule_branch` finds that

  * every resume-relevant field that differs is a schedule field (`optim.SCHEDULE_FIELDS`) or
    `train.total_steps`, and the data is the same (the caller checks the manifest);
  * the learning rate of every step already trained (1 .. the checkpoint's step) is bit for bit
    the one the checkpoint was trained with (`first_lr_change`): the change only affects later steps;
  * a changed `train.total_steps` reads nowhere else: not by an objective that scales with t/T
    (`TOTAL_STEPS_OBJECTIVES`: CAPT's adaptive temperature and queue start), nor by `phases`
    (fraction-sized phases) or `data.sources` (token budgets planned over the run's samples).

Anything else is refused as before, with the reason in the error. The checkpoint's own config
(`pipeline_meta.json`, `RunMeta.config["optim"]`) records the schedule it was trained under.
"""
from __future__ import annotations

from typing import Any, Optional

from pipeline.config.loader import from_dict
from pipeline.train.run_config import resume_relevant
from pipeline.train.optim import SCHEDULE_FIELDS, OptimConfig, first_lr_change, lr_at

#: objectives whose computation reads `train.total_steps` (t/T): a new total changes their past
TOTAL_STEPS_OBJECTIVES = ("capt",)


def schedule_branch(old: dict[str, Any], new: dict[str, Any], step: int) -> tuple[bool, str]:
    """(accepted, reason) for resuming step `step` of a run configured as `old` (the checkpoint's
    config dict) under `new`: accepted when only the LR schedule after `step` differs (see the module
    docstring); otherwise the reason names what stops it ("" when the change is not a schedule change)."""
    a, b = resume_relevant(old), resume_relevant(new)
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    allowed = {f"optim.{f}" for f in SCHEDULE_FIELDS} | {"train.total_steps"}
    if not changed or any(k not in allowed for k in changed):
        return False, ""
    if "train.total_steps" in changed:
        readers = [f"objectives.{o}" for o, w in (new.get("objectives") or {}).items()
                   if o in TOTAL_STEPS_OBJECTIVES and float(w) != 0]
        readers += ["phases"] if b.get("phases") else []
        # a weight-only mixture's interleave is per block, whatever the run's length; a token budget is a
        # share of train.total_steps x global batch, so a new total moves it
        readers += ["data.sources token budgets"] if any(
            isinstance(src, dict) and src.get("tokens") is not None for src in b.get("data.sources") or []) else []
        if readers:
            return False, (f"train.total_steps also shapes {', '.join(readers)}, so a new total changes more than the "
                           "LR after the checkpoint")
    if new.get("phases"):
        return False, "a run with phases keeps its per-phase schedule: branch a decay in a phase's optim segment"
    old_optim: OptimConfig = from_dict(OptimConfig, dict(old.get("optim") or {}), "optim")
    new_optim: OptimConfig = from_dict(OptimConfig, dict(new.get("optim") or {}), "optim")
    old_total, new_total = int(a.get("train.total_steps", 0)), int(b.get("train.total_steps", 0))
    first: Optional[int] = first_lr_change(old_optim, old_total, new_optim, new_total, step)
    if first is not None:
        return False, (f"the new schedule changes the learning rate of step {first}, already trained "
                       f"({lr_at(first, old_optim, old_total):.6e} -> {lr_at(first, new_optim, new_total):.6e}); "
                       f"a decay can branch only from a checkpoint before it starts (step <= the new decay start)")
    return True, ""
