"""The evaluation statistics of `cpt-finetune` and `cpt-sts`, computed by the ecosystem's tested code
(scipy.stats, sklearn.metrics); a statistic that has no value on its input is never a number.

    accuracy   sklearn.metrics.accuracy_score           undefined on no examples
    f1         sklearn.metrics.f1_score (binary)        undefined when no example is, or is predicted as,
                                                        the positive class (precision and recall both 0/0)
    matthews   sklearn.metrics.matthews_corrcoef        undefined when the predictions, or the labels, are all
                                                        one class (Gorodkin's R_K has 0 in its denominator;
                                                        scikit-learn and GLUE's scorer return 0 there)
    pearson    scipy.stats.pearsonr                     undefined with fewer than 2 pairs or a constant side
    spearman   scipy.stats.spearmanr (average ranks)    (the variance in the denominator is 0; scipy says nan)

Each function returns a float or raises `Undefined`, whose message says why (the callers record `null`
and the reason: `metric_values`). A non-finite input (a diverged model's nan) is undefined as well.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence

import numpy as np


class Undefined(ValueError):
    """The statistic has no value on this input; the message says why."""


def _count(pred: np.ndarray, gold: np.ndarray) -> int:
    if len(pred) != len(gold):
        raise ValueError(f"{len(pred)} predictions for {len(gold)} labels")
    if len(gold) == 0:
        raise Undefined("no examples")
    return len(gold)


def accuracy(pred: np.ndarray, gold: np.ndarray) -> float:
    from sklearn.metrics import accuracy_score

    _count(pred, gold)
    return float(accuracy_score(gold, pred))


def f1_binary(pred: np.ndarray, gold: np.ndarray, positive: int) -> float:
    """F1 of the class `positive` (MRPC, QQP: label 1)."""
    from sklearn.metrics import f1_score

    _count(pred, gold)
    if not np.any((np.asarray(pred) == positive) | (np.asarray(gold) == positive)):
        raise Undefined(f"no example is, or is predicted as, the positive class ({positive}): precision and "
                        "recall are both 0/0")
    # zero_division decides only a precision of 0/0 (nothing predicted positive): its F1 is then 2tp/(2tp+fp+fn) = 0
    return float(f1_score(gold, pred, pos_label=positive, average="binary", zero_division=0.0))


def matthews(pred: np.ndarray, gold: np.ndarray) -> float:
    """Matthews correlation, multi-class (Gorodkin's R_K)."""
    from sklearn.metrics import matthews_corrcoef

    _count(pred, gold)
    if len(np.unique(pred)) < 2:
        raise Undefined(f"every prediction is the same class ({np.asarray(pred)[0].item()!r}): the correlation's "
                        "denominator is 0 (scikit-learn and GLUE's scorer report 0)")
    if len(np.unique(gold)) < 2:
        raise Undefined(f"every label is the same class ({np.asarray(gold)[0]!r}): the correlation's denominator is 0")
    return float(matthews_corrcoef(gold, pred))


def _correlation(x: np.ndarray, y: np.ndarray, names: Sequence[str], compute: Callable) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n = _count(x, y)
    if n < 2:
        raise Undefined(f"{n} pair: a correlation needs at least 2")
    for values, name in ((x, names[0]), (y, names[1])):
        if not np.all(np.isfinite(values)):
            raise Undefined(f"a {name} is not finite (nan or inf)")
        if np.all(values == values[0]):
            raise Undefined(f"every {name} is equal ({values[0]:g}): a correlation with a constant is 0/0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cases scipy warns about are refused above
        value = float(compute(x, y).statistic)
    if not np.isfinite(value):  # pragma: no cover - the checks above are scipy's own conditions
        raise Undefined(f"scipy returned {value}")
    return value


def pearson(x: np.ndarray, y: np.ndarray, names: Sequence[str] = ("prediction", "label")) -> float:
    from scipy.stats import pearsonr

    return _correlation(x, y, names, pearsonr)


def spearman(x: np.ndarray, y: np.ndarray, names: Sequence[str] = ("prediction", "label")) -> float:
    from scipy.stats import spearmanr

    return _correlation(x, y, names, spearmanr)


def metric_values(compute: dict[str, Callable[[], float]]) -> tuple[dict[str, Optional[float]], dict[str, str]]:
    """({name: value, None when undefined}, {name: why undefined}) of `{name: () -> value}`."""
    values: dict[str, Optional[float]] = {}
    undefined: dict[str, str] = {}
    for name, fn in compute.items():
        try:
            values[name] = fn()
        except Undefined as why:
            values[name], undefined[name] = None, str(why)
    return values, undefined
