"""Means and 95% intervals over seeds: Student's t and Welch's t, with scipy's t distribution.

For n values x_1..x_n (one per pretraining seed) the interval is

    mean +- t_{(1 + c) / 2, n - 1} * s / sqrt(n),      s = sample standard deviation,

the usual t-interval for the mean (it assumes the seed-to-seed spread is roughly normal; with 3
seeds it is wide on purpose: t_{0.975, 2} = 4.303). Welch's interval of a difference (`difference_ci`)
has fractional degrees of freedom; both quantiles are `scipy.stats.t.ppf` (the ecosystem's tested
implementation: a hand-written series and incomplete beta function lived here before, equal to it to 1e-9),
so every interval is the one `scipy.stats.ttest_1samp` / `ttest_ind(equal_var=False)` report. One value
gives the mean and no interval (None), never a made-up one.

The one home of intervals over seeds: the study's report (`pipeline.study`) and the benchmarks' reports use
it. (`pipeline.eval.metrics` holds the per-evaluation statistics, accuracy to Spearman, and `pipeline.eval.sts`
the percentile bootstrap over pairs: intervals of another kind.)
"""
from __future__ import annotations

import math
import statistics
from typing import Iterable, Optional


def t_quantile(confidence: float, df: float) -> float:
    """t such that P(|T| <= t) = `confidence` for Student's t with `df` > 0 degrees of freedom (fractional
    for Welch's), e.g. 0.95 -> 4.303 for df = 2: `scipy.stats.t.ppf((1 + confidence) / 2, df)`."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    from scipy.stats import t as student_t  # scipy's import costs ~0.3 s: only when an interval is made

    return float(student_t.ppf(0.5 * (1.0 + confidence), df))


def mean_ci(values: Iterable[Optional[float]], confidence: float = 0.95) -> dict:
    """`{"mean", "lo", "hi", "half_width", "std", "n"}` of the non-missing `values` (None / nan are
    skipped and counted in `missing`); the bounds are None with fewer than two values."""
    raw = list(values)
    xs = [float(v) for v in raw if v is not None and not math.isnan(float(v))]
    out = {"mean": None, "lo": None, "hi": None, "half_width": None, "std": None, "n": len(xs),
           "missing": len(raw) - len(xs)}
    if not xs:
        return out
    out["mean"] = statistics.fmean(xs)
    if len(xs) >= 2:
        std = statistics.stdev(xs)
        half = t_quantile(confidence, len(xs) - 1) * std / math.sqrt(len(xs))
        out.update(std=std, half_width=half, lo=out["mean"] - half, hi=out["mean"] + half)
    return out


def difference_ci(a: Iterable[Optional[float]], b: Iterable[Optional[float]], confidence: float = 0.95) -> dict:
    """mean(a) - mean(b) with Welch's t-interval (unequal variances; Welch 1947), as `mean_ci`'s dict:

        d = mean(a) - mean(b),   se^2 = s_a^2 / n_a + s_b^2 / n_b,
        nu = se^4 / ((s_a^2 / n_a)^2 / (n_a - 1) + (s_b^2 / n_b)^2 / (n_b - 1)),
        d +- t_{(1 + c) / 2, nu} * se

    (nu as it is, fractional: the interval scipy's `ttest_ind(equal_var=False).confidence_interval`
    gives; rounding nu down made it up to a third wider at three seeds a side). With fewer than two values on either side the bounds are None: one fine-tuning
    run of a random model says nothing about how much random models vary."""
    xs = [float(v) for v in a if v is not None and not math.isnan(float(v))]
    ys = [float(v) for v in b if v is not None and not math.isnan(float(v))]
    out = {"mean": None, "lo": None, "hi": None, "half_width": None, "df": None, "n": (len(xs), len(ys))}
    if not xs or not ys:
        return out
    out["mean"] = statistics.fmean(xs) - statistics.fmean(ys)
    if len(xs) >= 2 and len(ys) >= 2:
        va, vb = statistics.variance(xs) / len(xs), statistics.variance(ys) / len(ys)
        se = math.sqrt(va + vb)
        if se == 0.0:
            out.update(df=len(xs) + len(ys) - 2, half_width=0.0, lo=out["mean"], hi=out["mean"])
            return out
        df = max(1.0, (va + vb) ** 2 / (va ** 2 / (len(xs) - 1) + vb ** 2 / (len(ys) - 1)))
        half = t_quantile(confidence, df) * se
        out.update(df=df, half_width=half, lo=out["mean"] - half, hi=out["mean"] + half)
    return out


def format_ci(ci: dict, digits: int = 3) -> str:
    """`0.812 [0.790, 0.834]` (n = 1: the value alone; none: empty)."""
    if ci.get("mean") is None:
        return ""
    text = f"{ci['mean']:.{digits}f}"
    if ci.get("lo") is not None:
        text += f" [{ci['lo']:.{digits}f}, {ci['hi']:.{digits}f}]"
    if ci.get("missing"):
        text += f" ({ci['n']} of {ci['n'] + ci['missing']})"
    return text
