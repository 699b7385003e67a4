"""What a resume may change in a run's phases and in the mixture it is reading (`Checkpointer.plan_resume`).

A checkpoint at step S records the phases it was trained under (`RunMeta.config["phases"]`, each
phase's resolved steps in `RunMeta.corpus["phases"]`). A resume may reshape what comes after S, and
nothing before it; the rule, for every phase that trained at least one step (start < S):

  * it keeps its place and name: phases[i] is the same phase (its data seed is `phase_seed(seed, i)`,
    checkpoints name it), starting at the same step;
  * a phase that ended before S (end < S) keeps its length; the phase S is in or ends at may end
    anywhere at or after S (lengthened, shortened down to S, a boundary moved later);
  * a phase that trains nothing after S keeps every field but `shards_dir` (data moved is no
    change; its manifest is the data identity): its steps are history; one that goes on after S may
    change its fields from S + 1 on (logged);
  * its own LR segment (`phases[i].optim`) must give every trained step of it the rate it was
    trained with, whatever its new length.

Phases that start at or after S may change freely; such a change is logged and recorded as the
run's plan (the checkpoint's config and the model card's corpus then say what was trained, since
the steps before S are as they were). Adding phases to a run trained without them, or removing them
from one trained with them, rewrites the trained steps' phase and is refused. These refusals hold
under `train.allow_config_change=true` too: that flag resumes changed settings, it cannot make a
trained step have been trained otherwise. To move a boundary before S, resume from a checkpoint at
or before the new boundary (`train.resume=<tag>`), or start a new run.

The mixture the resumed reader continues (the run's `data.sources`, or that of the checkpoint's
phase when the next step is in it) may change its shares on resume: the checkpoint records where
each source stands (`RunMeta.mixture`) and the reader goes on from there with the new shares
(`pipeline.data.mixture.MixtureDataset.continue_stream`: no row skipped or read twice, exact
counters). Refused, naming the field, also with `train.allow_config_change=true`: a source moved to
another index (its pass order is drawn from its index), and any change of the interleave from a
checkpoint written before the record existed (`pipeline.data.sources.interleave_change`). A source's
changed contents stay `train.allow_config_change`'s business.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from pipeline.config.checks import ConfigError
from pipeline.config.loader import from_dict
from pipeline.train.phases.config import LENGTH_KEYS, phase_data, phase_label, phase_optim, phase_steps_without_data
from pipeline.data.sources import interleave_change
from pipeline.train.optim import first_lr_change

log = logging.getLogger("pipeline.train")

#: A phase's keys that are not its history: its length (checked as steps), its name, where its data lies.
_NOT_HISTORY = (*LENGTH_KEYS, "name", "shards_dir")


def _old_phases(old_cfg: Any, meta: Any) -> Optional[list[tuple[str, int, int]]]:
    """(name, start, steps) of each phase the checkpoint was trained under; one implicit phase ("")
    for a run without phases; None when the record does not tell (a token-sized phase without a
    recorded corpus)."""
    raws = old_cfg.phases or []
    if not raws:
        return [("", 0, int(old_cfg.train.total_steps))]
    recorded = (meta.corpus or {}).get("phases")
    if isinstance(recorded, list) and len(recorded) == len(raws):
        steps = [int(p["steps"]) for p in recorded]
    elif all(raw.get("tokens") is None for raw in raws):
        steps = phase_steps_without_data(old_cfg)
    else:
        return None
    out, start = [], 0
    for i, (raw, n) in enumerate(zip(raws, steps)):
        out.append((str(raw.get("name") or f"phase{i}"), start, n))
        start += n
    return out


def _length_field(i: int, raw: dict) -> str:
    key = next((k for k in LENGTH_KEYS if raw.get(k) is not None), "steps")
    return f"phases.{i}.{key}"


def check_resume(schedule: Any, meta: Any) -> None:
    """Refuse (a `ConfigError`) a resume of checkpoint `meta` (its step, config, corpus) under
    `schedule` (the resumed run's planned phases; `schedule.root`: its config) that rewrites trained
    phases or re-places the positions its reader has read (the module doc); log what it reshapes
    after. A checkpoint beyond the run's end is `plan_resume`'s to refuse."""
    step, new_cfg = int(meta.step), schedule.root
    if step <= 0 or step > schedule.total_steps or not meta.config:
        return
    try:
        # read as the run's own config class (`RunConfig`, which imports the phases: not imported here)
        old_cfg = from_dict(type(new_cfg), meta.config)
    except (ConfigError, TypeError, ValueError):
        return  # an older checkpoint's config: plan_resume's comparison speaks for it
    old = _old_phases(old_cfg, meta)
    if old is None:
        return
    new_raws = new_cfg.phases or []
    new = [(p.name, p.start_step, p.steps) for p in schedule.phases]
    if bool(old_cfg.phases) != bool(new_raws):
        if old_cfg.phases:
            raise ConfigError(f"phases: the checkpoint at step {step} was trained in phase(s) "
                              f"{[n for n, s, _ in old if s < step]}; resuming it without phases would rewrite them "
                              "(a run keeps its phases: change only those after the checkpoint)")
        raise ConfigError(f"phases: the checkpoint at step {step} was trained without phases; adding them on resume "
                          "would re-assign the steps already trained to a phase (and restart its data): start a new "
                          "run with phases, warm-started from this one (model.init_from)")
    reshaped = []
    for i, (name, start, steps) in enumerate(old if new_raws else []):  # (no phases: the length is the total's)
        if start >= step:
            break
        end = start + steps
        if i >= len(new) or new[i][0] != name:
            got = repr(new[i][0]) if i < len(new) else "no phase"
            raise ConfigError(f"phases[{i}].name: the checkpoint at step {step} trained phase {name!r} here (steps "
                              f"{start + 1}-{min(end, step)}); this run has {got}: a trained phase keeps its place and "
                              "name")
        new_steps = new[i][2]
        old_raw, new_raw = old_cfg.phases[i], new_raws[i]
        where = phase_label(i, new_raw)
        new_end, trained = start + new_steps, min(end, step) - start
        # a phase ended before the checkpoint keeps its length; the one the checkpoint is in (or ends
        # at) may end at any step from the checkpoint's on
        if new_end != end if end < step else new_end < step:
            raise ConfigError(
                f"{where}: {_length_field(i, new_raw)} gives it {new_steps} steps (steps {start + 1}-{new_end}), but the "
                f"checkpoint at step {step} trained it for steps {start + 1}-{start + trained} ({steps} planned): that "
                f"would rewrite steps already trained. A resume reshapes only steps after {step}; to move the boundary "
                f"to step {new_end}, resume from a checkpoint at or before it (train.resume=<tag>), or start a new run")
        for key in sorted((set(old_raw) | set(new_raw)) - set(_NOT_HISTORY)):
            if old_raw.get(key) == new_raw.get(key):
                continue
            if new_end <= step:  # the phase trains nothing after the checkpoint: all of it is history
                raise ConfigError(f"{where}.{key}: {old_raw.get(key)!r} -> {new_raw.get(key)!r}, but the phase was "
                                  f"trained to its end (steps {start + 1}-{new_end}) by the checkpoint at step {step}: "
                                  "a trained phase's fields are history")
            if key not in ("optim", "sources"):  # (its LR segment: below; its mixture: `_check_mixture`)
                reshaped.append(f"{where}.{key} from step {step + 1}")
        if new_steps != steps or old_raw.get("optim") != new_raw.get("optim"):  # its own LR segment, trained steps
            old_optim, new_optim = phase_optim(old_cfg, i), phase_optim(new_cfg, i)
            if (old_optim is None) != (new_optim is None):
                raise ConfigError(f"{where}.optim: added or removed in the phase the checkpoint at step {step} is in: "
                                  "it would change the learning rate of its trained steps")
            if old_optim is not None:
                first = first_lr_change(old_optim, steps, new_optim, new_steps, trained)
                if first is not None:
                    raise ConfigError(f"{where}: {_length_field(i, new_raw)} / optim change the learning rate of its "
                                      f"step {first} (run step {start + first}), already trained; a resume at step "
                                      f"{step} may change only later steps' rates")
            if new_steps != steps:
                reshaped.append(f"{where} ends at step {new_end} (was {end})")
    later, planned = [p for p in old if p[1] >= step], [p for p in new if p[1] >= step]
    if new_raws and later != planned:
        reshaped.append(f"phases after step {step}: {[(n, k) for n, _, k in later]} -> {[(n, k) for n, _, k in planned]}")
    _check_mixture(schedule, old_cfg, old, new_cfg, step, bool(meta.mixture))
    if reshaped:
        log.info("resuming at step %d with the phases reshaped after it (the steps trained are as they were): %s",
                 step, "; ".join(reshaped))


def _check_mixture(schedule: Any, old_cfg: Any, old: list[tuple[str, int, int]], new_cfg: Any, step: int,
                   recorded: bool) -> None:
    """The mixture the resumed reader continues keeps its interleave (`interleave_change`): the phase
    of the next step, when it trained steps already (its stream goes on; the checks above keep its
    place and name)."""
    phase = schedule.phase_at(step + 1)
    if phase.start_step >= step or phase.index >= len(old):
        return  # the next step starts a phase: its stream starts at its first sample
    current = phase.index
    if schedule.phased:
        old_data, new_data = phase_data(old_cfg, current), phase.data
        where = f"{phase_label(phase.index, new_cfg.phases[phase.index])}: "
    else:
        old_data, new_data, where = old_cfg.data, new_cfg.data, ""
    old_samples = old[current][2] * old_data.global_batch_size
    problem = interleave_change(old_data, old_samples, new_data, phase.samples, continued=recorded)
    if problem and recorded:
        raise ConfigError(f"{where}{problem}, at the resume from step {step}")
    if problem:
        raise ConfigError(
            f"{where}{problem}, at the resume from step {step}: the checkpoint does not record where each source "
            "stands (written before it did), and a mixture's interleave places every position from its first "
            "sample, so the new shares would re-place the positions already read (rows of one source skipped, of "
            "another read again, the per-source counters jumping). Keep the mixture's shares to resume from it "
            "(train.allow_config_change=true does not cover this), or start a new run warm-started from this one "
            "(model.init_from)")
