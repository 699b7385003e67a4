"""Time-to-quality arithmetic: when does each objective's evaluation curve reach a target?

Curves are lists of `EvalPoint`s (step, device-hours spent so far, metric values) taken at fixed
step intervals. The question the papers answer ("TACO reaches MLM's GLUE score with 1/5 of the
steps") is asked here the same way: by default the target is the *baseline's final value* on that
metric, and each run reports the first evaluated step at which it is at least as good.

Choice: no interpolation between evaluation points. The reported step is the first *measured*
one that meets the target, so a reported speed-up is never an extrapolation; the eval interval is
the resolution and is stated in the report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation of one run: after `step` optimizer steps and `device_hours` of compute."""

    step: int
    device_hours: float
    values: Mapping[str, float] = field(default_factory=dict)


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


def summarize_targets(
    curves: Mapping[str, Sequence[EvalPoint]],
    metric: str,
    higher_is_better: bool,
    baseline: str = "mlm",
    target: Optional[float] = None,
) -> list[dict]:
    """One row per run: steps and device-hours to reach `target`, and the ratios against `baseline`.

    `target` defaults to the baseline run's final value of `metric` (the papers' framing). Ratios
    are run / baseline, so 0.2 means "reached the target with a fifth of the baseline's steps";
    they are None when either run never reached the target.
    """
    if baseline not in curves:
        raise ValueError(f"baseline run {baseline!r} is not among the runs {sorted(curves)}")
    if target is None:
        target = final_value(curves[baseline], metric)
        if target is None:
            raise ValueError(f"baseline run {baseline!r} has no {metric!r} measurement to use as target")
    base_hit = first_reaching(curves[baseline], metric, target, higher_is_better)
    rows = []
    for name, curve in curves.items():
        hit = first_reaching(curve, metric, target, higher_is_better)
        row = {
            "run": name,
            "metric": metric,
            "target": target,
            "final": final_value(curve, metric),
            "steps_to_target": hit.step if hit else None,
            "device_hours_to_target": hit.device_hours if hit else None,
            "step_ratio_vs_baseline": None,
            "hours_ratio_vs_baseline": None,
        }
        if hit and base_hit and base_hit.step > 0:
            row["step_ratio_vs_baseline"] = hit.step / base_hit.step
            if base_hit.device_hours > 0:
                row["hours_ratio_vs_baseline"] = hit.device_hours / base_hit.device_hours
        rows.append(row)
    return rows


def curve_series(curves: Mapping[str, Sequence[EvalPoint]], metric: str, x: str = "step") -> dict:
    """`{run: [(x, value), ...]}` for plotting; `x` is "step" or "device_hours"."""
    if x not in ("step", "device_hours"):
        raise ValueError(f"x must be 'step' or 'device_hours', got {x!r}")
    return {
        name: [(getattr(p, x), p.values[metric]) for p in sorted(curve, key=lambda p: p.step)
               if p.values.get(metric) is not None]
        for name, curve in curves.items()
    }
