"""Non-finite loss guard: a step whose loss is NaN on any rank is skipped (the weights do not move),
counted, and after `train.max_nonfinite_steps` such steps in a row the run stops with exit code 3.

The NaN is injected by wrapping `PretrainModel.forward` (the model itself runs unchanged; its loss is
multiplied by NaN on chosen steps, as a diverging run would produce)."""
from __future__ import annotations

import math

import pytest
import torch

from pipeline.model.pretrainer import PretrainModel
from tests.train.runs import metric_rows, module_state, run_inprocess, tag_dir


@pytest.fixture
def nan_on_steps(monkeypatch):
    bad: set[int] = set()
    original = PretrainModel.forward

    def forward(self, batch, progress=None, sampling_seed=None):
        loss, metrics = original(self, batch, progress, sampling_seed)
        if progress is not None and progress.step in bad:
            loss = loss * float("nan")
        return loss, metrics

    monkeypatch.setattr(PretrainModel, "forward", forward)
    return bad


def test_nonfinite_steps_are_skipped(nan_on_steps, tiny_shards_dir, tmp_path):
    nan_on_steps.update({3, 4})
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=6", "train.checkpoint_every=2",
                         "train.keep_last=5", "train.max_nonfinite_steps=3") == 0
    rows = metric_rows(out)
    assert [rows[s]["nonfinite_steps"] for s in range(1, 7)] == [0, 0, 1, 2, 2, 2]
    assert rows[6]["skipped_steps"] == 2 and not math.isfinite(rows[3]["grad_norm"])
    step2, step4, step6 = (module_state(tag_dir(out, s)) for s in (2, 4, 6))
    assert all(torch.equal(step2[k], step4[k]) for k in step2)  # steps 3 and 4 changed nothing
    assert not all(torch.equal(step4[k], step6[k]) for k in step4)  # training went on afterwards


def test_too_many_nonfinite_steps_stop_the_run(nan_on_steps, tiny_shards_dir, tmp_path, capsys):
    nan_on_steps.update({3, 4, 5})
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=8",
                         "train.max_nonfinite_steps=3") == 3
    assert "3 consecutive steps (up to step 5) had a non-finite loss" in capsys.readouterr().err
    assert max(metric_rows(out)) == 5
