"""`cpt-finetune`'s table and verdict (`pipeline.eval.finetune_report`), read from records like the ones
`pipeline.eval.finetune` writes: the intervals come from the record, the side from the gain's interval, and
an undefined value is never printed as a number."""
from __future__ import annotations

import math

import pytest

from pipeline.eval.finetune import gain_intervals, intervals, summarise
from pipeline.eval.finetune_report import render, verdict
from pipeline.stats import difference_ci


def _runs(values: list[float | None], name: str = "accuracy") -> list[dict]:
    return [{"seed": i + 1, "metrics": {name: v}} for i, v in enumerate(values)]


def _record(pre: list, rand: list | None) -> dict:
    runs = _runs(pre)
    mean, std, undefined = summarise(runs)
    out = {"model": "m", "task": "sst2", "task_dir": "t", "n_train": 100, "metric": "accuracy",
           "seeds": [r["seed"] for r in runs], "runs": runs, "mean": mean, "std": std,
           "interval": intervals(runs, mean), **({"undefined": undefined} if undefined else {})}
    if rand is not None:
        base = _runs(rand)
        r_mean, r_std, r_undefined = summarise(base)
        out["random_init"] = {"runs": base, "mean": r_mean, "std": r_std, "interval": intervals(base, r_mean),
                              **({"undefined": r_undefined} if r_undefined else {})}
        gain = {k: None if mean[k] is None or r_mean[k] is None else mean[k] - r_mean[k] for k in mean}
        out["pretraining_gain"] = gain
        out["pretraining_gain_interval"] = gain_intervals(runs, base, gain)
    return out


def test_a_clear_gain_reads_helps_with_the_welch_interval_in_the_table():
    record = _record([0.90, 0.92, 0.91], [0.60, 0.64, 0.62])
    ci = difference_ci([0.90, 0.92, 0.91], [0.60, 0.64, 0.62])
    assert record["pretraining_gain_interval"]["accuracy"] == pytest.approx([ci["lo"], ci["hi"]])
    text = render(record)
    assert f"+0.290 [{ci['lo']:.3f}, {ci['hi']:.3f}]" in text
    assert "accuracy per seed: 1: 0.900, 2: 0.920, 3: 0.910" in text
    assert text.splitlines()[-1].startswith("verdict: pretraining helps on accuracy (gain +0.290")


def test_overlapping_seeds_are_not_told_apart_and_a_loss_reads_hurts():
    assert "not told apart" in verdict(_record([0.70, 0.80, 0.60], [0.72, 0.62, 0.68]))
    assert verdict(_record([0.50, 0.51, 0.52], [0.80, 0.81, 0.82])).startswith("verdict: pretraining hurts")


def test_one_seed_claims_no_side_and_prints_no_interval():
    record = _record([0.9], [0.6])
    assert record["interval"] == {"accuracy": None} and record["pretraining_gain_interval"] == {"accuracy": None}
    text = render(record)
    assert "no side claimed: an interval needs at least two seeds" in text
    assert "undefined: interval: one seed" in text and "[" not in text.split("\n")[1]


def test_an_undefined_metric_is_the_word_with_its_reason_never_a_number():
    text = render(_record([None, 0.8], [0.5, 0.6]))
    assert "undefined" in text.split("\n")[2] and "nan" not in text and "0.000" not in text
    assert "undefined on seed(s) 1" in text
    assert verdict(_record([None, 0.8], [0.5, 0.6])).startswith("verdict: none: the accuracy gain is undefined")


def test_without_a_random_init_baseline_no_verdict_is_claimed():
    text = render(_record([0.9, 0.8], None))
    assert "random init" not in text.split("\n")[1] and "--random-init was not run" in text.splitlines()[-1]
    lo, hi = _record([0.9, 0.8], None)["interval"]["accuracy"]
    assert not math.isnan(lo) and lo < 0.85 < hi


def test_identical_seeds_on_both_sides_claim_no_side():
    """Every seed of both models at one value: Welch's interval has zero width (scipy's too), which would read
    as 'helps' with certainty; the seeds measured no spread, so no side is claimed and the line says why."""
    record = _record([0.90, 0.90, 0.90], [0.50, 0.50, 0.50])
    assert record["pretraining_gain_interval"]["accuracy"] == pytest.approx([0.4, 0.4])
    line = verdict(record)
    assert line.startswith("verdict: accuracy gain +0.400, no side claimed: every seed gave the same accuracy")
    assert "helps" not in line
    assert verdict(_record([0.90, 0.90, 0.91], [0.50, 0.50, 0.50])).startswith("verdict: pretraining helps")


def test_a_gain_undefined_on_the_random_init_side_gives_that_sides_reason():
    line = verdict(_record([0.90, 0.80], [0.50, None]))
    assert line == ("verdict: none: the accuracy gain is undefined (random init: undefined on seed(s) 2 "
                    "(their `undefined` says why))")


def test_the_seeds_own_reasons_and_the_eval_files_main_metric_are_printed():
    """The summary line says 'their `undefined` says why': the seeds' reasons follow it (one line per reason), and
    a labelled --eval-file's main metric per seed is in the person's output, not only in the JSON."""
    record = _record([0.90, None, None], None)
    why = "every prediction is the same class (0): the correlation's denominator is 0"
    for run in record["runs"][1:]:
        run["undefined"] = {"accuracy": why}
    for run, value in zip(record["runs"], (0.8, None, 0.6)):
        run["eval_file_metrics"] = {"extra": {"accuracy": value}}
    text = render(record)
    assert f"  accuracy on seed(s) 2, 3: {why}" in text.splitlines()
    assert "accuracy per seed on eval file extra: 1: 0.800, 2: undefined, 3: 0.600" in text.splitlines()
