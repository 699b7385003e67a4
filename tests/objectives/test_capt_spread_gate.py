"""CAPT's spread gate (`objective_options.capt.queue_spread`, pipeline/objectives/capt.py): the memory
queue is filled from `queue_start` on but read only once the in-batch views of different sequences
have spread, latched, never opened by evaluation, and kept across a checkpoint."""
from __future__ import annotations

import math

import pytest
import torch

from pipeline.objectives.base import StepProgress
from pipeline.objectives.functional import sequence_contrastive_loss
from tests.objectives.conftest import make_batch, tiny_model


def test_capt_spread_gate_reads_the_queue_once_the_sequences_have_spread():
    """`queue_spread`: the queue is filled from the start but read only from the first training
    micro-batch whose in-batch negative cosine is below the threshold, and then for good."""
    options = {"tau": 0.1, "queue_size": 64, "queue_spread": 0.5}
    model = tiny_model({"capt": 1.0}, {"capt": options}, dropout=0.0, attention_dropout=0.0)
    no_queue = tiny_model({"capt": 1.0}, {"capt": {"tau": 0.1, "queue_size": 0}}, dropout=0.0, attention_dropout=0.0)
    capt, batch = model.objectives["capt"], make_batch()
    b = batch["input_ids"].shape[0]
    for step in (1, 2):  # an initialised encoder: every sequence one point (cosine ~1 > 0.5), gate closed
        loss, metrics = model(batch, StepProgress(step, 10))
        assert metrics["capt/negative_cosine"].item() > 0.5 and metrics["capt/queue_read"].item() == 0.0
        assert len(capt.queue) == 2 * b * step and metrics["capt/negatives"].item() == 2 * b - 2
        assert metrics["capt/loss_chance"].item() == pytest.approx(math.log(2 * b - 1))
        assert loss.item() == pytest.approx(no_queue(batch, StepProgress(step, 10))[0].item(), rel=1e-5)
    queued = capt.queue.ordered().clone()
    capt.queue_spread = 1.0  # any spread now opens it (a threshold above the measured cosine)
    loss, metrics = model(batch, StepProgress(3, 10))
    assert metrics["capt/queue_read"].item() == 1.0 and metrics["capt/negatives"].item() == 2 * b - 2 + len(queued)
    assert metrics["capt/loss_chance"].item() == pytest.approx(math.log(2 * b - 1 + len(queued)))
    with torch.no_grad():
        s = capt.represent(model.bert(batch["input_ids"], batch["attention_mask"]).last_hidden[:, 0])
        s_hat = capt.represent(model.bert(batch["masked_ids"], batch["attention_mask"]).last_hidden[:, 0])
    expected = sequence_contrastive_loss(s, s_hat, 0.1, queued, normalize=True, symmetric=True, same_view_negatives=True)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    capt.queue_spread = -0.99  # latched: a threshold no batch meets no longer closes it
    assert model(batch, StepProgress(4, 10))[1]["capt/queue_read"].item() == 1.0
    state = model.extra_state_for_checkpoint()["capt"]
    assert state["spread_reached"] is True
    fresh = tiny_model({"capt": 1.0}, {"capt": options})
    assert not bool(fresh.objectives["capt"].spread_reached)
    fresh.load_extra_state_from_checkpoint({"capt": state})
    assert bool(fresh.objectives["capt"].spread_reached)
    evaluated = tiny_model({"capt": 1.0}, {"capt": options})
    evaluated(batch, StepProgress(1, 10))  # fills the queue, gate closed
    evaluated.objectives["capt"].queue_spread = 1.0
    evaluated.eval()
    assert evaluated(batch, StepProgress(2, 10))[1]["capt/queue_read"].item() == 0.0  # evaluation never opens it
    evaluated.train()
    assert evaluated(batch, StepProgress(2, 10))[1]["capt/queue_read"].item() == 1.0
