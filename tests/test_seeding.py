"""The named random streams of `pipeline.seeding`: pure functions of their keys, independent of each other."""
from __future__ import annotations

import numpy as np
import torch

from pipeline import seeding


def test_dropout_stream_is_a_function_of_seed_step_and_rank():
    def draw(seed, step, rank):
        seeding.reseed_dropout(seed, step, rank)
        return torch.rand(4), np.random.rand(), __import__("random").random()

    a = draw(1, 5, 0)
    torch.rand(100)  # whatever ran in between does not matter
    b = draw(1, 5, 0)
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    for other in (draw(1, 6, 0), draw(1, 5, 1), draw(2, 5, 0)):
        assert not torch.equal(a[0], other[0])


def test_sampling_stream_depends_on_the_first_sample_not_on_the_rank_count():
    seeds = {seeding.sampling_seed(7, first) for first in range(0, 64, 8)}
    assert len(seeds) == 8 and seeding.sampling_seed(7, 8) == seeding.sampling_seed(7, 8)
    assert seeding.sampling_seed(7, 8) != seeding.sampling_seed(8, 8)
    g1, g2 = seeding.sampling_generator(123, "cpu"), seeding.sampling_generator(123, "cpu")
    assert torch.equal(torch.rand(5, generator=g1), torch.rand(5, generator=g2))


def test_corruption_streams_are_independent_and_recomputable():
    index = np.arange(100)
    select = seeding.hash_uniform(3, index, seeding.CorruptionStream.SELECT, 32)
    action = seeding.hash_uniform(3, index, seeding.CorruptionStream.ACTION, 32)
    assert abs(np.corrcoef(select.ravel(), action.ravel())[0, 1]) < 0.05
    np.testing.assert_array_equal(select[10:20], seeding.hash_uniform(3, index[10:20], seeding.CorruptionStream.SELECT, 32))
    a, b = seeding.span_rng(3, 41), seeding.span_rng(3, 41)
    assert a.integers(0, 1 << 30) == b.integers(0, 1 << 30) != seeding.span_rng(3, 42).integers(0, 1 << 30)


def test_epoch_order_is_a_permutation_per_epoch():
    first, second = seeding.epoch_permutation(5, 0, 50), seeding.epoch_permutation(5, 1, 50)
    assert sorted(first) == list(range(50)) and not np.array_equal(first, second)
    np.testing.assert_array_equal(first, seeding.epoch_permutation(5, 0, 50))
