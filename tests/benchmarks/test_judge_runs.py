"""`benchmarks.quality.judge_runs`: a finished run's learning signals judged from its `metrics.jsonl` (each
term against its reference over the last 20% of the logged steps, still improving or flat), and the report
it writes."""
from __future__ import annotations

import json

from benchmarks.quality.judge_runs import judge_run, main


def _write_run(path, auc_end: float, cosine: float, steps: int = 100):
    path.mkdir(parents=True)
    rows = [{"step": s, "loss": 1.0, "electra/rtd_auc": 0.5 + (auc_end - 0.5) * s / steps, "electra/rtd_auc_chance": 0.5,
             "electra/gen_accuracy": 0.05 + 0.1 * s / steps, "health/unigram_accuracy": 0.05,
             "health/token_cosine": cosine} for s in range(1, steps + 1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_learning_run_and_a_collapsed_one(tmp_path):
    good = judge_run(_write_run(tmp_path / "good", auc_end=0.8, cosine=0.5), None, None, 0,
                     ("electra/rtd_auc",), every=10)
    assert good["learned"] == {"electra/rtd_auc": True, "electra/gen_accuracy": True, "health/token_cosine": True}
    assert good["still_improving"]["electra/rtd_auc"] is True
    assert [p[0] for p in good["curves"]["electra/rtd_auc"]] == list(range(10, 101, 10))
    bad = judge_run(_write_run(tmp_path / "bad", auc_end=0.52, cosine=0.99), None, None, 0, ("electra/rtd_auc",), 10)
    assert bad["learned"]["electra/rtd_auc"] is False and bad["learned"]["health/token_cosine"] is False


def test_report_files(tmp_path):
    runs = [_write_run(tmp_path / f"s{i}", 0.8, 0.5) for i in (1, 2)]
    assert main(["--run", "electra=" + ",".join(map(str, runs)), "--out", str(tmp_path / "out"), "--name", "e"]) == 0
    report = json.loads((tmp_path / "out" / "e.json").read_text())
    assert [r["seed"] for r in report["rows"]] == [1, 2] and "learned (still improving)" in report["rows"][0]["electra/rtd_auc"]
    assert (tmp_path / "out" / "e.png").is_file() and (tmp_path / "out" / "e.md").is_file()
