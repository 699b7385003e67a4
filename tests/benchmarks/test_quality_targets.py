"""Time-to-quality arithmetic: first step meeting a target, default target, ratios, plotting data."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.quality_targets import EvalPoint, curve_series, first_reaching, summarize_targets
from benchmarks.report import line_chart


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


def test_summary_defaults_target_to_baseline_final_and_gives_ratios() -> None:
    curves = {
        "mlm": curve([0.2, 0.3, 0.4, 0.5, 0.6], hours_per_step=0.01),
        "taco": curve([0.3, 0.6, 0.7, 0.7, 0.8], hours_per_step=0.011),
        "capt": curve([0.1, 0.2, 0.3, 0.4, 0.5], hours_per_step=0.02),
    }
    rows = {r["run"]: r for r in summarize_targets(curves, "acc", higher_is_better=True)}
    assert rows["mlm"]["target"] == 0.6 and rows["mlm"]["steps_to_target"] == 500
    assert rows["mlm"]["step_ratio_vs_baseline"] == 1.0
    assert rows["taco"]["steps_to_target"] == 200
    assert rows["taco"]["step_ratio_vs_baseline"] == pytest.approx(200 / 500)
    assert rows["taco"]["hours_ratio_vs_baseline"] == pytest.approx((200 * 0.011) / (500 * 0.01))
    assert rows["capt"]["steps_to_target"] is None and rows["capt"]["step_ratio_vs_baseline"] is None
    assert rows["capt"]["final"] == 0.5


def test_explicit_target_and_errors() -> None:
    curves = {"mlm": curve([0.2, 0.4]), "taco": curve([0.35, 0.5])}
    rows = {r["run"]: r for r in summarize_targets(curves, "acc", True, target=0.3)}
    assert rows["mlm"]["steps_to_target"] == 200 and rows["taco"]["steps_to_target"] == 100
    assert rows["taco"]["step_ratio_vs_baseline"] == 0.5
    with pytest.raises(ValueError, match="baseline run 'mlm'"):
        summarize_targets({"taco": curves["taco"]}, "acc", True)
    with pytest.raises(ValueError, match="no 'glue' measurement"):
        summarize_targets(curves, "glue", True)


def test_curve_series_and_chart(tmp_path: Path) -> None:
    series = curve_series({"mlm": curve([0.2, 0.4])}, "acc", x="device_hours")
    assert series == {"mlm": [(1.0, 0.2), (2.0, 0.4)]}
    with pytest.raises(ValueError, match="x must be"):
        curve_series({}, "acc", x="epoch")
    path = tmp_path / "c.png"
    line_chart(series, path, "t", "hours", "acc", hline=(0.3, "target"))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
