"""`RunConfig`: one run, composed of the sections each component owns, and its two validation stages.

    python -m pipeline.train --config PRESET_OR_YAML [section.key=value ...]

| section               | owned by                         | what it describes                         |
| --------------------- | -------------------------------- | ----------------------------------------- |
| `model`               | `pipeline.model.config`          | encoder shape, dropout, kernel switches   |
| `objectives`, `objective_options` | `pipeline.objectives.base` | loss weights and each objective's options |
| `data`                | `pipeline.data.config`           | shards, batch split, corruption options   |
| `optim`               | `pipeline.train.optim`           | optimizer and learning-rate schedule      |
| `deepspeed`           | `pipeline.train.engine`          | engine file, precision                    |
| `train`               | `pipeline.train.config`          | length, seed, output, checkpoints, guards |
| `eval`                | `pipeline.train.eval_config`           | held-out set, how often, how much         |

Validation happens in two stages, both before any model is built:
  `load_config` -> `check`   each section's own `check()` (types, enums, ranges, option names)
                              plus the few rules that span sections;
  `check_run`                 what needs the launch environment: the batch split for this world
                              size, the shard directory, the engine file, the ZeRO stage against
                              the objectives, and the switches this machine must support.
Loading itself (presets, inheritance, overrides, typed construction) is `pipeline.config.loader`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from pipeline.config.checks import ConfigError
from pipeline.config.loader import apply_override, describe_config, from_dict, load_raw
from pipeline.train.phases.config import check_phases
from pipeline.data.config import BatchPlan, DataConfig, plan_batches
from pipeline.data.shards import Manifest
from pipeline.data.sources import data_directories
from pipeline.train.eval_config import EvalConfig, check_eval_set, check_keep_best
from pipeline.model.config import ModelConfig
from pipeline.objectives.registry import check_objectives, check_objectives_under_stage, mlm_head_beside_electra
from pipeline.train.config import TrainConfig
from pipeline.train.engine import DeepSpeedConfig, zero_stage_of
from pipeline.train.optim import OptimConfig, warn_ineffective_decay
from pipeline.train.phases.schedule import Schedule, plan_schedule

__all__ = ["ConfigError", "RunConfig", "RunPlan", "load_config", "check_run", "describe_run_config"]

log = logging.getLogger(__name__)


@dataclass
class RunConfig:
    name: str = "run"
    """Run name (the preset's name by default)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    objectives: dict = field(default_factory=lambda: {"mlm": 1.0})
    """Objective name -> loss weight; the total loss is the weighted sum."""
    objective_options: dict = field(default_factory=dict)
    """Objective name -> keyword options of its constructor (see each objective's docstring)."""
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    phases: list = field(default_factory=list)
    """Training phases walked in order by one run (each `{name, steps | tokens | fraction, shards_dir, seq_len,
    micro_batch_size, global_batch_size, model: {global_rope_theta, ...}, optim: {schedule segment}}`; the steps
    sum to `train.total_steps`): `pipeline.train.phases.config` (checks), `pipeline.train.phases.schedule` (planning). Empty: one
    implicit phase, the run's `data.*`."""

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))

    def check(self) -> None:
        """Stage 1: every section's own checks, then the rules that span sections."""
        self.model.check()
        check_objectives(self.objectives, self.objective_options)
        self.data.check()
        self.optim.check()
        self.deepspeed.check()
        self.train.check()
        self.eval.check(self.train.total_steps)
        check_keep_best(self.train.keep_best, self.train.keep_best_mode, self.objectives, self.eval)
        if self.phases:
            check_phases(self)
        if self.objectives and not any(float(w) != 0 for w in self.objectives.values()):
            raise ConfigError(f"objectives: every weight is 0 ({dict(self.objectives)}): the run would train nothing "
                              "(loss 0, unchanged weights); give at least one objective a non-zero weight")
        self.optim.check_steps(self.train.total_steps)  # warm-up and the WSD decay fit the run


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def describe_run_config() -> str:
    """Every field with its default and docstring (`--help-config`)."""
    return describe_config(RunConfig)


def load_config(name_or_path: str, overrides: Sequence[str] = ()) -> RunConfig:
    """Preset/YAML + dotted overrides -> validated `RunConfig` (stage-1 checks; no filesystem)."""
    raw = load_raw(name_or_path, RunConfig)
    for override in overrides:
        apply_override(raw, override, RunConfig)
    cfg = from_dict(RunConfig, raw)
    cfg.check()
    return cfg


@dataclass
class RunPlan:
    """Everything `check_run` derived: the batch split, the engine settings, the data identity."""

    batch: BatchPlan
    engine: dict
    zero_stage: int
    manifest: Manifest
    manifest_hash: str
    schedule: Optional[Schedule] = None  # the run's phases (`pipeline.train.phases.schedule`); `check_run` always sets it
    eval_manifest: Optional[Manifest] = None  # the held-out set's (`eval.shards_dir`); None: no validation
    data_samples: Optional[int] = None  # samples the data is planned over (a phase's; None: the run's, total x batch)


def check_run(cfg: RunConfig, world_size: int, cuda_available: bool, fresh_start: bool = True) -> RunPlan:
    """Stage 2 (before any model is built): batch split, shards, engine, device switches, and the
    warm-start directory (`model.init_from`; its weights only for a fresh start, `fresh_start`).
    With `phases`, every phase's data is checked and the plan is phase 0's; without, the plan's
    schedule is the run's one implicit phase (`Schedule.implicit`)."""
    schedule = plan_schedule(cfg, world_size)
    if schedule is not None and schedule.phased:  # phase 0's data over phase 0's own length
        first = schedule.phases[0]
        plan = _check_run(schedule.run_config(first), world_size, cuda_available, fresh_start, schedule, first.steps)
        plan.data_samples = first.samples
        phases = [(f"phases[{i}] ({p.name})", p.manifest.seq_len) for i, p in enumerate(schedule.phases)]
    else:
        plan, phases = _check_run(cfg, world_size, cuda_available, fresh_start, schedule), []
    if plan.schedule is None:
        plan.schedule = Schedule.implicit(cfg, plan.batch, plan.manifest, plan.manifest_hash)
    train_dirs = [*data_directories(cfg.data), *(d for p in plan.schedule.phases for d in data_directories(p.data))]
    plan.eval_manifest = check_eval_set(cfg.eval, plan.manifest, data_directories(cfg.data)[0], phases, world_size,
                                        cfg.data.micro_batch_size, train_dirs)
    return plan


def _check_run(cfg: RunConfig, world_size: int, cuda_available: bool, fresh_start: bool,
               schedule: Optional[Schedule], steps: Optional[int] = None) -> RunPlan:
    batch = plan_batches(cfg.data, world_size)
    if steps is None:
        manifest, data_hash = cfg.data.check_shards(batch, cfg.train.total_steps, cfg.train.seed)
    else:  # phase 0 (`plan_schedule` named a problem of its data with the phase already)
        manifest, data_hash = cfg.data.check_shards(batch, steps, cfg.train.seed, "phases.0.steps")
    cfg.model.encoder_config(manifest.vocab_size, manifest.seq_len, manifest.special_tokens)  # shape fits the data
    cfg.model.check_init_from(manifest, data_directories(cfg.data)[0], fresh_start)  # a mixture: one tokenizer
    engine = cfg.deepspeed.load_engine(cuda_available)
    stage = zero_stage_of(engine)
    check_objectives_under_stage(cfg.objectives, stage, cfg.deepspeed.stage_source())
    cfg.model.check_device(cuda_available)
    cfg.optim.check_device(cuda_available)
    warn_ineffective_decay(cfg.optim)  # a decay too small for float32 (pipeline.train.optim)
    warn_unconvertible(cfg.objectives)
    return RunPlan(batch, engine, stage, manifest, data_hash, schedule)


def unconvertible_warning(objectives: dict[str, float]) -> Optional[str]:
    """The line training starts with when its checkpoints will not convert: an MLM head trained beside
    `electra` (`mlm_head_beside_electra`; `cpt-convert` refuses it). A valid multi-task run, so a warning
    before compute rather than a refusal: the user learns it now, not after the GPU-hours."""
    trained = mlm_head_beside_electra(objectives)
    if not trained:
        return None
    return (f"objectives: electra with {trained}, which train the MLM head: an ELECTRA export "
            "(ElectraForPreTraining) has no place for that head, so cpt-convert will refuse this run's checkpoints; "
            "train electra alone or beside objectives that do not use the MLM head (e.g. taco), or set the "
            f"weight of {trained} to 0")


def warn_unconvertible(objectives: dict[str, float]) -> None:
    """Log `unconvertible_warning`, if any (once per run, before compute: `check_run`)."""
    if (message := unconvertible_warning(objectives)) is not None:
        log.warning("%s", message)


# --------------------------------------------------------------------------------------------
# Identity of a config for resume checks
# --------------------------------------------------------------------------------------------
#: Fields that do not change what a step computes, so resuming with a different value is not a
#: "config change": run control and I/O, `data.grad_accum` (derived from the rank count; the global
#: batch is what matters, and it is checked), the shard path (the manifest hash identifies the
#: data). NOT here: `train.total_steps` (it shapes the LR decay and CAPT's temperature) and
#: `data.micro_batch_size`: the objectives draw their samples per micro-batch (the sampling stream
#: is keyed by its first sample index), take negatives from it, and average the loss over it, so a
#: new micro-batch size continues on another trajectory. Both need `train.allow_config_change=true`.
RESUME_IGNORED_FIELDS = (
    "name",
    "data.shards_dir",
    "data.grad_accum",
    "data.num_workers",
    "data.verify_shards",
    "train.output_dir",
    "train.log_every",
    "train.checkpoint_every",
    "train.keep_last",
    "train.keep_best",
    "train.keep_best_mode",
    "train.resume",
    "train.allow_config_change",
    "train.max_nonfinite_steps",
    "train.max_loss_ratio",
    "train.max_weight_norm_ratio",
    "train.deterministic",
    "model.activation_checkpointing",  # recomputes the same activations (same gradients): memory, not trajectory
    "train.profile",  # observes steps (pipeline.train.profiler), changes none
    "deepspeed.tf32",
    "train.dist_timeout_s",
    "train.progress_bar",
    "train.tensorboard",
    "train.trackers",  # where metrics go (pipeline.train.trackers): not the trajectory
    "train.tracker_project",
    "train.tracker_run_name",
    "train.tracker_tags",
    "train.mlflow_tracking_uri",
    "eval.shards_dir",  # validation reads the model, never changes a step (pipeline.train.validation)
    "eval.every",
    "eval.batches",
    "eval.micro_batch_size",
    "eval.seed",
)
_SECTIONS = {f.name for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(f.default_factory)}  # type: ignore[arg-type]


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path in _SECTIONS:
            flat.update(_flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat


def resume_relevant(config_dict: dict) -> dict[str, Any]:
    """Flat `section.field -> value` without `RESUME_IGNORED_FIELDS` (nor a phase's `shards_dir`: as
    `data.shards_dir`, its manifest hash identifies the data)."""
    flat = {k: v for k, v in _flatten(config_dict).items() if k not in RESUME_IGNORED_FIELDS}
    if isinstance(flat.get("phases"), list):
        flat["phases"] = [{k: v for k, v in p.items() if k != "shards_dir"} if isinstance(p, dict) else p
                          for p in flat["phases"]]
    return flat


def describe_recipe(name_or_path: str, cfg: RunConfig) -> dict[str, Any]:
    """The preset a run started from and every field the run sets differently (command-line
    overrides), `{"preset": name, "overrides": {field: {"preset": value, "run": value}}}`, for the
    model card. The preset is read as written (no checks: an override may be what makes it valid)."""
    preset = from_dict(RunConfig, load_raw(name_or_path, RunConfig))
    a, b = _flatten(preset.to_dict()), _flatten(cfg.to_dict())
    overrides = {k: {"preset": a.get(k), "run": b.get(k)} for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    name = Path(name_or_path).stem if name_or_path.endswith((".yaml", ".yml")) else name_or_path
    return {"preset": name, "overrides": overrides}


def config_hash(config_dict: dict) -> str:
    """sha256 of the resume-relevant fields (stable JSON)."""
    blob = json.dumps(resume_relevant(config_dict), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def config_differences(old: dict, new: dict) -> list[str]:
    """Human-readable `field: old -> new` lines for resume-relevant fields that differ."""
    a, b = resume_relevant(old), resume_relevant(new)
    return [f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]
