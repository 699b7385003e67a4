"""`benchmarks/throughput/bench_step_ab.py` at a tiny size, this tree against itself: each objective's
row has one CPU step time per round and tree, their medians, and after / before computed from them."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks.throughput.bench_step_ab import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_ab_run_reports_the_ratio_of_the_medians(tmp_path):
    shards = tmp_path / "shards"  # absent: the script writes synthetic shards of this length there
    out = tmp_path / "out"
    assert main(["--before", str(REPO), "--after", str(REPO), "--shards", str(shards), "--seq-len", "32",
                 "--objectives", "taco", "--size", "tiny", "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--rounds", "1",
                 "--out", str(out), "--name", "ab"]) == 0
    assert (shards / "manifest.json").is_file()
    report = json.loads((out / "ab.json").read_text())
    assert report["meta"]["size"] == "tiny" and "bench_step_ab.py --before" in report["meta"]["command"]
    (row,) = report["rows"]
    assert row["objective"] == "taco" and len(row["before_runs"]) == len(row["after_runs"]) == 1
    assert row["before_s"] == statistics.median(row["before_runs"]) > 0
    assert row["after_s"] == statistics.median(row["after_runs"]) > 0
    assert row["after_over_before"] == pytest.approx(row["after_s"] / row["before_s"])
    md = (out / "ab.md").read_text()
    assert f"| taco | {row['before_s']:.4f} | {row['after_s']:.4f} | {row['after_over_before']:.3f} |" in md
