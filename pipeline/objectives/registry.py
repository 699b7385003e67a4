"""The registry of objectives as the rest of the project uses it: build one from its config, check
`objectives` / `objective_options` before any compute.

Importing this module imports every objective module, so `OBJECTIVES` is complete here.
Objectives report option errors in their own terms ("tau must be positive"); `build_objective`
puts them under their config path (`objective_options.capt.tau must be positive`).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from pipeline.config.checks import ConfigError, accepted_keywords, check_keywords, did_you_mean, option_error
from pipeline.model.encoder import EncoderConfig
from pipeline.objectives import capt, cocolm, electra, infoword, mlm, mlm_nce, taco  # noqa: F401  (they register)
from pipeline.objectives.base import OBJECTIVES, Objective


def build_objective(name: str, encoder_config: EncoderConfig, special_tokens: Mapping[str, int],
                    options: Mapping[str, Any]) -> Objective:
    """`OBJECTIVES[name](encoder_config, special_tokens, **options)`, with option errors named by
    their config path."""
    registry = OBJECTIVES
    if name not in registry:
        raise ConfigError(f"objectives.{name}: unknown objective{did_you_mean(str(name), list(registry))}; "
                          f"registered: {sorted(registry)}")
    cls = registry[name]
    where = f"objective_options.{name}"
    check_keywords(cls, dict(options), where, skip=2)
    try:
        return cls(encoder_config, dict(special_tokens), **options)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise option_error(where, err, accepted_keywords(cls, skip=2) or ()) from err


def check_objectives(objectives: dict, options: dict) -> None:
    """Stage-1 checks: registered names, numeric weights, options the constructors accept."""
    registry = OBJECTIVES
    if not objectives:
        raise ConfigError("objectives: at least one objective is required, e.g. objectives={mlm: 1.0}")
    for name, weight in objectives.items():
        if name not in registry:
            raise ConfigError(f"objectives.{name}: unknown objective{did_you_mean(str(name), list(registry))}; "
                              f"registered: {sorted(registry)}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            # nan passes `weight < 0` and makes every step's loss nan: refused here, not after compute started
            raise ConfigError(f"objectives.{name}={weight!r}: the weight must be a finite number >= 0")
    for name, opts in options.items():
        if name not in objectives:
            raise ConfigError(f"objective_options.{name}: {name!r} is not in objectives ({sorted(objectives)})"
                              f"{did_you_mean(str(name), list(objectives))}")
        if not isinstance(opts, dict):
            raise ConfigError(f"objective_options.{name}: expected a mapping of keyword options, got {opts!r}")
        check_keywords(registry[name], opts, f"objective_options.{name}", skip=2)


def check_objectives_under_stage(objectives: dict, stage: int, stage_source: str) -> None:
    """Stage 2: an objective with `max_zero_stage` below the engine's ZeRO stage is refused.
    `stage_source` names the setting the stage comes from (`DeepSpeedConfig.stage_source`)."""
    registry = OBJECTIVES
    for name in objectives:
        limit = registry[name].max_zero_stage
        if stage > limit:
            raise ConfigError(f"{stage_source} uses ZeRO stage {stage}, but objective {name!r} supports stages up to "
                              f"{limit}; choose a stage <= {limit} there")


def mlm_head_training(objectives: Iterable[str]) -> dict[str, str]:
    """Name -> `Objective.mlm_head` (`FULL_SOFTMAX` / `SAMPLED_SOFTMAX`) of the objectives among
    `objectives` that train the shared MLM head `cls.predictions`: whether its scores are a masked LM's
    logits, or log p - log q (sampled negatives, `mlm_nce`) whose log q the run model must hold."""
    return {name: OBJECTIVES[name].mlm_head for name in objectives if OBJECTIVES[name].mlm_head is not None}


def mlm_head_beside_electra(objectives: Mapping[str, float]) -> list[str]:
    """The objectives of non-zero weight that train the MLM head `cls.predictions` beside `electra` (sorted;
    [] without electra). An ELECTRA export (`ElectraForPreTraining`) has no MLM head, so `cpt-convert`
    refuses such a run (`pipeline.export.electra_adapter.export_refusal`) and training warns at its start
    (`pipeline.train.run_config`): the combination trains, but converts to nothing."""
    if "electra" not in objectives:
        return []
    return sorted(n for n in mlm_head_training(objectives) if objectives[n] != 0)
