"""`MemoryQueue`: FIFO order, wrap-around, capacity, exact save/load, identical content across
ranks after a 2-rank gloo step (and through the CAPT objective's checkpoint hooks)."""
from __future__ import annotations

import os

import pytest
import torch

from pipeline.objectives.memory_queue import MemoryQueue
from tests.gloo_ranks import spawn_gloo_ranks
from tests.objectives.conftest import make_batch, tiny_model


def rows(start: int, n: int, dim: int = 3) -> torch.Tensor:
    """Row i holds the value start + i everywhere, so order is readable."""
    return torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, dim).clone()


def values(q: MemoryQueue) -> list[int]:
    return q.ordered()[:, 0].long().tolist()


def test_fifo_order_capacity_and_wrap_around():
    q = MemoryQueue(capacity=5, dim=3)
    assert len(q) == 0 and q.negatives() is None
    q.enqueue(rows(0, 2))
    assert values(q) == [0, 1] and len(q) == 2
    q.enqueue(rows(2, 2))
    assert values(q) == [0, 1, 2, 3]
    q.enqueue(rows(4, 3))  # wraps: 0 and 1 are dropped
    assert values(q) == [2, 3, 4, 5, 6] and len(q) == 5
    q.enqueue(rows(7, 1))
    assert values(q) == [3, 4, 5, 6, 7]
    assert sorted(q.negatives()[:, 0].long().tolist()) == [3, 4, 5, 6, 7]


def test_more_rows_than_capacity_keeps_the_newest():
    q = MemoryQueue(capacity=4, dim=3)
    q.enqueue(rows(0, 3))
    q.enqueue(rows(3, 10))
    assert values(q) == [9, 10, 11, 12]
    q.enqueue(rows(13, 1))
    assert values(q) == [10, 11, 12, 13]


def test_enqueue_detaches_and_checks_shape():
    q = MemoryQueue(capacity=4, dim=3)
    x = torch.randn(2, 3, requires_grad=True)
    q.enqueue(x)
    assert not q.buffer.requires_grad
    with pytest.raises(ValueError, match=r"\[n, 3\]"):
        q.enqueue(torch.randn(2, 4))


def test_state_round_trip_is_exact_and_checks_configuration():
    q = MemoryQueue(capacity=6, dim=4)
    q.enqueue(torch.randn(4, 4))
    q.enqueue(torch.randn(5, 4))
    state = q.state_dict()
    restored = MemoryQueue(capacity=6, dim=4)
    restored.load_state_dict(state)
    assert torch.equal(restored.ordered(), q.ordered()) and (restored.ptr, restored.size) == (q.ptr, q.size)
    nxt = torch.randn(3, 4)
    q.enqueue(nxt)
    restored.enqueue(nxt)
    assert torch.equal(restored.buffer, q.buffer)
    with pytest.raises(ValueError, match="queue_size"):
        MemoryQueue(capacity=7, dim=4).load_state_dict(state)


def test_capt_checkpoint_hooks_restore_the_queue_exactly():
    model = tiny_model({"mlm": 1.0, "capt": 1.0}, {"capt": {"queue_size": 16}})
    for seed in range(3):
        model(make_batch(seed=seed))
    state = model.extra_state_for_checkpoint()
    assert set(state) == {"capt"}
    fresh = tiny_model({"mlm": 1.0, "capt": 1.0}, {"capt": {"queue_size": 16}})
    fresh.load_extra_state_from_checkpoint(state)
    assert torch.equal(fresh.objectives["capt"].queue.ordered(), model.objectives["capt"].queue.ordered())


def _rank_main(rank: int, out_dir: str) -> None:
    q = MemoryQueue(capacity=8, dim=3)
    q.enqueue(rows(100 * rank, 2 + rank))  # ranks contribute different numbers of rows
    q.enqueue(rows(100 * rank + 50, 2))
    torch.save(q.state_dict(), os.path.join(out_dir, f"queue{rank}.pt"))
    # and through the CAPT objective, with different data on each rank
    model = tiny_model({"capt": 1.0}, {"capt": {"queue_size": 32}})
    model(make_batch(batch_size=3, seed=rank))
    torch.save(model.extra_state_for_checkpoint(), os.path.join(out_dir, f"capt{rank}.pt"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_rank_gloo_enqueue_gives_identical_content(tmp_path):
    spawn_gloo_ranks(_rank_main, 2, str(tmp_path))
    q0, q1 = (torch.load(tmp_path / f"queue{r}.pt") for r in range(2))
    assert torch.equal(q0["buffer"], q1["buffer"]) and q0["ptr"] == q1["ptr"] and q0["size"] == q1["size"] == 8
    restored = MemoryQueue(8, 3)
    restored.load_state_dict(q0)
    # rank order within a step, FIFO across steps: 9 rows arrived, the oldest (0) was dropped
    assert values(restored) == [1, 100, 101, 102, 50, 51, 150, 151]
    c0, c1 = (torch.load(tmp_path / f"capt{r}.pt")["capt"]["queue"] for r in range(2))
    assert c0["size"] == c1["size"] == 12  # 2 views x 3 sequences x 2 ranks
    assert torch.equal(c0["buffer"], c1["buffer"])
