"""Work that only feeds metrics runs on logged steps only (`StepProgress.record_metrics`): no
full-vocabulary accuracy pass and no health copy of the hidden states on the other steps, and the
loss is the same either way."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import pipeline.kernels as kernels
from pipeline.kernels import functional
from pipeline.objectives.base import StepProgress
from tests.objectives.conftest import VOCAB, tiny_model
from tests.objectives.test_host_reads import collated

LOGGED, SILENT = StepProgress(1, 10, 1, record_metrics=True), StepProgress(2, 10, 1, record_metrics=False)


def run(model, batch, progress, monkeypatch):
    """(loss, metrics, vocabulary-wide projections, loss ops asked for) of one step."""
    projections, ops = [], []
    real_linear, real_get_op = F.linear, kernels.get_op
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: (w.shape[0] == VOCAB and projections.append(x.shape[0]))
                        or real_linear(x, w, b))
    monkeypatch.setattr(kernels, "get_op", lambda name, switch="auto": ops.append(name) or real_get_op(name, switch))
    try:
        loss, metrics = model(batch, progress, sampling_seed=7)
    finally:
        monkeypatch.setattr(F, "linear", real_linear)
        monkeypatch.setattr(kernels, "get_op", real_get_op)
    return loss.detach(), metrics, projections, ops


@pytest.mark.parametrize("objectives", [{"mlm-nce": 1.0}, {"infoword": 1.0}])
def test_nce_accuracy_pass_only_on_logged_steps(objectives, monkeypatch):
    model = tiny_model(objectives, dropout=0.0, attention_dropout=0.0)
    batch = collated(model)
    name = next(iter(objectives))
    loss, metrics, projections, _ = run(model, batch, LOGGED, monkeypatch)
    assert f"{name}/accuracy" in metrics and "health/token_cosine" in metrics
    assert len(projections) == 1  # the accuracy's full-vocabulary projection of the selected rows
    quiet_loss, quiet, quiet_projections, _ = run(model, batch, SILENT, monkeypatch)
    assert quiet_projections == []
    assert f"{name}/accuracy" not in quiet and not any(k.startswith("health/") for k in quiet)
    assert torch.equal(quiet_loss, loss)
    assert {k: v for k, v in metrics.items() if k in quiet} == quiet


def test_mlm_uses_the_argmax_free_loss_op_on_silent_steps(monkeypatch):
    model = tiny_model({"mlm": 1.0}, dropout=0.0, attention_dropout=0.0)
    batch = collated(model)
    loss, metrics, _, ops = run(model, batch, LOGGED, monkeypatch)
    assert "linear_cross_entropy_with_accuracy" in ops and "mlm/accuracy" in metrics
    quiet_loss, quiet, _, quiet_ops = run(model, batch, SILENT, monkeypatch)
    assert quiet_ops == ["linear_cross_entropy"] and "mlm/accuracy" not in quiet
    torch.testing.assert_close(quiet_loss, loss, rtol=0, atol=0)


def test_prediction_accuracy_runs_in_the_training_dtype(monkeypatch):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=g).bfloat16()
    weight, bias = torch.randn(VOCAB, 16, generator=g).bfloat16(), torch.randn(VOCAB, generator=g).bfloat16()
    targets = F.linear(hidden, weight, bias).argmax(-1)
    targets[::4] = (targets[::4] + 1) % VOCAB  # a quarter wrong
    dtypes = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: dtypes.append((x.dtype, w.dtype)) or real(x, w, b))
    acc = functional.prediction_accuracy(hidden, weight, bias, targets, chunk_rows=16)
    assert dtypes == [(torch.bfloat16, torch.bfloat16)] * 3  # 40 rows in chunks of 16, no fp32 copy
    assert acc.item() == pytest.approx(0.75)


def test_cocolm_detection_metrics_only_on_logged_steps(monkeypatch):
    """RTD AUC / accuracy (a sort of every token) are metrics only: absent on silent steps, where the loss
    is unchanged; the chance levels come with them (the SCL one on every step, it costs a fill)."""
    model = tiny_model({"cocolm": 1.0}, dropout=0.0, attention_dropout=0.0)
    batch = collated(model)
    loss, metrics, _, _ = run(model, batch, LOGGED, monkeypatch)
    detection = {"cocolm/rtd_auc", "cocolm/rtd_auc_chance", "cocolm/rtd_accuracy", "cocolm/rtd_accuracy_chance",
                 "cocolm/clm_copy_penalty"}
    assert detection <= metrics.keys()
    assert metrics["cocolm/rtd_auc_chance"].item() == 0.5
    assert 0.0 <= metrics["cocolm/rtd_auc"].item() <= 1.0
    assert 0.5 < metrics["cocolm/rtd_accuracy_chance"].item() < 1.0  # most tokens stay original
    rows = batch["input_ids"].shape[0]
    assert metrics["cocolm/scl_loss_chance"].item() == pytest.approx(math.log(2 * rows - 1))
    quiet_loss, quiet, _, _ = run(model, batch, SILENT, monkeypatch)
    assert not detection & quiet.keys() and "cocolm/scl_loss_chance" in quiet
    assert torch.equal(quiet_loss, loss)
