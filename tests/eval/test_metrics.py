"""The evaluation statistics (`pipeline.eval.metrics`): equal to scikit-learn / scipy on normal input,
and never a number where they are undefined (one pair, constant scores, one predicted class, no
examples), in `task_metrics` (cpt-finetune) as in `cpt-sts` (tests/eval/test_sts_degenerate.py)."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from sklearn import metrics as sk

from pipeline.eval import metrics
from pipeline.eval.glue import GLUE_TASKS, TaskSpec, task_metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equal_to_sklearn_and_scipy_on_normal_input(seed):
    rng = np.random.default_rng(seed)
    gold = rng.integers(0, 2, 200)
    pred = np.where(rng.random(200) < 0.7, gold, 1 - gold)
    assert metrics.accuracy(pred, gold) == sk.accuracy_score(gold, pred)
    assert metrics.f1_binary(pred, gold, 1) == sk.f1_score(gold, pred)
    assert metrics.matthews(pred, gold) == sk.matthews_corrcoef(gold, pred)
    gold3, pred3 = rng.integers(0, 3, 300), rng.integers(0, 3, 300)
    assert metrics.matthews(pred3, gold3) == sk.matthews_corrcoef(gold3, pred3)
    x = rng.normal(size=100)
    y = np.round(0.5 * x + rng.normal(size=100))  # many ties: average ranks matter
    assert metrics.pearson(x, y) == stats.pearsonr(x, y).statistic
    assert metrics.spearman(x, y) == stats.spearmanr(x, y).statistic
    # F1 where nothing is predicted positive but positives exist is defined: 0
    assert metrics.f1_binary(np.zeros(4, int), np.array([0, 1, 0, 1]), 1) == 0.0


@pytest.mark.parametrize("x, y, says", [
    ([0.5], [3.0], "1 pair: a correlation needs at least 2"),
    ([0.2, 0.2, 0.2], [1.0, 2.0, 3.0], "every prediction is equal (0.2)"),
    ([0.1, 0.2, 0.3], [4.0, 4.0, 4.0], "every label is equal (4)"),
    ([0.1, float("nan"), 0.3], [1.0, 2.0, 3.0], "a prediction is not finite"),
    ([], [], "no examples"),
])
def test_correlations_are_undefined_not_zero(x, y, says):
    for fn in (metrics.pearson, metrics.spearman):
        with pytest.raises(metrics.Undefined) as err:
            fn(np.array(x), np.array(y))
        assert says in str(err.value)


def test_classification_metrics_are_undefined_not_zero():
    one_class = np.zeros(6, int)
    gold = np.array([0, 1, 0, 1, 1, 0])
    with pytest.raises(metrics.Undefined, match=r"every prediction is the same class \(0\):"):  # 0, not np.int64(0)
        metrics.matthews(one_class, gold)  # scikit-learn says 0.0 here
    assert sk.matthews_corrcoef(gold, one_class) == 0.0
    with pytest.raises(metrics.Undefined, match="every label is the same class"):
        metrics.matthews(gold, one_class)
    with pytest.raises(metrics.Undefined, match="positive class"):
        metrics.f1_binary(one_class, one_class, 1)
    with pytest.raises(metrics.Undefined, match="no examples"):
        metrics.accuracy(np.zeros(0, int), np.zeros(0, int))


def test_task_metrics_record_null_and_the_reason():
    """What cpt-finetune reports for a one-example STS-B dev set and for a model that answers one class:
    the old hand-written Pearson and MCC said 0.0 there."""
    values, undefined = task_metrics(GLUE_TASKS["stsb"], np.array([2.5]), np.array([3.0]))
    assert values == {"pearson": None, "spearman": None}
    assert undefined["pearson"] == "1 pair: a correlation needs at least 2"
    spec = TaskSpec(("sentence",), "label", ("0", "1"), ("accuracy", "f1", "matthews"))
    values, undefined = task_metrics(spec, np.ones(4, int), np.array([0, 1, 1, 0]))
    assert values == {"accuracy": 0.5, "f1": pytest.approx(2 / 3), "matthews": None}
    assert list(undefined) == ["matthews"] and "same class" in undefined["matthews"]
