"""CAPT's spread gate (`objective_options.capt.queue_spread`, pipeline/objectives/capt.py): the memory
queue is filled from `queue_start` on but read only once the in-batch views of different sequences
have spread, latched, never opened by evaluation, and kept across a checkpoint."""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from pipeline.objectives.base import StepProgress
from pipeline.kernels.functional import sequence_contrastive_loss
from pipeline.objectives.capt import negative_cosine
from tests.gloo_ranks import spawn_gloo_ranks
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
    assert capt.spread_known_open  # read on a logged step: one loss (with the queue) from now on
    now = sequence_contrastive_loss(s, s_hat, 0.1, capt.queue.ordered().clone(), normalize=True, symmetric=True,
                                    same_view_negatives=True)
    assert model(batch, StepProgress(5, 10))[0].item() == pytest.approx(now.item(), rel=1e-5)
    state = model.extra_state_for_checkpoint()["capt"]
    assert state["spread_reached"] is True
    fresh = tiny_model({"capt": 1.0}, {"capt": options})
    assert not bool(fresh.objectives["capt"].spread_reached)
    fresh.load_extra_state_from_checkpoint({"capt": state})
    assert bool(fresh.objectives["capt"].spread_reached) and fresh.objectives["capt"].spread_known_open
    evaluated = tiny_model({"capt": 1.0}, {"capt": options})
    evaluated(batch, StepProgress(1, 10))  # fills the queue, gate closed
    evaluated.objectives["capt"].queue_spread = 1.0
    evaluated.eval()
    assert evaluated(batch, StepProgress(2, 10))[1]["capt/queue_read"].item() == 0.0  # evaluation never opens it
    evaluated.train()
    assert evaluated(batch, StepProgress(2, 10))[1]["capt/queue_read"].item() == 1.0


def _gate_rank(rank: int, out_dir: str) -> None:
    """One rank of the 2-rank gate test: a threshold between the two ranks' own spreads, so a
    per-rank decision would differ between the ranks; the gathered one cannot."""
    options = {"tau": 0.1, "queue_size": 64, "queue_spread": -0.99}  # closed while the queue fills
    model = tiny_model({"capt": 1.0}, {"capt": options}, dropout=0.0, attention_dropout=0.0)
    capt, batch = model.objectives["capt"], make_batch(batch_size=3, seed=rank)
    model(batch, StepProgress(1, 10))  # fills the queue; no weights change (no optimizer)
    with torch.no_grad():
        s = capt.represent(model.bert(batch["input_ids"], batch["attention_mask"]).last_hidden[:, 0])
        s_hat = capt.represent(model.bert(batch["masked_ids"], batch["attention_mask"]).last_hidden[:, 0])
    blocks = [torch.empty(2 * s.shape[0], s.shape[1]) for _ in range(2)]
    dist.all_gather(blocks, torch.cat([s, s_hat]))
    local = [float(negative_cosine([tuple(b.chunk(2))])) for b in blocks]
    overall = float(negative_cosine([tuple(b.chunk(2)) for b in blocks]))
    capt.queue_spread = (local[0] + local[1]) / 2
    _, metrics = model(batch, StepProgress(2, 10))
    torch.save({"local": local, "overall": overall, "threshold": capt.queue_spread,
                "read": metrics["capt/queue_read"].item()}, os.path.join(out_dir, f"gate{rank}.pt"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_ranks_open_the_gate_together_on_the_gathered_views(tmp_path):
    spawn_gloo_ranks(_gate_rank, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"gate{r}.pt") for r in range(2))
    assert r0["local"] == r1["local"] and r0["local"][0] != r0["local"][1]
    # the threshold splits the ranks' own spreads: a per-rank gate would open on one rank only
    assert (r0["local"][0] < r0["threshold"]) != (r0["local"][1] < r0["threshold"])
    assert r0["read"] == r1["read"] == float(r0["overall"] < r0["threshold"])
