"""Means and 95% intervals over seeds: Student's t, exact, with no scipy at run time.

For n values x_1..x_n (one per pretraining seed) the interval is

    mean +- t_{(1 + c) / 2, n - 1} * s / sqrt(n),      s = sample standard deviation,

the usual t-interval for the mean (it assumes the seed-to-seed spread is roughly normal; with 3
seeds it is wide on purpose: t_{0.975, 2} = 4.303). The t quantile is found by bisection on the
exact two-sided t probability for integer degrees of freedom (Abramowitz & Stegun 26.7.3-26.7.4):
with theta = arctan(t / sqrt(nu)),

    nu odd:  A(t) = (2 / pi) * (theta + sin(theta) * (cos(theta) + 2/3 cos^3(theta) + ...
                    + (2*4*...*(nu-3)) / (1*3*...*(nu-2)) cos^(nu-2)(theta)))      (A = 2 theta / pi at nu = 1)
    nu even: A(t) = sin(theta) * (1 + 1/2 cos^2(theta) + (1*3)/(2*4) cos^4(theta) + ...
                    + (1*3*...*(nu-3)) / (2*4*...*(nu-2)) cos^(nu-2)(theta))

where A(t) = P(|T| <= t). Welch's interval has a fractional nu (`difference_ci`): there
A(t) = 1 - I_{nu / (nu + t^2)}(nu / 2, 1 / 2), the regularised incomplete beta function by its continued
fraction (Numerical Recipes 6.4), so the interval is scipy's `ttest_ind(equal_var=False)` one, not a
rounded-down approximation. One value gives the mean and no interval (None), never a made-up one.

The one home of intervals over seeds: the study's report (`pipeline.study`) and the benchmarks' reports use
it. (`pipeline.eval.metrics` holds the per-evaluation statistics, accuracy to Spearman, and `pipeline.eval.sts`
the percentile bootstrap over pairs: intervals of another kind.)
"""
from __future__ import annotations

import math
import statistics
from typing import Iterable, Optional


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularised incomplete beta function (continued fraction, modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast only below the mean: use the symmetry
        return 1.0 - _incomplete_beta(1.0 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f


def t_two_sided_probability(t: float, df: float) -> float:
    """P(|T| <= t) for Student's t with `df` >= 1 degrees of freedom: the exact finite series for an
    integer `df`, the incomplete beta function for a fractional one (Welch's)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    t = abs(t)
    if df != int(df):
        return 1.0 - _incomplete_beta(df / (df + t * t), df / 2.0, 0.5)
    df = int(df)
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 1:
        if df == 1:
            return 2.0 * theta / math.pi
        term, total = c, c
        for k in range(3, df - 1, 2):  # coefficients 2/3, (2*4)/(3*5), ...
            term *= (k - 1) / k * c * c
            total += term
        return 2.0 / math.pi * (theta + s * total)
    term, total = 1.0, 1.0
    for k in range(2, df - 1, 2):  # coefficients 1/2, (1*3)/(2*4), ...
        term *= (k - 1) / k * c * c
        total += term
    return s * total


def t_quantile(confidence: float, df: float) -> float:
    """t such that P(|T| <= t) = `confidence` (e.g. 0.95 -> 4.303 for df = 2), by bisection."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    lo, hi = 0.0, 1.0
    while t_two_sided_probability(hi, df) < confidence:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_two_sided_probability(mid, df) < confidence:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


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
