"""`cpt-status` as issue 58 asks: the best checkpoint (`train.keep_best`) named with its convert command beside
the latest; `--json` one object per run, one per line; the architecture beside the run's name; a run that died
before its first checkpoint not told to resume; no "(still improving)" for a move within noise; a validation
column in the table of a directory of runs; `best.json` read through `checkpoint.best.read_best` (a field it does
not know is ignored; a record naming a missing tag is said)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.status import main as status_main
from pipeline.train.checkpoint.best import BEST_FILE
from pipeline.train.exit_record import RUN_STATE_FILE
from tests.train.runs import run_inprocess


def status_lines(capsys, *paths, json_output: bool = True):
    capsys.readouterr()
    assert status_main([*map(str, paths), *(["--json"] if json_output else [])]) == 0
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines()] if json_output else out


@pytest.fixture(scope="module")
def best_run(tmp_path_factory, tiny_shards_dir) -> Path:
    """A tiny MLM run keeping the checkpoint of its lowest token cosine, which rises as tiny-mlm collapses: the
    best is an early step, the latest is step 6."""
    out = tmp_path_factory.mktemp("best") / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=6", "train.checkpoint_every=100",
                         "train.keep_last=1", "train.log_every=1", "train.keep_best=health/token_cosine",
                         "train.keep_best_mode=min") == 0
    return out


def test_the_best_checkpoint_and_its_convert_command(best_run, capsys):
    (s,) = status_lines(capsys, best_run)
    best = json.loads((best_run / "checkpoints" / BEST_FILE).read_text())
    assert best["step"] < 6 == s["checkpoint_step"], "the fixture's best should be an earlier step"
    tag, step = best_run / "checkpoints" / best["tag"], best["step"]
    command = f"cpt-convert {tag} {best_run / 'hf' / f'step{step}'}"
    assert s["best"] == {"metric": "health/token_cosine", "mode": "min", "value": best["value"], "step": step,
                         "checkpoint": str(tag), "convert_command": command}
    text = status_lines(capsys, best_run, json_output=False)
    assert f"  best        {tag}: health/token_cosine {best['value']:.4f} (min) at step {step}" in text
    assert f"  convert     {command}" in text
    assert "(tiny-mlm, bert tiny)" in text.splitlines()[0]


def test_best_json_with_an_extra_field_or_naming_a_missing_tag(best_run, tmp_path, capsys):
    run = Path(shutil.copytree(best_run, tmp_path / "run"))
    path = run / "checkpoints" / BEST_FILE
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "validation_set": {"content_hash": "abc"}}))  # another helper's field
    (s,) = status_lines(capsys, run)
    assert s["best"]["step"] == record["step"] and "problem" not in s["best"]
    shutil.rmtree(run / "checkpoints" / record["tag"])
    (s,) = status_lines(capsys, run)
    assert s["best"]["problem"] == f"{path} names {record['tag']}, which is not there"
    assert f"  best        {path} names {record['tag']}, which is not there" in status_lines(capsys, run,
                                                                                             json_output=False)
    path.write_text('{"metric": "loss", "va')
    (s,) = status_lines(capsys, run)
    assert "unreadable" in s["best"]["problem"]


def test_json_is_one_object_per_line(best_run, tmp_path, capsys):
    root = tmp_path / "sweep"
    for name in ("a", "b"):
        shutil.copytree(best_run, root / name)
    lines = status_lines(capsys, root)
    assert [Path(s["run_dir"]).name for s in lines] == ["a", "b"] and all(isinstance(s, dict) for s in lines)


def test_the_table_has_a_validation_column(tmp_path, capsys, tiny_corpus_file, tiny_tokenizer_dir):
    """Two runs with held-out validation, the second a ModernBERT, named so (it showed as `(tiny-mlm)` alone)."""
    from data_prep.build_shards import build_shards

    shards = tmp_path / "shards"
    build_shards([tiny_corpus_file], tiny_tokenizer_dir, shards, seq_len=64, shard_size_mb=0.02, num_proc=1,
                 progress=False, holdout_fraction=0.2)
    root = tmp_path / "sweep"
    for name, family in (("a", "bert"), ("b", "modernbert")):
        assert run_inprocess("tiny-mlm", shards, root / name, "train.total_steps=4", "train.checkpoint_every=4",
                             f"eval.shards_dir={shards / 'validation'}", "eval.every=2", "eval.batches=1",
                             f"model.arch={family}") == 0
    assert "(tiny-mlm, modernbert tiny)" in status_lines(capsys, root / "b", json_output=False).splitlines()[0]
    (s, _) = status_lines(capsys, root)
    terms = s["validation"]["terms"]
    lines = status_lines(capsys, root, json_output=False).splitlines()
    assert "VALIDATION" in lines[0].split()
    v = terms["val/loss"]
    best = "" if v["best_step"] == 4 else f" (best {v['best']:.3f} @{v['best_step']})"
    assert f"val/loss {v['latest']:.3f}{best}" in lines[1]


def _died(run: Path, tmp_path: Path) -> Path:
    """A copy of `run` whose record says running (of 100 steps), by a process that is gone (a SIGKILL)."""
    copy = Path(shutil.copytree(run, tmp_path / "died"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = json.loads((copy / RUN_STATE_FILE).read_text())
    record.update(state="running", pid=int(gone.stdout), host=os.uname().nodename, total_steps=100)  # mid-run
    record.pop("exit_code", None)
    (copy / RUN_STATE_FILE).write_text(json.dumps(record))
    return copy


def test_a_run_that_died_before_its_first_checkpoint_is_not_told_to_resume(best_run, tmp_path, capsys):
    died = _died(best_run, tmp_path)
    (s,) = status_lines(capsys, died)
    assert s["state"] == "died" and s["detail"].endswith("the same command resumes it from step 6")
    shutil.rmtree(died / "checkpoints")
    (s,) = status_lines(capsys, died)
    assert s["state"] == "died" and "resume it" not in s["detail"]
    assert s["detail"].endswith("before its first checkpoint: nothing to resume; the same command starts it over "
                                "from step 0")


def test_a_signal_moving_within_noise_is_not_still_improving(best_run, tmp_path, capsys):
    """Every logged step's mlm/accuracy set to 0.05, the last step's to 0.0502: one value per window, so no
    estimate of the noise, no claim (the old rule called any move the good way "still improving")."""
    run = Path(shutil.copytree(best_run, tmp_path / "run"))
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for i, record in enumerate(lines):
        if "mlm/accuracy" in record:
            record["mlm/accuracy"] = 0.05 + (0.0002 if i == len(lines) - 1 else 0)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (s,) = status_lines(capsys, run)
    accuracy = next(sig for sig in s["signals"] if sig["term"] == "mlm/accuracy")
    assert accuracy["trend"] == "" and accuracy["still_improving"] is False
    assert "mlm/accuracy" in status_lines(capsys, run, json_output=False)
    assert not any("mlm/accuracy" in line and "improving" in line
                   for line in status_lines(capsys, run, json_output=False).splitlines())
