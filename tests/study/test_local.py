"""`cpt-study run`: the tiny study (2 objectives x 2 seeds x 1 learning rate, 2 evaluation points, 1 task, STS)
through the local executor, over the units and result files the SLURM executor uses (tests/slurm/test_study.py
runs the same file on a cluster): every unit leaves its file, `collect` reads the report back from them,
and a second run trains and evaluates nothing."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.study.cli import main
from tests.eval.conftest import write_sts

REPO = Path(__file__).resolve().parents[2]
STUDY = REPO / "studies" / "tiny.yaml"


def _study_environment(shards: Path, tmp_path: Path, monkeypatch) -> Path:
    """The tiny study's data (an SST-2-layout task, an STS-B dir, the shards) in its environment variables, run
    from the checkout; returns the work directory."""
    task = tmp_path / "sst2"
    task.mkdir()
    rows = [(f"sentence number {i} is {'good' if i % 2 else 'bad'}", i % 2) for i in range(40)]
    for split, part in (("train", rows), ("dev", rows[:10]), ("test", rows[10:20])):
        (task / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in part))
    work = tmp_path / "work"
    monkeypatch.chdir(REPO)  # the training children import `pipeline` from the checkout
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    sts = write_sts(tmp_path / "sts-b", n_pairs=30)
    for name, value in (("CPT_STUDY_SHARDS", shards), ("CPT_STUDY_TASK", task), ("CPT_STUDY_WORK", work),
                        ("CPT_STUDY_STS", sts)):
        monkeypatch.setenv(name, str(value))
    return work


@pytest.mark.timeout(900)
def test_the_tiny_study_runs_locally_over_the_slurm_units(tiny_shards_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from pipeline.study.results import selected_keys, selection, sweep_keys
    from pipeline.study.spec import load_study
    from pipeline.study.units import final_files, point_done

    work = _study_environment(tiny_shards_dir, tmp_path, monkeypatch)

    assert main(["run", str(STUDY)]) == 0
    study = load_study(STUDY)
    chosen, metric = selection(study)
    assert metric == "sst2_select_accuracy" and {o: s["lr"] for o, s in chosen.items()} == {"mlm": 1e-3, "taco": 1e-3}
    keys = selected_keys(study, chosen)
    assert [k.name for k in keys] == ["mlm/lr0.001/seed1", "mlm/lr0.001/seed2", "taco/lr0.001/seed1", "taco/lr0.001/seed2"]
    assert all(point_done(study, k, s, curves=True) for k in keys for s in study.eval_steps(k.objective))
    assert all(p.is_file() for k in keys for p in final_files(study, k))
    seq_len = json.loads((tiny_shards_dir / "manifest.json").read_text())["seq_len"]
    for key in [*sweep_keys(study), *keys]:
        run_dir = key.directory(work)
        record = json.loads((run_dir / "train.json").read_text())
        assert record["status"] == "ok" and record["steps"] == [4, 8] and record["counted_steps"] == 8
        assert not (run_dir / "checkpoints").exists()  # keep_checkpoints: false, every point converted
        # the checkpoints' tokens_seen: 8 packed rows (tiny-mlm's global batch) of seq_len non-padding tokens a step
        assert record["tokens"] == {"4": 4 * 8 * seq_len, "8": 8 * 8 * seq_len}
        for step in (4, 8):  # zero-shot STS at every point, measured as cpt-sts measures it
            point = json.loads((run_dir / "eval" / f"sts_step_{step}.json").read_text())
            assert set(point["splits"]) == {"dev", "test"} and point["settings"]["bootstrap"] == 20
            test = point["splits"]["test"]
            assert test["n_pairs"] == 30 and len(test["model"]["interval"]) == 2
            assert {"random_init", "input_embeddings", "token_overlap"} <= set(test)
    report = json.loads((work / "report" / "sst2" / "time_to_quality.json").read_text())
    assert report["task"] == "sst2" and report["floor"] is not None
    assert sorted(r["run"] for r in report["gpu_seconds"]) == [k.name for k in keys]
    # STS in the report: a column per split, the floors as rows, the comparison with MLM, the plots by tokens too
    summary = {r["objective"]: r for r in report["rows"]}
    assert summary["taco"]["sts_test"] and summary["mlm"]["sts_dev"]
    assert {"token overlap (STS floor)", "random init (STS floor)"} <= set(summary)
    compared = report["sts_comparison"]
    assert {(r["objective"], r["split"], r["basis"]) for r in compared} == {
        ("taco", s, b) for s in ("test", "dev") for b in ("equal budget", "matched compute")} | {
        ("taco", "test", "selected on dev")}
    assert all(r["separates"] in ("higher", "lower", "no") for r in compared if "separates" in r)
    assert (work / "report" / "sst2" / "time_to_quality_sts.md").is_file()
    assert (work / "report" / "sst2" / "time_to_quality_sts_test_vs_tokens.png").is_file()

    logs = {p: p.stat().st_size for p in work.glob("runs/*/*/*/train.log")}
    results = {p: p.stat().st_mtime_ns for p in work.glob("runs/**/*.json")}
    assert len(logs) == 4 and main(["run", str(STUDY)]) == 0  # finished: nothing trains or evaluates again
    assert {p: p.stat().st_size for p in logs} == logs
    assert {p: p.stat().st_mtime_ns for p in results} == results


@pytest.mark.timeout(900)
def test_cocolm_against_electra_is_one_local_study(tiny_shards_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """Issue 59: COCO-LM vs ELECTRA is one `cpt-study` — the tiny study with `electra` and `cocolm` beside `mlm`
    runs end to end: each ELECTRA run is converted with its generator (`generator/`, fingerprinted), its
    held-out masked-LM numbers are read through that generator, and the report holds the COCO-LM-vs-ELECTRA
    row beside every objective's row against MLM."""
    study_file = tmp_path / "tiny-electra.yaml"
    text = STUDY.read_text()
    assert "  taco: {preset: tiny-taco}\n" in text
    study_file.write_text(text.replace("name: tiny\n", "name: tiny-electra\n").replace(
        "  taco: {preset: tiny-taco}\n", "  electra: {preset: tiny-electra}\n  cocolm: {preset: tiny-cocolm}\n"))
    work = _study_environment(tiny_shards_dir, tmp_path, monkeypatch)

    assert main(["run", str(study_file)]) == 0
    electra_runs = sorted(work.glob("runs/electra/*/*"))
    assert len(electra_runs) == 2
    for run_dir in electra_runs:
        assert json.loads((run_dir / "train.json").read_text())["status"] == "ok"
        exports = [p.parent.parent for p in run_dir.glob("**/generator/config.json")]
        assert exports, f"{run_dir}: no ELECTRA export with its generator"
        architectures = json.loads((exports[0] / "config.json").read_text())["architectures"]
        assert architectures == ["ElectraForPreTraining"]
    report = json.loads((work / "report" / "sst2" / "time_to_quality.json").read_text())
    pairs = {(r["objective"], r["against"]) for r in report["targets"]}
    assert ("cocolm", "electra") in pairs and ("electra", "mlm") in pairs and ("cocolm", "mlm") in pairs
    assert ("mlm", "electra") not in pairs
    # the COCO-LM-vs-ELECTRA ratios follow ELECTRA's own health check, not MLM's
    assert set(report["paper_baseline_health"]) == {"electra"}
    electra_healthy = report["paper_baseline_health"]["electra"]["passed"]
    for row in (r for r in report["targets"] if r["against"] == "electra"):
        assert (row["hours_ratio"] == "refused: electra (the baseline) failed its health check") != electra_healthy
    finals = {r["objective"]: r for r in report["rows"]}
    assert finals["electra"]["heldout_mlm_acc"] and finals["cocolm"]["heldout_mlm_acc"]
