"""`benchmarks/data/bench_data_path.py` at a tiny size: every objective's row carries both rates
(one worker, the loader) and its ratios to what BERT-large consumes, computed from those rates."""
from __future__ import annotations

import json
import math

import pytest

from benchmarks.data.bench_data_path import consumed_tokens_per_s, main


def test_consumption_is_bert_large_at_half_an_h100():
    # 50% MFU of one H100 over BERT-large's training FLOPs per token (the module docstring's 248k / 263k)
    assert consumed_tokens_per_s(512) == pytest.approx(248e3, rel=0.01)
    assert consumed_tokens_per_s(128) == pytest.approx(263e3, rel=0.01)


def test_tiny_run_reports_each_objective_with_its_ratios(tmp_path):
    out = tmp_path / "out"
    assert main(["--objectives", "mlm,taco", "--seq-lens", "32", "--tokens-per-batch", "128", "--seconds", "0.3",
                 "--workers", "1", "--vocab-size", "1001", "--work-dir", str(tmp_path / "work"), "--out", str(out),
                 "--name", "dp"]) == 0
    report = json.loads((out / "dp.json").read_text())
    assert "bench_data_path.py --objectives mlm,taco" in report["meta"]["command"] and report["meta"]["workers"] == 1
    rows = report["rows"]
    assert [(r["objective"], r["seq_len"], r["micro_batch"]) for r in rows] == [("mlm", 32, 4), ("taco", 32, 4)]
    for r in rows:
        consumed = consumed_tokens_per_s(32, vocab=1001)
        assert r["consumed_tokens_per_s"] == pytest.approx(consumed)
        assert r["per_worker_tokens_per_s"] > 0 and r["loader_tokens_per_s"] > 0
        assert r["ratio_per_worker"] == pytest.approx(r["per_worker_tokens_per_s"] / consumed)
        assert r["ratio_loader"] == pytest.approx(r["loader_tokens_per_s"] / consumed)
        assert r["workers_for_4x"] == math.ceil(4 * consumed / r["per_worker_tokens_per_s"])
    md = (out / "dp.md").read_text()
    assert md.startswith("# Data path") and md.count("\n| mlm | 32 | 4 |") == 1 and "| taco | 32 | 4 |" in md
