"""Non-finite loss guard: a step whose loss is NaN on any rank is skipped (the weights do not move),
counted, and after `train.max_nonfinite_steps` such steps in a row the run stops with exit code 3.

The NaN is injected by wrapping `PretrainModel.forward` (the model itself runs unchanged; its loss is
multiplied by NaN on chosen steps, as a diverging run would produce)."""
from __future__ import annotations

import math

import pytest
import torch

from pipeline.pretrain.pretrainer import PretrainModel
from tests.train.runs import latest, metric_rows, module_state, run_inprocess, tag_dir


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
    # step 4 ends inside the streak: its weights just gave a NaN loss, so no checkpoint is written there
    assert not tag_dir(out, 4).exists() and tag_dir(out, 2).is_dir()
    step2, step6 = (module_state(tag_dir(out, s)) for s in (2, 6))
    assert not all(torch.equal(step2[k], step6[k]) for k in step2)  # training went on afterwards


def test_too_many_nonfinite_steps_stop_the_run(nan_on_steps, tiny_shards_dir, tmp_path, capsys):
    nan_on_steps.update({3, 4, 5})
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=8",
                         "train.max_nonfinite_steps=3") == 3
    assert "3 consecutive steps (up to step 5) had a non-finite loss" in capsys.readouterr().err
    assert max(metric_rows(out)) == 5


def test_a_run_that_ends_in_nonfinite_steps_fails_without_a_final_checkpoint(nan_on_steps, tiny_shards_dir, tmp_path,
                                                                             capsys):
    """NaN from step 2 to the end, with the guard's limit (10) above the remaining steps: the run
    does not exit 0 and writes no final checkpoint (one would name step 6 but hold step 1's weights,
    and a resume would find nothing left to do)."""
    nan_on_steps.update(range(2, 7))
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=6", "train.checkpoint_every=1000") == 3
    err = capsys.readouterr().err
    assert "the run's last 5 step(s) (up to its final step 6) had a non-finite loss" in err
    assert "train.max_nonfinite_steps=10 was not reached only because the run ended first" in err
    assert latest(out) is None and not tag_dir(out, 6).exists()


@pytest.fixture
def nan_weight_at_step(monkeypatch):
    """Sets one weight to NaN in the forward of a chosen step (as a blow-up through an applied update
    would): the loss is NaN from then on, DeepSpeed skips those updates, the weight stays NaN."""
    chosen: list[int] = []
    original = PretrainModel.forward

    def forward(self, batch, progress=None, sampling_seed=None):
        if progress is not None and chosen and progress.step == chosen[0]:
            with torch.no_grad():
                next(self.parameters()).view(-1)[0] = float("nan")
        return original(self, batch, progress, sampling_seed)

    monkeypatch.setattr(PretrainModel, "forward", forward)
    return chosen


def test_nonfinite_weights_are_never_checkpointed(nan_weight_at_step, tiny_shards_dir, tmp_path, capsys):
    nan_weight_at_step.append(3)
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=8", "train.checkpoint_every=2") == 3
    assert "step 4: 1 weight tensor(s) hold NaN/Inf values; the checkpoint of this step was not written" in \
        capsys.readouterr().err
    assert latest(out) == tag_dir(out, 2) and not tag_dir(out, 4).exists()
    assert all(torch.isfinite(v).all() for v in module_state(tag_dir(out, 2)).values() if v.is_floating_point())
