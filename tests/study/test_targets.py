"""Time-to-quality arithmetic: first step meeting a target, paired per-seed targets, mean curves, intervals."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipeline.study.targets import EvalPoint, first_reaching, mean_curve, seed_time_to_target, time_to_target
from pipeline.report_files import line_chart
from pipeline.stats import difference_ci, format_ci, mean_ci, t_quantile


def curve(values: list[float], metric: str = "acc", hours_per_step: float = 0.01) -> list[EvalPoint]:
    return [EvalPoint(step=100 * (i + 1), device_hours=100 * (i + 1) * hours_per_step, values={metric: v})
            for i, v in enumerate(values)]


def test_first_reaching_higher_and_lower_is_better() -> None:
    acc = curve([0.1, 0.3, 0.5, 0.4])
    assert first_reaching(acc, "acc", 0.3, higher_is_better=True).step == 200  # equality counts
    assert first_reaching(acc, "acc", 0.45, higher_is_better=True).step == 300
    assert first_reaching(acc, "acc", 0.6, higher_is_better=True) is None
    loss = curve([5.0, 4.0, 3.5], metric="loss")
    assert first_reaching(loss, "loss", 4.0, higher_is_better=False).step == 200
    assert first_reaching(list(reversed(loss)), "loss", 4.5, higher_is_better=False).step == 200  # by step


def test_points_without_the_metric_are_skipped() -> None:
    points = [EvalPoint(100, 1.0, {"loss": 3.0}), EvalPoint(200, 2.0, {"loss": 2.0, "glue": 0.7})]
    assert first_reaching(points, "glue", 0.5, True).step == 200


def test_seed_target_is_the_baselines_own_final_value_and_ratios_are_paired() -> None:
    mlm = curve([0.2, 0.6, 0.5, 0.6], hours_per_step=0.01)  # reaches its final 0.6 already at step 200
    taco = curve([0.6, 0.7, 0.7, 0.7], hours_per_step=0.02)
    r = seed_time_to_target(mlm, taco, "acc", higher_is_better=True)
    assert r["target"] == 0.6 and r["baseline_steps"] == 200 and r["steps"] == 100
    assert r["step_ratio"] == pytest.approx(0.5) and r["hours_ratio"] == pytest.approx((100 * 0.02) / (200 * 0.01))
    never = seed_time_to_target(mlm, curve([0.1, 0.2, 0.3, 0.4]), "acc", True)
    assert never["steps"] is None and never["step_ratio"] is None and never["baseline_steps"] == 200


def test_time_to_target_gives_a_mean_only_when_every_seed_reached() -> None:
    mlm = {1: curve([0.2, 0.4]), 2: curve([0.3, 0.5]), 3: curve([0.25, 0.45])}
    fast = {1: curve([0.4, 0.5]), 2: curve([0.5, 0.6]), 3: curve([0.5, 0.6])}
    result = time_to_target(mlm, fast, "acc", True)
    assert result["reached"] == 3 and result["step_ratio"]["mean"] == pytest.approx(0.5)
    assert result["step_ratio"]["half_width"] == 0.0  # every seed: 100 / 200
    assert result["target"]["mean"] == pytest.approx(0.45)
    slow = {1: curve([0.4, 0.5]), 2: curve([0.1, 0.2]), 3: curve([0.5, 0.6]), 9: curve([0.9, 0.9])}
    partial = time_to_target(mlm, slow, "acc", True)
    assert partial["seeds"] == [1, 2, 3]  # seed 9 has no paired baseline
    assert partial["reached"] == 2 and partial["steps"] is None and partial["step_ratio"] is None


def test_mean_curve_averages_seeds_per_step_with_a_t_interval() -> None:
    rows = mean_curve([curve([0.1, 0.3]), curve([0.3, 0.5]), curve([0.2, 0.4], hours_per_step=0.02)], "acc")
    assert [r["step"] for r in rows] == [100, 200]
    assert rows[0]["mean"] == pytest.approx(0.2) and rows[0]["device_hours"] == pytest.approx(4 / 3)
    assert rows[1]["half_width"] == pytest.approx(t_quantile(0.95, 2) * 0.1 / math.sqrt(3))
    assert mean_curve([curve([0.1, 0.3]), curve([0.2])], "acc")[-1]["step"] == 100  # steps every seed measured


def test_t_quantiles_are_the_tabulated_ones() -> None:
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 9: 2.262, 29: 2.045}  # t_{0.975, df}
    for df, value in table.items():
        assert t_quantile(0.95, df) == pytest.approx(value, abs=5e-4)
    assert t_quantile(0.90, 2) == pytest.approx(2.920, abs=5e-4)
    assert t_quantile(0.95, 2.5) < t_quantile(0.95, 2)  # fractional degrees of freedom (Welch's) in between
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile(0.95, 0)


def test_mean_ci_of_seeds_and_its_formatting() -> None:
    ci = mean_ci([0.80, 0.81, 0.79])
    assert ci["mean"] == pytest.approx(0.80) and ci["std"] == pytest.approx(0.01)
    assert (ci["lo"], ci["hi"]) == pytest.approx((0.80 - 4.3027 * 0.01 / math.sqrt(3), 0.80 + 4.3027 * 0.01 / math.sqrt(3)),
                                                 abs=1e-5)
    assert format_ci(ci) == "0.800 [0.775, 0.825]"
    one = mean_ci([0.7, None, float("nan")])
    assert one["mean"] == 0.7 and one["lo"] is None and one["missing"] == 2
    assert format_ci(one) == "0.700 (1 of 3)" and format_ci(mean_ci([])) == ""
    with pytest.raises(ValueError, match="confidence"):
        t_quantile(1.5, 3)


def test_line_chart_draws_bands_and_reference_lines(tmp_path: Path) -> None:
    path = tmp_path / "c.png"
    line_chart({"mlm": [(1.0, 0.2, 0.1, 0.3), (2.0, 0.4, None, None)], "taco": [(1.0, 0.3)]}, path, "t", "hours",
               "acc", hline=(0.3, "target"), hlines=[(0.25, "random init")])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_welch_difference_interval_matches_a_hand_computation() -> None:
    a, b = [0.705, 0.711, 0.683], [0.493, 0.708, 0.667]
    va, vb = 0.000217333 / 3, 0.013030333 / 3  # sample variances / n, computed by hand
    nu = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2)  # 2.067 degrees of freedom, used as they are
    ci = difference_ci(a, b)
    assert ci["df"] == pytest.approx(nu, rel=1e-5) and 2.06 < ci["df"] < 2.07
    assert ci["mean"] == pytest.approx(sum(a) / 3 - sum(b) / 3)
    assert ci["half_width"] == pytest.approx(t_quantile(0.95, nu) * math.sqrt(va + vb), rel=1e-5)
    assert t_quantile(0.95, 3) < t_quantile(0.95, nu) < t_quantile(0.95, 2)
    assert ci["lo"] < 0 < ci["mean"]  # the study's floor spreads too widely for its gain to count
    assert difference_ci([0.8, 0.81, 0.79], [0.5, 0.51, 0.49])["lo"] > 0.25
    single = difference_ci(a, [0.5])
    assert single["mean"] == pytest.approx(sum(a) / 3 - 0.5) and single["lo"] is None


@pytest.mark.parametrize("a, b", [([0.80, 0.82, 0.85], [0.60, 0.70, 0.65]), ([0.80, 0.82, 0.85, 0.83], [0.60, 0.75]),
                                  ([0.80, 0.81], [0.50, 0.70, 0.90, 0.60]), ([0.705, 0.711, 0.683], [0.493, 0.708, 0.667])])
def test_welch_interval_and_t_interval_equal_scipys(a: list[float], b: list[float]) -> None:
    """Welch's nu is fractional; the interval is scipy's (its t quantile at that nu), not the wider one of
    floor(nu) (at 3 seeds a side nu = 2.95 -> 2 made it 25% wider: t 4.30 instead of 3.19)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    ci = difference_ci(a, b)
    expected = scipy_stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert (ci["lo"], ci["hi"]) == pytest.approx((expected.low, expected.high), rel=1e-9, abs=1e-12)
    for xs in (a, b):
        m = mean_ci(xs)
        low, high = scipy_stats.t.interval(0.95, len(xs) - 1, loc=sum(xs) / len(xs), scale=scipy_stats.sem(xs))
        assert (m["lo"], m["hi"]) == pytest.approx((low, high), rel=1e-9, abs=1e-12)
