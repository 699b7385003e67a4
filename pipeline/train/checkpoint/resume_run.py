"""`cpt-train --resume DIR [section.key=value ...]`: continue a run from the configuration it saved.

Every checkpoint tag holds the run's full resolved config (`pipeline_meta.json`, `RunMeta.config`),
so continuing a run needs only its directory: the saved config is the base, the command line's
overrides change it, and the run continues from its latest checkpoint (or the tag named). The
usual use is extending a finished run: `cpt-train --resume runs/x train.total_steps=2000`.

Learning-rate schedule on extension (chosen, and what users of Hugging Face and Megatron expect):
the schedule stays the pure function of the step `lr_at(s, optim, T)` (`pipeline.train.optim`),
evaluated with the NEW total. A run of T steps extended to N continues at step T+1 with
`lr_at(T+1, optim, N)` and decays linearly to `lr * min_lr_ratio` at step N: from step T+1 on it
follows exactly the learning rates of a run planned for N steps from the start. With warm-up W and
`min_lr_ratio` r that is `lr * (r + (1 - r) * (N - T) / (N - W))` at step T+1 — a jump up from the
end of the finished schedule (about `lr * r`), not a stay near zero. Hugging Face Trainer's
`resume_from_checkpoint` with a larger `max_steps` behaves the same (its LambdaLR is rebuilt with the
new `num_training_steps`; the checkpoint restores only the step count), as does Megatron's `--load`
with `--override-opt_param-scheduler` (without it Megatron refuses a changed total, as
`train.total_steps=N` without `--resume` or `train.allow_config_change=true` is refused here).
CAPT's adaptive temperature, a function of t/T, is re-stretched alike. A re-warmed schedule is a new
run: warm-start one from the converted checkpoint (`model.init_from`).

Which changes are accepted: the overrides given are deliberate, so when they change a field that
matters for resuming (`pipeline.train.run_config.config_differences`) the resume is allowed as with
`train.allow_config_change=true`; a model-shape change is still refused (`Checkpointer.check_shapes`).
Changes that were NOT asked for still stop the run: shards rewritten in place since the
checkpoint (a different manifest hash with the same `data.shards_dir`) need an explicit
`train.allow_config_change=true`.
"""
from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from pipeline.config.checks import ConfigError
from pipeline.config.loader import apply_override, from_dict
from pipeline.train.run_config import RunConfig, config_differences, resume_relevant
from pipeline.train.checkpoint.tags import CHECKPOINT_DIR, LATEST_FILE, CheckpointError, note_resume_overrides, read_latest
from pipeline.train.optim import lr_at
from pipeline.train.run_meta import META_FILE, RunMeta

log = logging.getLogger("pipeline.train")


def resolve_run_dir(path: str | Path) -> tuple[Path, Optional[Path]]:
    """(run output directory, explicitly named tag or None) of `--resume DIR`: DIR may be a run's
    output directory (`DIR/checkpoints/latest`), its `checkpoints/` directory, or one tag."""
    where = Path(path)
    if (where / CHECKPOINT_DIR / LATEST_FILE).is_file():
        return where, None
    if (where / LATEST_FILE).is_file():
        return where.parent, None
    if (where / META_FILE).is_file():
        run_dir = where.parent.parent if where.parent.name == CHECKPOINT_DIR else where.parent
        return run_dir, where
    if not where.exists():
        raise ConfigError(f"--resume {where}: no such directory")
    raise ConfigError(f"--resume {where}: not a run directory (no {CHECKPOINT_DIR}/{LATEST_FILE}), checkpoints "
                      f"directory (no {LATEST_FILE}) or checkpoint tag (no {META_FILE})")


def _meta_of(run_dir: Path, tag: Optional[Path]) -> tuple[Path, RunMeta]:
    tag_dir = tag if tag is not None else read_latest(run_dir / CHECKPOINT_DIR)
    if tag_dir is None:
        raise ConfigError(f"--resume {run_dir}: no checkpoint to resume")
    try:
        return tag_dir, RunMeta.read(tag_dir)
    except (FileNotFoundError, ValueError, TypeError) as err:
        raise CheckpointError(f"--resume: {err}") from err


def load_resumed_config(path: str | Path, overrides: Sequence[str] = ()) -> tuple[RunConfig, dict[str, Any]]:
    """The run's saved config with `overrides` applied, set to resume it: (config, recipe for the
    model card). `train.output_dir` is the run directory found from `path` (so a moved run still
    resumes), `train.resume` the named tag or `auto` (the latest)."""
    run_dir, tag = resolve_run_dir(path)
    tag_dir, meta = _meta_of(run_dir, tag)
    if not meta.config:
        raise CheckpointError(f"{tag_dir / META_FILE}: holds no saved config (written before configs were saved); "
                              "resume with --config PRESET and the run's overrides instead")
    saved = copy.deepcopy(meta.config)
    raw = copy.deepcopy(saved)
    raw.setdefault("train", {})
    raw["train"]["output_dir"] = str(run_dir)
    raw["train"]["resume"] = str(tag) if tag is not None else "auto"
    raw["train"]["allow_config_change"] = False  # a previous --resume saved True: only this command's overrides count
    for override in overrides:
        apply_override(raw, override, RunConfig)
    cfg: RunConfig = from_dict(RunConfig, raw)
    cfg.check()
    changed = config_differences(saved, cfg.to_dict())
    if changed and not cfg.train.allow_config_change:
        check_same_data(cfg, meta, overrides)
        cfg.train.allow_config_change = True  # the differences are exactly what the overrides asked for
        note_resume_overrides(cfg.to_dict())  # so the resume logs them as asked for, not as the user's allowance
    saved_total = int(saved.get("train", {}).get("total_steps", cfg.train.total_steps))
    if cfg.train.total_steps != saved_total:
        log.info("--resume %s: train.total_steps %d -> %d from step %d; the LR schedule is re-stretched to the new "
                 "total: step %d runs at lr %.3e (pipeline.train.checkpoint.resume_run)", tag_dir, saved_total,
                 cfg.train.total_steps, meta.step, meta.step + 1,
                 lr_at(meta.step + 1, cfg.optim, cfg.train.total_steps))
    return cfg, resumed_recipe(meta, saved, cfg.to_dict())


def check_same_data(cfg: RunConfig, meta: RunMeta, overrides: Sequence[str]) -> None:
    """Refuse shards that changed in place since the checkpoint: only an override of
    `data.shards_dir` makes new data deliberate."""
    from pipeline.data.shards import manifest_file_sha256, manifest_hash

    if any(o.split("=", 1)[0].strip() == "data.shards_dir" for o in overrides):
        return
    if cfg.phases:  # the checkpoint's data is its phase's: `plan_resume` compares it (pipeline.train.phases.schedule)
        return
    if cfg.data.sources:  # a mixture (pipeline.data.sources): its sources' manifests and shares
        check_same_mixture(cfg, meta, overrides)
        return
    try:
        current = manifest_hash(cfg.data.shards_dir)
        # checkpoints written before the manifest's content hash recorded the manifest file's sha256
        legacy = manifest_file_sha256(cfg.data.shards_dir)
    except (FileNotFoundError, OSError, ValueError):
        return  # missing or unreadable shards: check_run names the problem before any compute
    if meta.manifest_hash not in (current, legacy):
        raise ConfigError(f"--resume: the shards in data.shards_dir={cfg.data.shards_dir} changed since the checkpoint "
                          f"(manifest {meta.manifest_hash[:12]} -> {current[:12]}); pass train.allow_config_change=true "
                          "to continue on them anyway, or data.shards_dir=PATH of the run's data")


def check_same_mixture(cfg: RunConfig, meta: RunMeta, overrides: Sequence[str]) -> None:
    """Refuse a `data.sources` mixture whose sources changed in place, or whose shares moved without
    being asked: a token budget is a share of `train.total_steps` x global batch, so extending such a
    run moves it (allowed, it applies from the resume step: `MixtureDataset.continue_stream`).
    Overriding `data.sources` is deliberate."""
    from pipeline.data.sources import mixture_identity

    if any(o.split("=", 1)[0].strip() in ("data.sources", "data.mixture_block") for o in overrides):
        return
    try:
        current = mixture_identity(cfg.data, cfg.train.total_steps)
    except (FileNotFoundError, OSError, ValueError):
        return  # missing or unreadable shards, bad entries: check_run names the problem before any compute
    if meta.manifest_hash != current:
        raise ConfigError(f"--resume: the data.sources mixture changed since the checkpoint (data "
                          f"{meta.manifest_hash[:12]} -> {current[:12]}): a source's shards, or its share (a "
                          "data.sources[i].tokens budget is a share of train.total_steps x data.global_batch_size, "
                          "so a new train.total_steps moves it); pass train.allow_config_change=true to continue "
                          "with the new shares from the resume step (each source goes on where it stood), or give "
                          "the sources weights")


def resumed_recipe(meta: RunMeta, saved: dict, now: dict) -> dict[str, Any]:
    """The model card's recipe (`describe_recipe`): the run's saved one, with the resume-relevant
    fields this resume changed (e.g. `train.total_steps`) recorded as overrides of the preset."""
    recipe = copy.deepcopy(meta.recipe) if meta.recipe else {"preset": meta.config.get("name", ""), "overrides": {}}
    fields = recipe.setdefault("overrides", {})
    old, new = resume_relevant(saved), resume_relevant(now)
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            fields[key] = {"preset": fields.get(key, {}).get("preset", old.get(key)), "run": new.get(key)}
    return recipe
