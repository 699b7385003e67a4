"""The live side of a phase change (`pipeline.train.loop.Run.apply_phase`): what a `PhaseView`
(`pipeline.train.phases.schedule.Schedule.at`) changes in the model and the DeepSpeed engine."""
from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.data.config import BatchPlan


def apply_model_overrides(model: Any, overrides: dict) -> None:
    """Set a phase's live-model fields (`phases[i].model`: rotary bases) on the encoder config the
    forward reads: the config is frozen, so every module holding it gets the replaced one
    (`model.config` included)."""
    if not overrides:
        return
    old = model.config
    new = dataclasses.replace(old, **{key: float(value) for key, value in overrides.items()})
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
