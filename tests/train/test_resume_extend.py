"""`cpt-train --resume DIR train.total_steps=N`: a finished run extended from its saved config.

The chosen schedule behaviour (pipeline/train/checkpoint/resume_run.py): from step T+1 on the learning rate is
`lr_at(s, optim, N)`, the schedule re-stretched to the new total, as Hugging Face Trainer's
`resume_from_checkpoint` and Megatron's `--load --override-opt_param-scheduler` do; it does not stay
near the finished schedule's end.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.train.run_config import load_config
from pipeline.train.cli import main
from pipeline.train.metrics import read_jsonl
from pipeline.train.optim import lr_at
from pipeline.train.run_meta import RunMeta
from tests.train.runs import QUIET, latest, metric_rows, run_inprocess, tag_dir

FIRST = ["train.total_steps=4", "optim.warmup_steps=1", "optim.lr=2e-3", "data.corruption.mlm_probability=0.2"]


@pytest.fixture(scope="module")
def finished(tiny_shards_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run with non-default overrides (which --resume must not need retyped)."""
    out = tmp_path_factory.mktemp("finished")
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *FIRST) == 0
    return out


def test_resume_extends_from_the_saved_config_with_the_restretched_schedule(finished, tiny_shards_dir, tmp_path):
    extended, by_hand = tmp_path / "extended", tmp_path / "by_hand"
    shutil.copytree(finished, extended)
    shutil.copytree(finished, by_hand)
    # the new way: the directory and the one change
    assert main(["--resume", str(extended), "train.total_steps=8"]) == 0
    # the old way: every override retyped, plus allow_config_change
    assert run_inprocess("tiny-mlm", tiny_shards_dir, by_hand, *FIRST, "train.total_steps=8",
                         "train.allow_config_change=true") == 0
    new, old = metric_rows(extended), metric_rows(by_hand)
    assert sorted(new) == list(range(1, 9))
    assert {s: new[s] for s in range(5, 9)} == {s: old[s] for s in range(5, 9)}  # bit for bit
    assert {s: new[s] for s in range(1, 5)} == {s: r for s, r in metric_rows(finished).items()}  # history kept
    optim = load_config("tiny-mlm", FIRST).optim
    for step in range(5, 9):
        assert new[step]["lr"] == lr_at(step, optim, 8)
    assert new[5]["lr"] > 0.4 * optim.lr > new[4]["lr"]  # re-stretched, not stuck at the old schedule's end
    meta = RunMeta.read(latest(extended))
    assert meta.step == 8 and meta.config["train"]["total_steps"] == 8
    assert meta.config["data"]["corruption"]["mlm_probability"] == 0.2 and meta.config["optim"]["lr"] == 2e-3
    assert meta.recipe["overrides"]["train.total_steps"]["run"] == 8


def test_resume_of_a_finished_run_without_overrides_does_nothing(finished, tmp_path, capsys):
    again = tmp_path / "again"
    shutil.copytree(finished, again)
    assert main(["--resume", str(tag_dir(again, 4))]) == 0  # a tag path works too
    assert [r["step"] for r in read_jsonl(again / "metrics.jsonl")] == [1, 2, 3, 4]


def rewrite_checkpoint_file(path: Path, text: str) -> None:
    """Edit one file of a complete tag and record its new size and sha256 in `COMPLETE.json`, as a
    checkpoint written that way would have (so the edit is not caught as corruption)."""
    import hashlib

    path.write_text(text)
    complete = path.parent / "COMPLETE.json"
    record = json.loads(complete.read_text())
    record["files"][path.name] = {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    complete.write_text(json.dumps(record))


def test_resume_refuses_shards_changed_in_place(finished, tiny_shards_dir, tmp_path, capsys):
    shards = tmp_path / "shards"
    shutil.copytree(tiny_shards_dir, shards)
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    meta_path = tag_dir(run, 4) / "pipeline_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["data"]["shards_dir"] = str(shards)  # as if the run had trained on the copy
    meta["config"]["train"]["allow_config_change"] = True  # as saved by an earlier --resume extension
    rewrite_checkpoint_file(meta_path, json.dumps(meta))
    # the copy is then rebuilt in place with other content (a shard's listed hash differs)
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["shards"][0]["xxh3_64"] = "0" * 16
    (shards / "manifest.json").write_text(json.dumps(manifest))
    assert main(["--resume", str(run), "train.total_steps=8"]) == 2
    assert "changed since the checkpoint" in capsys.readouterr().err
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.parametrize("argv, message", [
    (["--resume", "/nonexistent/run", "train.total_steps=8"], "--resume /nonexistent/run: no such directory"),
    (["--resume", "{tmp}", "train.total_steps=8"], "not a run directory"),
    (["--resume", "{run}", "train.no_such_field=1"], "unknown key 'train.no_such_field'"),
])
def test_resume_errors_name_the_problem(argv, message, finished, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path, run=finished) for a in argv]
    assert main([*argv, *QUIET]) == 2
    assert message in capsys.readouterr().err


def test_resume_and_config_together_are_refused(finished, capsys):
    with pytest.raises(SystemExit) as err:
        main(["--resume", str(finished), "--config", "tiny-mlm"])
    assert err.value.code == 2
    assert "--resume DIR takes the run's saved config" in capsys.readouterr().err
