"""Training phases (`phases:`): the config side: what a phase entry may say, checked before compute.

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

This module checks a config's `phases` (stage 1: the config alone) and derives each phase's `data.*`
and LR-schedule segment; planning the phases against their shards (steps, batch splits, tokenizer)
is `pipeline.train.phases.schedule`, and changing the live run at a phase's first step is
`pipeline.train.loop.Run.apply_phase`.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Optional

from pipeline.config.checks import ConfigError, check_known_keys, did_you_mean
from pipeline.data.config import DataConfig
from pipeline.train.optim import OptimConfig

#: `pipeline.train.run_config.RunConfig` (not imported: that module imports this one)
RunConfig = Any

DATA_KEYS = ("shards_dir", "sources", "seq_len", "micro_batch_size", "global_batch_size", "grad_accum")
LENGTH_KEYS = ("steps", "tokens", "fraction")
PHASE_KEYS = ("name", *LENGTH_KEYS, *DATA_KEYS, "model", "optim")
#: Live-model fields a phase may change: read at every forward, no parameter depends on them.
MODEL_OVERRIDES = ("global_rope_theta", "local_rope_theta")
#: `optim.*` fields built into the optimizer or the engine: a phase cannot change them mid-run.
OPTIM_FIXED = ("name", "impl", "betas", "eps", "weight_decay", "grad_clip")


def phase_label(index: int, raw: Any) -> str:
    name = raw.get("name") if isinstance(raw, dict) else None
    return f"phases[{index}]" + (f" ({name})" if name else "")


def check_phases(cfg: RunConfig) -> None:
    """Stage-1 checks of `phases` (the config alone): keys, one length each, overrides, names,
    and the step sum where every phase is given in steps or fractions."""
    if not isinstance(cfg.phases, list):
        raise ConfigError(f"phases: expected a list of phase mappings, got {cfg.phases!r}")
    names = []
    for i, raw in enumerate(cfg.phases):
        where = phase_label(i, raw)
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
        if "sources" in raw and "sources" not in {f.name for f in dataclasses.fields(cfg.data)}:
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
    raw, where = cfg.phases[index], phase_label(index, cfg.phases[index])
    segment = raw.get("optim")
    if not segment:
        return None
    if not isinstance(segment, dict):
        raise ConfigError(f"{where}.optim: expected a mapping of schedule fields, got {segment!r}")
    names = [f.name for f in dataclasses.fields(cfg.optim)]
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
            raise ConfigError(f"{phase_label(i, cfg.phases[i])}: {n} steps (its fraction of train.total_steps="
                              f"{cfg.train.total_steps} rounds to nothing)")
    if sum(steps) != cfg.train.total_steps:
        parts = " + ".join(f"{n} ({phase_label(i, cfg.phases[i])})" for i, n in enumerate(steps))
        raise ConfigError(f"phases: the phases' steps sum to {parts} = {sum(steps)}, but train.total_steps="
                          f"{cfg.train.total_steps}; they must agree (one run walks the phases once; to extend a run, "
                          f"lengthen its last phase with it: phases.{len(steps) - 1}.steps=N)")
