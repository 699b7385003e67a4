"""The study's `select: val/<metric>`: checked against what every objective's run logs before any job, the runs
validate on the `heldout_select` shards (eval.*), and the learning rate is the one whose last validation record
is best in the metric's direction."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.study.spec import StudyError, load_study
from pipeline.study.units import RunKey, pretrain_overrides, select_lrs

REPO = Path(__file__).resolve().parents[2]


def write_study(tmp_path: Path, select: str, train: Path, held: Path, objectives: str = "mlm: {preset: tiny-mlm}",
                lrs: str = "[1.0e-3]") -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(f"""name: sel
work_dir: {tmp_path / 'work'}
objectives: {{{objectives}}}
seeds: [1]
lrs: {lrs}
warmup_ratio: 0.25
budget: {{steps: 4}}
eval_every: 2
shards: {{train: {train}, heldout_select: {held}, heldout_report: {held}}}
eval_sequences: 16
resources: {{pretrain: {{nodes: 1, ntasks_per_node: 1}}}}
""" + (f"select: {select}\n" if select else ""))
    return path


@pytest.mark.parametrize("select, message", [
    ("mlm_head/loss", "give a validation metric, val/<term>"),
    ("val/mlm_head/positions", "its direction is unknown"),
    ("val/taco/loss", "objectives.mlm does not log it"),  # mlm's run logs no taco term
    ("val/nope/accuracy", "objectives.mlm does not log it"),
])
def test_a_select_metric_no_run_logs_is_refused_naming_the_field(tmp_path, select, message) -> None:
    path = write_study(tmp_path, select, tmp_path / "train", tmp_path / "held",
                       objectives="mlm: {preset: tiny-mlm}, taco: {preset: tiny-taco}")
    with pytest.raises(StudyError) as err:
        load_study(path, check_data=False)
    assert f"select: {select}" in str(err.value) and message in str(err.value)
    assert not (tmp_path / "work").exists()  # refused before anything


def test_select_sets_eval_on_the_selection_half(tmp_path) -> None:
    path = write_study(tmp_path, "val/mlm_head/loss", tmp_path / "train", tmp_path / "held",
                       objectives="mlm: {preset: tiny-mlm}, taco: {preset: tiny-taco}")
    study = load_study(path, check_data=False)
    overrides = pretrain_overrides(study, RunKey("taco", 1e-3, 1))
    assert f"eval.shards_dir={tmp_path / 'held'}" in overrides and "eval.every=2" in overrides
    owned = write_study(tmp_path, "val/mlm_head/loss", tmp_path / "train", tmp_path / "held",
                        objectives="mlm: {preset: tiny-mlm, overrides: [eval.every=1]}")
    with pytest.raises(StudyError, match=r"objectives.mlm.overrides: \['eval.every=1'\]: with select the study sets"):
        load_study(owned, check_data=False)
    plain = load_study(write_study(tmp_path, "", tmp_path / "train", tmp_path / "held"), check_data=False)
    assert not any(o.startswith("eval.") for o in pretrain_overrides(plain, RunKey("mlm", 1e-3, 1)))


def _run(value: dict, status: str = "ok") -> dict:
    return {"status": status, "train": {"status": status, "validation": value}, "final": None}


def test_selection_on_a_validation_metric_follows_its_direction() -> None:
    sweep = {"mlm": {1e-4: _run({"step": 8, "val/mlm_head/loss": 5.0, "val/mlm_head/accuracy": 0.30}),
                     1e-3: _run({"step": 8, "val/mlm_head/loss": 4.0, "val/mlm_head/accuracy": 0.20}),
                     3e-3: _run({"step": 8, "val/mlm_head/loss": 1.0, "val/mlm_head/accuracy": 0.90}, "failed"),
                     1e-2: _run(None)}}
    by_loss = select_lrs(sweep, "val/mlm_head/loss")["mlm"]
    # the lowest loss; a failed run and one without a validation record are no candidates
    assert by_loss["lr"] == 1e-3 and by_loss["values"] == {"0.0001": 5.0, "0.001": 4.0}
    assert select_lrs(sweep, "val/mlm_head/accuracy")["mlm"]["lr"] == 1e-4  # highest


@pytest.mark.timeout(600)
def test_runs_of_a_select_study_record_their_last_validation(tiny_corpus_file, tiny_tokenizer_dir, tmp_path,
                                                             monkeypatch) -> None:
    """Two real tiny runs validate on the selection half; train.json keeps the last val/ record (the training
    steps are counted once each, the val/ records apart), and the selection picks the lower held-out loss."""
    from data_prep.build_shards import build_shards
    from pipeline.study.local import train_run

    shards = tmp_path / "shards"
    build_shards([tiny_corpus_file], tiny_tokenizer_dir, shards, seq_len=64, shard_size_mb=0.02, num_proc=1,
                 progress=False, holdout_fraction=0.2)
    monkeypatch.chdir(REPO)  # the training children import `pipeline` from the checkout
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with pytest.raises(StudyError) as err:  # the runs would refuse it as eval.shards_dir: the study does, first
        load_study(write_study(tmp_path, "val/mlm_head/loss", shards, shards))
    assert "shards.heldout_select" in str(err.value) and "the training data itself" in str(err.value)
    study = load_study(write_study(tmp_path, "val/mlm_head/loss", shards, shards / "validation",
                                   lrs="[1.0e-4, 3.0e-3]"))
    sweep = {"mlm": {}}
    for lr in study.lrs:
        record = train_run(study, RunKey("mlm", lr, 1))
        assert record["status"] == "ok" and record["counted_steps"] == 4 and record["steps"] == [2, 4]
        assert record["validation"]["step"] == 4 and record["validation"]["val/mlm_head/loss"] > 0
        sweep["mlm"][lr] = {"status": "ok", "train": record}
    chosen = select_lrs(sweep, "val/mlm_head/loss")["mlm"]
    values = {lr: sweep["mlm"][lr]["train"]["validation"]["val/mlm_head/loss"] for lr in study.lrs}
    assert chosen["lr"] == min(values, key=values.get)
