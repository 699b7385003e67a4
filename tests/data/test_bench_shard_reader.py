"""`benchmarks/data/bench_shard_reader.py` at a tiny size: every framing is timed in every round, and the
report carries every measure with its paired stream / file ratio and the control's noise, each as the
median and 10th / 90th percentiles of the per-round ratios."""
from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.data.bench_shard_reader import interleaved_times, main


def test_tiny_run_reports_every_paired_ratio(tmp_path):
    out = tmp_path / "out"
    assert main(["--shards", "2", "--rows", "64", "--seq-len", "16", "--batch", "8", "--batches", "3",
                 "--singles", "20", "--trials", "5", "--out", str(out)]) == 0
    report = json.loads((out / "shard_reader.json").read_text())
    rows = {row["framing"]: row for row in report["rows"]}
    times = report["round_times_s"]
    file, stream = rows["file (before)"], rows["stream (now)"]
    for measure, kind, work in (("take_rows_per_s", "take", 8 * 3), ("single_rows_per_s", "single", 20)):
        for name, row in (("file (before)", file), ("stream (now)", stream)):
            assert len(times[f"{name} / {kind}"]) == 5
            assert row[measure] == pytest.approx(work / np.median(times[f"{name} / {kind}"]), rel=0.01, abs=1)
    for measure, kind in (("open_s", "open"), ("take_rows_per_s", "take"), ("single_rows_per_s", "single")):
        paired = np.asarray(times[f"file (before) / {kind}"]) / np.asarray(times[f"stream (now) / {kind}"])
        noise = np.asarray(times[f"stream (now) / {kind}"]) / np.asarray(times[f"stream-copy (control) / {kind}"])
        for statistic, q in (("median", 50), ("p10", 10), ("p90", 90)):
            assert rows[f"ratio stream/file (speed), {statistic}"][measure] == pytest.approx(np.percentile(paired, q),
                                                                                            abs=0.001)
            assert rows[f"ratio control/stream (noise), {statistic}"][measure] == pytest.approx(
                np.percentile(noise, q), abs=0.001)
    assert (out / "shard_reader.md").is_file()


def test_rounds_rotate_the_order_of_the_framings():
    """No framing always runs first: the position in the round moves by one each round."""
    order: list[str] = []
    fns = {(framing, "k"): (lambda framing=framing: order.append(framing)) for framing in ("a", "b", "c")}
    times = interleaved_times(3, ["a", "b", "c"], ["k"], fns)
    assert all(len(t) == 3 for t in times.values())  # the warm-up round is not timed
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
