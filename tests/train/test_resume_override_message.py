"""Issue 42: `cpt-train --resume DIR train.total_steps=N` changes the config by the user's own override,
which needs no `train.allow_config_change=true` (docs/training.md); the resume says so, instead of
warning that it resumes "despite changes (train.allow_config_change=true)" the user never set. The
warning stays for a resume the user allowed by hand."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from pipeline.train.cli import main
from tests.train.runs import run_inprocess

FIRST = ["train.total_steps=2", "optim.warmup_steps=1"]
CHANGE = ["train.total_steps=3", "data.corruption.mlm_probability=0.2"]  # not a schedule-only change


def _resumed(caplog, run: Path) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith(f"resuming {run}")]


def test_resume_overrides_are_reported_as_asked_for_not_as_an_allowance(tiny_shards_dir: Path, tmp_path: Path,
                                                                         caplog) -> None:
    finished = tmp_path / "finished"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, finished, *FIRST) == 0
    extended, changed, by_hand = tmp_path / "extended", tmp_path / "changed", tmp_path / "by_hand"
    for copy in (extended, changed, by_hand):
        shutil.copytree(finished, copy)
    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        assert main(["--resume", str(extended), "train.total_steps=3"]) == 0
        assert main(["--resume", str(changed), *CHANGE]) == 0
    assert "despite changes" not in caplog.text and "allow_config_change=true" not in caplog.text
    # reported at INFO as what was asked for (the total alone may also read as a schedule branch,
    # pipeline.train.checkpoint.schedule_branch), never as a warning
    for run in (extended, changed):
        assert _resumed(caplog, run) and all(r.levelno == logging.INFO and "train.total_steps" in r.getMessage()
                                             for r in _resumed(caplog, run))
    assert "with the changes --resume's overrides asked for" in _resumed(caplog, changed)[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        assert run_inprocess("tiny-mlm", tiny_shards_dir, by_hand, *FIRST[1:], *CHANGE,
                             "train.allow_config_change=true") == 0
    assert [r.levelno for r in _resumed(caplog, by_hand)] == [logging.WARNING]  # the user's own allowance
    assert "despite changes (train.allow_config_change=true)" in caplog.text
