"""Issue 42: `cpt-train --resume DIR train.total_steps=N` changes the config by the user's own override,
which needs no `train.allow_config_change=true` (docs/training.md); the resume says so, instead of
warning that it resumes "despite changes (train.allow_config_change=true)" the user never set. The
warning stays for a resume the user allowed by hand."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from pipeline.train.loop import main
from tests.train.runs import run_inprocess

FIRST = ["train.total_steps=2", "optim.warmup_steps=1"]


def test_resume_overrides_are_reported_as_asked_for_not_as_an_allowance(tiny_shards_dir: Path, tmp_path: Path,
                                                                         caplog) -> None:
    finished = tmp_path / "finished"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, finished, *FIRST) == 0
    by_hand = tmp_path / "by_hand"
    shutil.copytree(finished, by_hand)
    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        assert main(["--resume", str(finished), "train.total_steps=3"]) == 0
    assert "despite changes" not in caplog.text and "allow_config_change=true" not in caplog.text
    assert "with the changes --resume's overrides asked for: train.total_steps" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        assert run_inprocess("tiny-mlm", tiny_shards_dir, by_hand, *FIRST[1:], "train.total_steps=3",
                             "train.allow_config_change=true") == 0
    assert "despite changes (train.allow_config_change=true)" in caplog.text  # the user's own allowance
