"""Training phases (`phases:`) and the batch-size warm-up (`data.batch_warmup`): one run, several data settings.

A run config may list `phases`, walked in order by one run that continues its weights, optimizer
state and step count (NVIDIA's BERT recipe: ~90% of the steps at L=128, then ~10% at L=512 on
shards of that length, Devlin et al. 2019 / NVIDIA DeepLearningExamples; ModernBERT's context
extension: 1024 -> 8192 tokens with a new global rotary base, Warner et al. 2024). Each entry:

| key | meaning |
| --- | --- |
| `name` | the phase's name (default `phase<i>`); every checkpoint records it (`TrainState.phase`) |
| `steps` / `tokens` / `fraction` | exactly one: optimizer steps, token positions (sequences x seq_len, padding included, so the count is a function of the plan, not of the data: steps = ceil(tokens / (global batch x seq_len))), or a share of `train.total_steps` |
| `shards_dir`, `seq_len`, `micro_batch_size`, `global_batch_size`, `grad_accum`, `sources` | the phase's `data.*` (unset: the run's `data.*`); `sources` only where `data.sources` (mixtures) exists |
| `model` | live-model overrides applied when the phase starts: `global_rope_theta`, `local_rope_theta` (`model.arch=modernbert`) |
| `optim` | an LR-schedule segment: `optim.*` schedule fields (lr, warmup_steps, min_lr_ratio, ...) for a schedule over this phase's own steps (step counted from the phase's first); without it the run's one schedule over `train.total_steps` goes on |

Rules (checked before compute, each error names the field): the phases' steps sum to
`train.total_steps`; every phase's shards have the model's tokenizer (phase 0's: hash, vocabulary,
special tokens); no phase's seq_len exceeds the model's positions (`model.max_position`, which
defaults to the longest phase's seq_len so the position table is built once for the whole run).

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
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pipeline.config.checks import ConfigError, check_known_keys, did_you_mean
from pipeline.data.config import BatchPlan, BatchRamp, DataConfig, plan_batches, plan_ramp
from pipeline.data.shards import Manifest
from pipeline.train.optim import OptimConfig, lr_at

#: `pipeline.config.run.RunConfig` (not imported: the config module imports this one)
RunConfig = Any

log = logging.getLogger(__name__)

DATA_KEYS = ("shards_dir", "sources", "seq_len", "micro_batch_size", "global_batch_size", "grad_accum")
LENGTH_KEYS = ("steps", "tokens", "fraction")
PHASE_KEYS = ("name", *LENGTH_KEYS, *DATA_KEYS, "model", "optim")
#: Live-model fields a phase may change: read at every forward, no parameter depends on them.
MODEL_OVERRIDES = ("global_rope_theta", "local_rope_theta")
#: `optim.*` fields built into the optimizer or the engine: a phase cannot change them mid-run.
OPTIM_FIXED = ("name", "impl", "betas", "eps", "weight_decay", "grad_clip")


def phase_seed(seed: int, index: int) -> int:
    """Seed of phase `index`: `seed` itself for phase 0 (a one-phase run is the run without phases),
    else a 63-bit blake2b hash of (seed, index)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"phase:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _where(index: int, raw: Any) -> str:
    name = raw.get("name") if isinstance(raw, dict) else None
    return f"phases[{index}]" + (f" ({name})" if name else "")


def check_phases(cfg: RunConfig) -> None:
    """Stage-1 checks of `phases` (the config alone): keys, one length each, overrides, names,
    and the step sum where every phase is given in steps or fractions."""
    if not isinstance(cfg.phases, list):
        raise ConfigError(f"phases: expected a list of phase mappings, got {cfg.phases!r}")
    names = []
    for i, raw in enumerate(cfg.phases):
        where = _where(i, raw)
        if not isinstance(raw, dict):
            raise ConfigError(f"phases[{i}]: expected a mapping ({', '.join(PHASE_KEYS)}), got {raw!r}")
        check_known_keys(raw, PHASE_KEYS, where, "phase key")
        given = [k for k in LENGTH_KEYS if raw.get(k) is not None]
        if len(given) != 1:
            raise ConfigError(f"{where}: give exactly one of steps, tokens, fraction (got {given or 'none'})")
        value = raw[given[0]]
        if given[0] == "fraction":
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(f"{where}.fraction={value!r}: must be in (0, 1]")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{where}.{given[0]}={value!r}: must be a positive integer")
        if "sources" in raw and "sources" not in {f.name for f in dataclasses.fields(DataConfig)}:
            raise ConfigError(f"{where}.sources: data mixtures (data.sources) are not available in this version; "
                              "name the phase's data with shards_dir")
        names.append(str(raw.get("name") or f"phase{i}"))
        try:
            phase_data(cfg, i).check()
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from err
        model = raw.get("model") or {}
        if not isinstance(model, dict):
            raise ConfigError(f"{where}.model: expected a mapping of {list(MODEL_OVERRIDES)}, got {model!r}")
        for key, value in model.items():
            if key not in MODEL_OVERRIDES:
                raise ConfigError(f"{where}.model.{key}: a phase can change only {list(MODEL_OVERRIDES)} of the live "
                                  f"model{did_you_mean(str(key), MODEL_OVERRIDES)}; the shape is the run's")
            if cfg.model.arch != "modernbert":
                raise ConfigError(f"{where}.model.{key}: rotary bases need model.arch=modernbert (BERT has learned "
                                  "absolute positions)")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 1:
                raise ConfigError(f"{where}.model.{key}={value!r}: must be a number > 1")
        phase_optim(cfg, i)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"phases: names must be unique (a checkpoint names its phase); repeated: {duplicates}")
    if cfg.phases and all(raw.get("tokens") is None for raw in cfg.phases):
        check_step_sum(cfg, phase_steps_without_data(cfg))


def phase_data(cfg: RunConfig, index: int) -> DataConfig:
    """The `data.*` of phase `index`: the run's, with the phase's data keys. Phase 0 keeps
    `data.batch_warmup`; later phases run at their full batch."""
    raw = cfg.phases[index]
    data = copy.deepcopy(cfg.data)
    for key in DATA_KEYS:
        if key in raw:
            setattr(data, key, copy.deepcopy(raw[key]))
    if "shards_dir" in raw and hasattr(data, "sources") and "sources" not in raw:
        data.sources = []  # a phase naming one directory replaces the run's mixture
    if "sources" in raw and "shards_dir" not in raw:
        data.shards_dir = ""
    if index > 0:
        data.batch_warmup = {}
    return data


def phase_optim(cfg: RunConfig, index: int) -> Optional[OptimConfig]:
    """Phase `index`'s LR-schedule segment (the run's `optim` with the phase's schedule fields), or None."""
    raw, where = cfg.phases[index], _where(index, cfg.phases[index])
    segment = raw.get("optim")
    if not segment:
        return None
    if not isinstance(segment, dict):
        raise ConfigError(f"{where}.optim: expected a mapping of schedule fields, got {segment!r}")
    names = [f.name for f in dataclasses.fields(OptimConfig)]
    for key in segment:
        if key in OPTIM_FIXED:
            raise ConfigError(f"{where}.optim.{key}: fixed for the whole run (built into the optimizer or the "
                              "engine); a phase sets only schedule fields")
        if key not in names:
            raise ConfigError(f"{where}.optim.{key}: unknown optim field{did_you_mean(str(key), names)}")
    optim = dataclasses.replace(cfg.optim, **segment)
    try:
        optim.check()
    except ConfigError as err:
        raise ConfigError(f"{where}.{err}") from err
    return optim


def phase_steps_without_data(cfg: RunConfig) -> list[int]:
    """Steps of phases given in steps or fractions (fractions of `train.total_steps`, the last
    fraction phase taking the rounding remainder when the fractions sum to 1)."""
    total = cfg.train.total_steps
    steps = [raw["steps"] if raw.get("steps") is not None else int(math.floor(raw["fraction"] * total))
             for raw in cfg.phases]
    fractions = [i for i, raw in enumerate(cfg.phases) if raw.get("fraction") is not None]
    whole = abs(sum(cfg.phases[i]["fraction"] for i in fractions) - 1) < 1e-9
    if fractions and len(fractions) == len(cfg.phases) and whole:
        steps[fractions[-1]] = total - sum(steps[i] for i in fractions[:-1])
    return steps


def check_step_sum(cfg: RunConfig, steps: list[int]) -> None:
    """Every phase at least one step, and the phases' steps summing to `train.total_steps`."""
    for i, n in enumerate(steps):
        if n < 1:
            raise ConfigError(f"{_where(i, cfg.phases[i])}: {n} steps (its fraction of train.total_steps="
                              f"{cfg.train.total_steps} rounds to nothing)")
    if sum(steps) != cfg.train.total_steps:
        parts = " + ".join(f"{n} ({_where(i, cfg.phases[i])})" for i, n in enumerate(steps))
        raise ConfigError(f"phases: the phases' steps sum to {parts} = {sum(steps)}, but train.total_steps="
                          f"{cfg.train.total_steps}; they must agree (one run walks the phases once; to extend a run, "
                          f"lengthen its last phase with it: phases.{len(steps) - 1}.steps=N)")


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


class Schedule:
    """A run's phases (one implicit phase named "" for a run that only warms up its batch) and the
    step -> (phase, batch plan, learning rate) arithmetic the loop asks before every step."""

    def __init__(self, phases: list[Phase], total_steps: int, root: RunConfig) -> None:
        self.phases, self.total_steps = phases, total_steps
        self.root = root  # the run's config as loaded (a phase's view: `run_config`)
        self._corpus: Optional[dict[str, Any]] = None

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

    def enter(self, state: Any, step: int) -> Optional[Phase]:
        """Bookkeeping before step `step`: when it belongs to another phase than `state.phase`, the
        phase starts here (its first sample is the run's `consumed_samples`). Returns the phase entered,
        or None when `step` continues the current one."""
        phase = self.phase_at(step)
        if state.phase == phase.name:
            return None
        if state.phase and state.phase not in [p.name for p in self.phases]:
            raise ConfigError(f"the checkpoint at step {state.step} is in phase {state.phase!r}, which this run's "
                              f"phases ({[p.name for p in self.phases]}) do not have")
        state.phase, state.phase_start_samples = phase.name, state.consumed_samples
        return phase

    def run_config(self, phase: Phase) -> RunConfig:
        """The run's config as phase `phase` runs it: its data and seed (the loop's and the reader's view)."""
        out = copy.deepcopy(self.root)
        out.data, out.train.seed = copy.deepcopy(phase.data), phase.seed
        return out

    def data_identity(self, resume_dir: Any, data_hash: str, data_dir: str) -> tuple[str, str]:
        """(manifest hash, shards directory) of the phase a checkpoint was written in (the phase of its
        step), to compare with its recorded data; the given ones where its meta is unreadable
        (`plan_resume` then says so)."""
        from pipeline.train.run_meta import RunMeta

        try:
            phase = self.phase_at(RunMeta.read(resume_dir).step)
        except (FileNotFoundError, ValueError, TypeError):
            return data_hash, data_dir
        return phase.manifest_hash, phase.data.shards_dir

    def start_view(self, plan: Any, resume_step: int) -> tuple[RunConfig, Any]:
        """(config, plan) that `start` builds the run with: those of the phase of step `resume_step` + 1."""
        phase = self.phase_at(resume_step + 1)
        return self.run_config(phase), dataclasses.replace(plan, batch=phase.batch, manifest=phase.manifest,
                                                           manifest_hash=phase.manifest_hash)

    def resume_into(self, state: Any, model: Any) -> None:
        """At start (fresh or resumed): the phase of the next step is entered (bookkeeping) and its
        live-model overrides set; the loop's `before_step` then finds nothing new to enter."""
        self.enter(state, state.step + 1)
        apply_model_overrides(model, self.phase_at(state.step + 1))

    def corpus(self) -> dict[str, Any]:
        """The model card's corpus of a phased run (`RunMeta.corpus`): every phase's source files (once
        each), the last phase's seq_len, the shards' totals summed, and per phase its name, steps,
        seq_len and `corpus_summary`."""
        from pipeline.train.run_meta import corpus_summary

        if self._corpus is None:
            summaries = [corpus_summary(p.manifest) for p in self.phases]
            files = {json_key(f): f for summary in summaries for f in summary["files"]}
            self._corpus = {**summaries[-1], "files": list(files.values()),
                            "sequences": sum(s["sequences"] for s in summaries),
                            "tokens": sum(s["tokens"] for s in summaries),
                            "phases": [{"name": p.name, "steps": p.steps, **s} for p, s in zip(self.phases, summaries)]}
        return self._corpus

    def metrics(self, step: int, batch: BatchPlan) -> dict[str, int]:
        """Logged with every step: the phase index (phased runs) and the step's global batch."""
        out = {"global_batch_size": batch.global_batch_size}
        if self.phased:
            out["phase"] = self.phase_at(step).index
        return out


def plan_schedule(cfg: RunConfig, world_size: int) -> Optional[Schedule]:
    """Stage 2 of `phases` / `data.batch_warmup` (before any model is built): every phase's batch
    split and shards, one tokenizer, seq_len within the model's positions, tokens -> steps, the step
    sum, the warm-up ramp. None for a run with neither (the loop then takes its plain path)."""
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
        phase = Phase(0, "", 0, cfg.train.total_steps, cfg.data, batch, manifest, data_hash, cfg.train.seed, {}, None,
                      ramp)
        return Schedule([phase], cfg.train.total_steps, cfg)
    phases, start = [], 0
    fixed = phase_steps_without_data(cfg) if all(r.get("tokens") is None for r in cfg.phases) else None
    for i, raw in enumerate(cfg.phases):
        where, data = _where(i, raw), phase_data(cfg, i)
        try:
            batch = plan_batches(data, world_size)
            manifest, data_hash = data.check_shards(batch)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from err
        ramp = plan_ramp(data, batch, manifest.seq_len, f"{where}: data.batch_warmup") if i == 0 else None
        if fixed is not None:
            steps = fixed[i]
        elif raw.get("steps") is not None:
            steps = raw["steps"]
        elif raw.get("fraction") is not None:
            steps = int(math.floor(raw["fraction"] * cfg.train.total_steps))
        else:
            steps = tokens_to_steps(raw["tokens"], manifest.seq_len, batch, ramp)
        phases.append(Phase(i, str(raw.get("name") or f"phase{i}"), start, steps, data, batch, manifest, data_hash,
                            phase_seed(cfg.train.seed, i), dict(raw.get("model") or {}), phase_optim(cfg, i), ramp))
        start += steps
    check_step_sum(cfg, [p.steps for p in phases])
    for phase in phases:  # a schedule segment fits its phase (warm-up, decay window)
        check_steps = getattr(phase.optim, "check_steps", None)
        if check_steps is not None:
            try:
                check_steps(phase.steps, f"{_where(phase.index, cfg.phases[phase.index])} steps")
            except ConfigError as err:
                raise ConfigError(f"{_where(phase.index, cfg.phases[phase.index])}.optim: {err}") from err
    first = phases[0].manifest
    for phase in phases[1:]:
        m, where = phase.manifest, _where(phase.index, cfg.phases[phase.index])
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
            where = _where(phase.index, cfg.phases[phase.index])
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


def apply_model_overrides(model: Any, phase: Phase) -> None:
    """Set the phase's live-model fields (rotary bases) on the encoder config the forward reads: the
    config is frozen, so every module holding it gets the replaced one (`model.config` included)."""
    if not phase.model:
        return
    old = model.config
    new = dataclasses.replace(old, **{key: float(value) for key, value in phase.model.items()})
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new


def set_engine_batch(engine: Any, batch: BatchPlan) -> None:
    """DeepSpeed's micro batch and gradient-accumulation steps for `batch` (it scales each micro-batch's
    loss by 1 / accumulation steps); the loop marks the accumulation boundary itself
    (`engine.set_gradient_accumulation_boundary`), because DeepSpeed's own count, (micro steps + 1)
    mod accumulation steps, runs over the whole run and would misplace it after a change."""
    if engine.train_micro_batch_size_per_gpu() != batch.micro_batch_size:
        engine.set_train_micro_batch_size(batch.micro_batch_size)
    if engine.train_batch_size() != batch.global_batch_size:
        engine.set_train_batch_size(batch.global_batch_size)
    zero = getattr(engine, "optimizer", None)  # ZeRO's optimizer keeps its own copy (read by the offload path)
    if hasattr(zero, "gradient_accumulation_steps"):
        zero.gradient_accumulation_steps = batch.grad_accum


def before_step(run: Any, step: int, open_batches: Callable[..., Any]) -> None:
    """What the loop does before step `step` of a run with a `Schedule` (`run.plan.schedule`): enter a
    new phase (its data, seed, overrides), then the batch split of this step (warm-up), reopening the
    reader at the same sample when the split changes (`open_batches`: the loop's one reader builder)."""
    schedule: Schedule = run.plan.schedule
    state = run.state
    entered = schedule.enter(state, step)
    phase = schedule.phase_at(step)
    dataset = run.batches.dataset
    if entered is not None:
        log.info("step %d: phase %r starts (%s, seq_len %d, %d steps, global batch %d)", step, phase.name,
                 phase.data.shards_dir or "data.sources", phase.manifest.seq_len, phase.steps,
                 phase.batch.global_batch_size)
        run.cfg = schedule.run_config(phase)
        run.plan = dataclasses.replace(run.plan, manifest=phase.manifest, manifest_hash=phase.manifest_hash)
        apply_model_overrides(run.model, phase)
        dataset = None  # the phase's own data, opened (and checked) by open_batches
        run.meta.encoder_config = run.model.config.to_dict()
        run.meta.manifest_hash = phase.manifest_hash
    if schedule.phased:
        run.meta.corpus = schedule.corpus()
    batch = schedule.batch_at(phase, state.consumed_samples - state.phase_start_samples)
    if entered is None and batch == run.plan.batch:
        return
    run.plan = dataclasses.replace(run.plan, batch=batch)
    run.batches = open_batches(run.cfg, run.plan, run.model, run.info.rank,
                               state.consumed_samples - state.phase_start_samples, run.device.type == "cuda", dataset)
    run.meta.data_dir = str(run.batches.dataset.directory.resolve())
    set_engine_batch(run.engine, batch)
