"""Time-to-quality arithmetic: when does each objective's evaluation curve reach a target?

Curves are lists of `EvalPoint`s (step, device-hours spent so far, metric values) taken at fixed
step intervals, one curve per pretraining seed. The question the papers answer ("TACO reaches
MLM's GLUE score with 1/5 of the steps") is asked per seed, paired: the target of seed k is the
*MLM baseline's final value with seed k* (the same data order, masks and initialisation stream),
each run reports the first evaluated step at which it is at least as good, and the ratio is
run / baseline (the baseline's own first step at its final value). Over the seeds the report gives
the mean and the 95% t-interval (`pipeline.stats`); a mean is only given when every seed
reached the target (an average over the seeds that happened to reach it would flatter the run).

Choice: no interpolation between evaluation points. The reported step is the first *measured*
one that meets the target, so a reported speed-up is never an extrapolation; the eval interval is
the resolution and is stated in the report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from pipeline.stats import mean_ci


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation of one run: after `step` optimizer steps, `device_hours` of compute and `tokens`
    trained on (None where the run did not record them)."""

    step: int
    device_hours: float
    values: Mapping[str, float] = field(default_factory=dict)
    tokens: Optional[int] = None


def meets(value: float, target: float, higher_is_better: bool) -> bool:
    """True when `value` is at least as good as `target`."""
    return value >= target if higher_is_better else value <= target


def first_reaching(
    curve: Sequence[EvalPoint], metric: str, target: float, higher_is_better: bool
) -> Optional[EvalPoint]:
    """The earliest point (by step) whose `metric` meets `target`; None if the curve never does.

    Points without the metric (e.g. a downstream evaluation that was not run at that step) are
    skipped, not treated as failures.
    """
    for point in sorted(curve, key=lambda p: p.step):
        value = point.values.get(metric)
        if value is not None and meets(value, target, higher_is_better):
            return point
    return None


def final_value(curve: Sequence[EvalPoint], metric: str) -> Optional[float]:
    """The metric at the last step where it was measured."""
    measured = [p for p in sorted(curve, key=lambda p: p.step) if p.values.get(metric) is not None]
    return measured[-1].values[metric] if measured else None


def seed_time_to_target(baseline: Sequence[EvalPoint], run: Sequence[EvalPoint], metric: str,
                        higher_is_better: bool) -> dict:
    """One seed, paired: target = the baseline's final `metric`; steps and device-hours the baseline
    and the run need to meet it, and the run / baseline ratios (None when the run never does)."""
    target = final_value(baseline, metric)
    out = {"target": target, "baseline_steps": None, "baseline_hours": None, "steps": None, "hours": None,
           "step_ratio": None, "hours_ratio": None}
    if target is None:
        return out
    base = first_reaching(baseline, metric, target, higher_is_better)
    hit = first_reaching(run, metric, target, higher_is_better)
    assert base is not None  # the final point meets its own value
    out.update(baseline_steps=base.step, baseline_hours=base.device_hours)
    if hit is not None:
        out.update(steps=hit.step, hours=hit.device_hours)
        if base.step > 0:
            out["step_ratio"] = hit.step / base.step
        if base.device_hours > 0:
            out["hours_ratio"] = hit.device_hours / base.device_hours
    return out


def time_to_target(baseline: Mapping[int, Sequence[EvalPoint]], runs: Mapping[int, Sequence[EvalPoint]],
                   metric: str, higher_is_better: bool, confidence: float = 0.95) -> dict:
    """`seed_time_to_target` for every seed both have, and over them the mean / interval of the
    steps, device-hours and ratios (None unless every seed reached the target)."""
    seeds = sorted(set(baseline) & set(runs))
    per_seed = {seed: seed_time_to_target(baseline[seed], runs[seed], metric, higher_is_better) for seed in seeds}
    reached = sum(1 for r in per_seed.values() if r["steps"] is not None)
    out: dict = {"metric": metric, "seeds": seeds, "reached": reached, "per_seed": per_seed}
    for field_name in ("target", "steps", "hours", "step_ratio", "hours_ratio"):
        values = [r[field_name] for r in per_seed.values()]
        everyone = seeds and reached == len(seeds)
        out[field_name] = mean_ci(values, confidence) if (field_name == "target" or everyone) else None
    return out


def mean_curve(curves: Sequence[Sequence[EvalPoint]], metric: str, confidence: float = 0.95) -> list[dict]:
    """Per evaluated step that every curve measured: the mean device-hours (and tokens, where every curve
    recorded them) and the mean / interval of `metric` over the curves (seeds)."""
    by_step: dict[int, list[EvalPoint]] = {}
    for curve in curves:
        for point in curve:
            if point.values.get(metric) is not None:
                by_step.setdefault(point.step, []).append(point)
    rows = []
    for step in sorted(by_step):
        points = by_step[step]
        if len(points) < len(curves):
            continue
        ci = mean_ci([p.values[metric] for p in points], confidence)
        tokens = [p.tokens for p in points]
        rows.append({"step": step, "device_hours": sum(p.device_hours for p in points) / len(points),
                     "tokens": sum(tokens) / len(tokens) if None not in tokens else None, **ci})
    return rows
