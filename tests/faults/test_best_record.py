"""Work lost, issue 57: the best checkpoint (`train.keep_best`) is never forgotten, never confused with a
worse one, never pruned, whatever happened to `checkpoints/best.json` (truncated, deleted, naming a tag that
is not there, edited) before a resume or during a run; and a validation set changed on resume starts a new
best lineage (one line), its predecessor's best kept. The stream of metric values goes through the
`Checkpointer` on a fake engine (tests/train/test_checkpoint_best.py), so which step is the best is known
exactly; `pipeline.train.checkpoint.best_resume` reconciles the sources on resume."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from pipeline.train.checkpoint.tags import COMPLETE_FILE, list_tags
from pipeline.train.checkpoint.best import BEST_FILE, read_best
from pipeline.train.checkpoint.checkpointer import Checkpointer
from pipeline.train.checkpoint.tags import ResumeTarget, TrainState
from pipeline.train.run_meta import META_FILE, RunMeta
from pipeline.train.validation import EVAL_SET_KEY
from tests.train.test_checkpoint_best import FakeModel, FakeRun, LoadingEngine, steps_on_disk, train_cfg

FIRST = {2: 5.0, 4: 3.0, 6: 4.0, 8: 3.5}  # the best: step 4 (3.0)
LATER = {14: 3.5, 16: 3.2, 18: 4.5}  # all worse than 3.0: the best stays step 4


def walk(checkpointer: Checkpointer, run: FakeRun, steps: range, stream: dict[int, float], eval_set: str = "A",
         metrics_file: Path | None = None) -> None:
    """Steps with `stream`'s values observed (and, like the run's writer, appended to `metrics_file`)."""
    for step in steps:
        run.state.step = step
        if step in stream:
            values = {"val/loss": stream[step], EVAL_SET_KEY: eval_set}
            if metrics_file is not None:
                with metrics_file.open("a") as fh:
                    fh.write(json.dumps({"step": step, **values}) + "\n")
            checkpointer.observe_metric(step, values)
        checkpointer.step_end(run, step, False, {"loss": 9.0})
    checkpointer.settle()


def first_run(out: Path, metrics: bool = True) -> Path:
    """Steps 1-12 (checkpoint every 3, keep_last=1) of a run whose best is step 4; its checkpoints directory."""
    walk(Checkpointer(train_cfg(out, total_steps=20), is_main=True), FakeRun(TrainState()), range(1, 13), FIRST,
         metrics_file=out / "metrics.jsonl" if metrics else None)
    root = out / "checkpoints"
    assert steps_on_disk(root) == [4, 9, 12] and read_best(root).tag == "step_00000004"
    return root


def resume(out: Path, step: int, eval_set: str = "A", **fields) -> tuple[Checkpointer, TrainState]:
    checkpointer = Checkpointer(train_cfg(out, total_steps=20, **fields), is_main=True)
    tag = out / "checkpoints" / f"step_{step:08d}"
    state = checkpointer.load(LoadingEngine(), ResumeTarget(tag, RunMeta.read(tag), universal=False), FakeModel(),
                              eval_set, "held")
    return checkpointer, state


def damage(root: Path, how: str) -> None:
    path = root / BEST_FILE
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        path.write_text(path.read_text()[:17])
    elif how == "names a missing tag":
        path.write_text(json.dumps({**json.loads(path.read_text()), "tag": "step_00000007", "step": 7}))
    elif how == "edited":  # a lie: a better value at another complete tag
        path.write_text(json.dumps({**json.loads(path.read_text()), "tag": "step_00000009", "step": 9, "value": 0.5}))


@pytest.mark.parametrize("how", ["deleted", "truncated", "names a missing tag", "edited"])
def test_a_damaged_best_record_is_rebuilt_on_resume_and_the_best_tag_survives_pruning(tmp_path, how, caplog):
    root = first_run(tmp_path)
    damage(root, how)
    with caplog.at_level(logging.WARNING):
        checkpointer, state = resume(tmp_path, 12)
    assert checkpointer.best.tag == "step_00000004" and checkpointer.best.value == 3.0
    assert read_best(root) == checkpointer.best  # rewritten
    lines = [r.getMessage() for r in caplog.records if BEST_FILE in r.getMessage()]
    assert len(lines) == 1 and "rebuilt from the checkpoint at step 12: step_00000004" in lines[0], lines
    walk(checkpointer, FakeRun(state), range(13, 21), LATER)
    assert 4 in steps_on_disk(root) and read_best(root).tag == "step_00000004"  # keep_last=1 did not take it


def test_without_the_checkpoints_own_record_it_is_rebuilt_from_metrics_jsonl(tmp_path, caplog):
    """A checkpoint from before tags recorded their best (`RunMeta.best`), `best.json` deleted: the records
    of `metrics.jsonl` at the complete tags say which is the best."""
    root = first_run(tmp_path)
    for _, tag in list_tags(root):
        meta = json.loads((tag / META_FILE).read_text())
        del meta["best"]
        (tag / META_FILE).write_text(json.dumps(meta))
        record = json.loads((tag / COMPLETE_FILE).read_text())
        record["files"][META_FILE] = {"bytes": (tag / META_FILE).stat().st_size,
                                      "sha256": hashlib.sha256((tag / META_FILE).read_bytes()).hexdigest()}
        (tag / COMPLETE_FILE).write_text(json.dumps(record))
    (root / BEST_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        checkpointer, state = resume(tmp_path, 12)
    assert checkpointer.best.tag == "step_00000004" and "rebuilt from metrics.jsonl" in caplog.text
    walk(checkpointer, FakeRun(state), range(13, 21), LATER)
    assert 4 in steps_on_disk(root)


def test_a_metrics_jsonl_naming_another_best_keeps_that_tag_too(tmp_path, caplog):
    root = first_run(tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + json.dumps(
        {"step": 9, "val/loss": 1.0, EVAL_SET_KEY: "A"}) + "\n")  # a record says step 9 was better
    with caplog.at_level(logging.WARNING):
        checkpointer, state = resume(tmp_path, 12)
    assert checkpointer.best.tag == "step_00000004" and checkpointer.keep == {"step_00000009"}
    assert "metrics.jsonl names step_00000009 (val/loss=1) as the best" in caplog.text
    walk(checkpointer, FakeRun(state), range(13, 21), LATER)
    assert {4, 9} <= set(steps_on_disk(root))


def test_a_best_record_damaged_during_the_run_protects_the_best_all_the_same(tmp_path):
    """Pruning keeps the run's own record, not whatever `best.json` says; the next save restores the file."""
    checkpointer, run = Checkpointer(train_cfg(tmp_path, total_steps=20), is_main=True), FakeRun(TrainState())
    walk(checkpointer, run, range(1, 13), FIRST)
    root = tmp_path / "checkpoints"
    (root / BEST_FILE).write_text("{")
    walk(checkpointer, run, range(13, 21), LATER)
    assert 4 in steps_on_disk(root) and read_best(root).tag == "step_00000004"


def test_a_changed_validation_set_starts_a_new_lineage_and_keeps_the_old_best(tmp_path, caplog):
    root = first_run(tmp_path)
    with caplog.at_level(logging.WARNING):
        checkpointer, state = resume(tmp_path, 12, eval_set="B")
    assert checkpointer.best is None and checkpointer.keep == {"step_00000004"}
    notes = [r.getMessage() for r in caplog.records if "another validation set" in r.getMessage()]
    assert len(notes) == 1 and "a new best starts from step 13; step_00000004 stays on disk" in notes[0], notes
    walk(checkpointer, FakeRun(state), range(13, 21), LATER, eval_set="B")
    best = read_best(root)
    assert (best.tag, best.value, best.eval_set) == ("step_00000016", 3.2, "B")  # above 3.0, but of another set
    assert 4 in steps_on_disk(root)  # the earlier set's best is not pruned
    again, _ = resume(tmp_path, 20, eval_set="B")  # the kept tag is recorded in the checkpoints: kept on
    assert again.best.tag == "step_00000016" and "step_00000004" in again.keep


def test_a_best_record_pointing_outside_the_checkpoints_is_not_a_record(tmp_path):
    root = first_run(tmp_path)
    raw = json.loads((root / BEST_FILE).read_text())
    (root / BEST_FILE).write_text(json.dumps({**raw, "tag": "../../elsewhere/checkpoints/step_00000004"}))
    assert read_best(root) is None
    checkpointer, _ = resume(tmp_path, 12)
    assert checkpointer.best.tag == "step_00000004" and read_best(root).tag == "step_00000004"
