"""Training phases (`phases:`) and the batch-size warm-up (`data.batch_warmup`): planning a run's steps.

Every run walks a `Schedule` of phases: a run without `phases` is a run with one implicit phase
(named "", the run's own data, seed, batch and LR schedule), so the loop has one path. What a
`phases` entry may say and its stage-1 checks are the config's (`pipeline.train.phases.config`); this
module plans the phases against their shards (steps, batch splits, one tokenizer, positions) and
answers, before every step, what the run must change (`Schedule.at` -> a `PhaseView`, or None);
`pipeline.train.loop.Run.apply_phase` applies it to the live run.

Data of a phase: its own stream (`pipeline.data.reader`) from its first sample, position p of the
phase = consumed samples of the run - samples consumed before the phase (`TrainState.phase_start_samples`);
phase 0 uses `train.seed`, phase k > 0 the seed `phase_seed(train.seed, k)` for its data order,
masking, objective sampling and dropout (so phase 2 does not replay phase 1's random streams on
other rows). The walk is a pure function of (step, consumed samples): a resume lands in the right
phase at the right sample in O(1), also from a checkpoint written at a phase boundary.

Batch warm-up `data.batch_warmup: {start_global_batch_size: S, tokens: N}` (ModernBERT, Warner et al.
2024; GPT-3, Brown et al. 2020): the global batch of a step that begins after c consumed samples
(t = c x seq_len token positions, phase 0) is

    G(t) = q x clamp(floor((S + (G - S) x t / N) / q), S / q, G / q),   q = micro x world

i.e. gradient-accumulation steps ramp; the micro-batch and the sample stream stay the same, so the
warm-up sees the samples of the run without it, in the same order, grouped into smaller steps. It
applies to the first phase (a phased run's warm-up must end inside it). A step is still one
optimizer step (`train.total_steps` and the LR schedule count steps, not samples).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Optional

from pipeline.config.checks import ConfigError
from pipeline.train.phases.config import check_step_sum, phase_data, phase_label, phase_optim, phase_steps_without_data
from pipeline.data.config import BatchPlan, BatchRamp, DataConfig, plan_batches, plan_ramp
from pipeline.data.shards import Manifest, read_manifest
from pipeline.data.sources import data_directories
from pipeline.train.optim import OptimConfig, lr_at

#: `pipeline.train.run_config.RunConfig` (not imported: the config module imports this one)
RunConfig = Any


def phase_seed(seed: int, index: int) -> int:
    """Seed of phase `index`: `seed` itself for phase 0 (a one-phase run is the run without phases),
    else a 63-bit blake2b hash of (seed, index)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"phase:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class Phase:
    """One resolved phase: where it starts, its data, batch split, seed and overrides."""

    index: int
    name: str
    start_step: int  # steps before this phase; the phase trains steps start_step+1 .. start_step+steps
    steps: int
    data: DataConfig
    batch: BatchPlan
    manifest: Manifest
    manifest_hash: str
    seed: int
    model: dict
    optim: Optional[OptimConfig]
    ramp: Optional[BatchRamp] = None

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps

    @property
    def samples(self) -> int:
        """The samples its data is planned over (token budgets, `on_exhausted: stop`): steps x global batch."""
        return self.steps * self.batch.global_batch_size


@dataclass(frozen=True)
class PhaseView:
    """What the run changes before a step (`Schedule.at`): the phase of the step and its batch split.
    `entered`: the phase starts at this step (its data, seed and live-model overrides; its first
    sample is the run's `start_samples`-th); otherwise only the batch split changed (warm-up)."""

    phase: Phase
    entered: bool
    batch: BatchPlan
    start_samples: int


class Schedule:
    """A run's phases (one implicit phase named "" for a run without `phases`) and the step ->
    (phase, batch plan, learning rate) arithmetic asked before every step."""

    def __init__(self, phases: list[Phase], total_steps: int, root: RunConfig) -> None:
        self.phases, self.total_steps = phases, total_steps
        self.root = root  # the run's config as loaded (a phase's view: `run_config`)
        self._corpus: Optional[dict[str, Any]] = None

    @classmethod
    def implicit(cls, cfg: RunConfig, batch: BatchPlan, manifest: Manifest, manifest_hash: str,
                 ramp: Optional[BatchRamp] = None) -> "Schedule":
        """The one phase of a run without `phases`: its data, batch, seed and schedule are the run's."""
        phase = Phase(0, "", 0, cfg.train.total_steps, cfg.data, batch, manifest, manifest_hash, cfg.train.seed, {},
                      None, ramp)
        return cls([phase], cfg.train.total_steps, cfg)

    @property
    def phased(self) -> bool:
        return bool(self.phases[0].name)

    def phase_at(self, step: int) -> Phase:
        """The phase that trains optimizer step `step` (1-based; step 0 and below: the first)."""
        for phase in self.phases:
            if step <= phase.end_step:
                return phase
        return self.phases[-1]

    def batch_at(self, phase: Phase, phase_consumed: int) -> BatchPlan:
        """The batch split of the step that starts after `phase_consumed` samples of `phase`."""
        return phase.ramp.plan_at(phase_consumed) if phase.ramp is not None else phase.batch

    def lr_at(self, step: int, optim: OptimConfig) -> float:
        """The run's schedule over `train.total_steps`, or the phase's own segment over its steps."""
        phase = self.phase_at(step)
        if phase.optim is None:
            return lr_at(step, optim, self.total_steps)
        return lr_at(step - phase.start_step, phase.optim, phase.steps)

    def at(self, step: int, state: Any, batch: BatchPlan) -> Optional[PhaseView]:
        """What changes before step `step`, given the train state after the step before (`state`:
        its phase, consumed samples, the phase's first sample) and the current batch split `batch`:
        a new phase (its first sample: the run's consumed samples), a new batch split (warm-up), or
        nothing (None). A pure function of its arguments: a resume lands in the right phase at the
        right sample, also from a checkpoint written at a phase boundary."""
        phase = self.phase_at(step)
        entered = state.phase != phase.name
        if entered and state.phase and state.phase not in [p.name for p in self.phases]:
            raise ConfigError(f"the checkpoint at step {state.step} is in phase {state.phase!r}, which this run's "
                              f"phases ({[p.name for p in self.phases]}) do not have")
        start = state.consumed_samples if entered else state.phase_start_samples
        split = self.batch_at(phase, state.consumed_samples - start)
        if not entered and split == batch:
            return None
        return PhaseView(phase, entered, split, start)

    def run_config(self, phase: Phase) -> RunConfig:
        """The run's config as phase `phase` runs it: its data and seed (the loop's and the reader's
        view); the run's own config for the implicit phase."""
        if not phase.name:
            return self.root
        out = copy.deepcopy(self.root)
        out.data, out.train.seed = copy.deepcopy(phase.data), phase.seed
        return out

    def data_identity(self, resume_dir: Any, data_hash: str, data_dir: str) -> tuple[str, str]:
        """(manifest hash, shards directory) of the phase a checkpoint was written in (the phase of its
        step), to compare with its recorded data; the given ones for a run without phases, or where its
        meta is unreadable (`plan_resume` then says so)."""
        from pipeline.train.run_meta import RunMeta

        if not self.phased:
            return data_hash, data_dir
        try:
            phase = self.phase_at(RunMeta.read(resume_dir).step)
        except (FileNotFoundError, ValueError, TypeError):
            return data_hash, data_dir
        return phase.manifest_hash, phase.data.shards_dir

    def start_view(self, plan: Any, resume_step: int) -> tuple[RunConfig, Any]:
        """(config, plan) that the run is built with: those of the phase of step `resume_step` + 1."""
        phase = self.phase_at(resume_step + 1)
        return self.run_config(phase), dataclasses.replace(plan, batch=phase.batch, manifest=phase.manifest,
                                                           manifest_hash=phase.manifest_hash,
                                                           data_samples=phase.samples if self.phased else None)

    def corpus(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The model card's corpus (`RunMeta.corpus`): `summary` (the run's data, `corpus_summary`) for
        a run without phases; for a phased run every phase's source files (once each), the last
        phase's seq_len, the shards' totals summed, and per phase its name, steps, seq_len and
        `corpus_summary`."""
        from pipeline.train.run_meta import corpus_summary

        if not self.phased:
            return summary
        if self._corpus is None:
            summaries = [corpus_summary(p.manifest) for p in self.phases]
            files = {json_key(f): f for summary in summaries for f in summary["files"]}
            self._corpus = {**summaries[-1], "files": list(files.values()),
                            "sequences": sum(s["sequences"] for s in summaries),
                            "tokens": sum(s["tokens"] for s in summaries),
                            "phases": [{"name": p.name, "steps": p.steps, **s} for p, s in zip(self.phases, summaries)]}
        return self._corpus

    def metrics(self, step: int, batch: BatchPlan) -> dict[str, int]:
        """Logged with every step of a run whose batch can change (phases, warm-up): the phase index
        (phased runs) and the step's global batch; nothing for a run without either."""
        out = {}
        if self.phased or any(p.ramp is not None for p in self.phases):
            out["global_batch_size"] = batch.global_batch_size
        if self.phased:
            out["phase"] = self.phase_at(step).index
        return out


def plan_schedule(cfg: RunConfig, world_size: int) -> Optional[Schedule]:
    """Stage 2 of `phases` / `data.batch_warmup` (before any model is built): every phase's batch
    split and shards, one tokenizer, seq_len within the model's positions, tokens -> steps, the step
    sum, the warm-up ramp. None for a run with neither: its one implicit phase is made from its
    checked plan (`Schedule.implicit`, by `pipeline.train.run_config.check_run`)."""
    if not cfg.phases:
        if not cfg.data.batch_warmup:
            return None
        batch = plan_batches(cfg.data, world_size)
        manifest, data_hash = cfg.data.check_shards(batch)
        ramp = plan_ramp(cfg.data, batch, manifest.seq_len, "data.batch_warmup")
        if (needs := tokens_to_steps(ramp.tokens, ramp.seq_len, batch, ramp)) > cfg.train.total_steps:  # as a phase's
            raise ConfigError(f"data.batch_warmup.tokens={ramp.tokens}: the warm-up does not end inside the run "
                              f"({needs} steps > train.total_steps={cfg.train.total_steps}); shorten it or lengthen "
                              "the run")
        return Schedule.implicit(cfg, batch, manifest, data_hash, ramp)
    phases, start = [], 0
    fixed = phase_steps_without_data(cfg) if all(r.get("tokens") is None for r in cfg.phases) else None
    for i, raw in enumerate(cfg.phases):
        where, data, seed = phase_label(i, raw), phase_data(cfg, i), phase_seed(cfg.train.seed, i)
        try:
            batch = plan_batches(data, world_size)
            ramp = None
            if i == 0 and data.batch_warmup:  # (a ramp needs only the shards' seq_len; they are checked below)
                ramp = plan_ramp(data, batch, shards_seq_len(data, batch), f"{where}: data.batch_warmup")
            if fixed is not None:
                steps = fixed[i]
            elif raw.get("steps") is not None:
                steps = raw["steps"]
            elif raw.get("fraction") is not None:
                steps = int(math.floor(raw["fraction"] * cfg.train.total_steps))
            else:
                steps = tokens_to_steps(raw["tokens"], shards_seq_len(data, batch), batch, ramp)
            # the phase's data over the phase's own length and seed (its stream starts at its first
            # step): token budgets of its sources and `on_exhausted: stop` are checked against it
            manifest, data_hash = data.check_shards(batch, max(steps, 1), seed, f"phases.{i}.steps", start)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from err
        phases.append(Phase(i, str(raw.get("name") or f"phase{i}"), start, steps, data, batch, manifest, data_hash,
                            seed, dict(raw.get("model") or {}), phase_optim(cfg, i), ramp))
        start += steps
    check_step_sum(cfg, [p.steps for p in phases])
    for phase in phases:  # a schedule segment fits its phase (warm-up, decay window)
        check_steps = getattr(phase.optim, "check_steps", None)
        if check_steps is not None:
            try:
                check_steps(phase.steps, f"{phase_label(phase.index, cfg.phases[phase.index])} steps")
            except ConfigError as err:
                raise ConfigError(f"{phase_label(phase.index, cfg.phases[phase.index])}.optim: {err}") from err
    first = phases[0].manifest
    for phase in phases[1:]:
        m, where = phase.manifest, phase_label(phase.index, cfg.phases[phase.index])
        if (m.tokenizer_hash, m.vocab_size, dict(m.special_tokens)) != (first.tokenizer_hash, first.vocab_size,
                                                                         dict(first.special_tokens)):
            raise ConfigError(f"{where}.shards_dir={phase.data.shards_dir or phase.data.sources}: built with another "
                              f"tokenizer than the model's (phase 0's {phases[0].data.shards_dir or 'data'}: tokenizer "
                              f"hash {m.tokenizer_hash[:12]} vs {first.tokenizer_hash[:12]}, vocabulary {m.vocab_size} "
                              f"vs {first.vocab_size}); build every phase's shards with one tokenizer")
    longest = max(p.manifest.seq_len for p in phases)
    limit = cfg.model.max_position
    for phase in phases:
        if limit is not None and phase.manifest.seq_len > limit:
            where = phase_label(phase.index, cfg.phases[phase.index])
            raise ConfigError(f"{where}.seq_len={phase.manifest.seq_len} exceeds "
                              f"model.max_position={limit}: the model has no positions beyond {limit}; raise "
                              "model.max_position or leave it unset (the longest phase's seq_len)")
    first_phase = phases[0]
    if first_phase.ramp is not None and tokens_to_steps(first_phase.ramp.tokens, first_phase.ramp.seq_len,
                                                        first_phase.batch, first_phase.ramp) > first_phase.steps:
        raise ConfigError(f"data.batch_warmup.tokens={first_phase.ramp.tokens}: the warm-up does not end inside "
                          f"phase {first_phase.name!r} ({first_phase.steps} steps); shorten it or lengthen the phase")
    cfg.model.max_position = limit or longest  # one position table for the whole run, built at the start
    return Schedule(phases, cfg.train.total_steps, cfg)


def shards_seq_len(data: DataConfig, batch: BatchPlan) -> int:
    """The seq_len of a phase's shards (its first directory's manifest), before its data is checked
    whole (a token-sized phase needs it for its length); a bad directory: `check_shards`'s error."""
    try:
        return read_manifest(data_directories(data)[0]).seq_len
    except (OSError, ValueError):
        data.check_shards(batch)  # names the field and the problem
        raise


def json_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def tokens_to_steps(tokens: int, seq_len: int, batch: BatchPlan, ramp: Optional[BatchRamp]) -> int:
    """Steps that consume `tokens` token positions (sequences x seq_len), the last one completing it."""
    if ramp is None:
        return max(1, -(-tokens // (batch.global_batch_size * seq_len)))
    consumed, steps = 0, 0
    while consumed * seq_len < tokens:
        consumed += ramp.plan_at(consumed).global_batch_size
        steps += 1
    return max(1, steps)
