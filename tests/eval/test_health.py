"""Representation-health metrics against direct computations."""
from __future__ import annotations

import itertools
import math

import torch

from pipeline.eval.health import is_collapsed, mean_token_cosine, unigram_accuracy


def test_mean_token_cosine_equals_the_mean_over_distinct_pairs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    rows = hidden[mask]
    pairs = [torch.nn.functional.cosine_similarity(rows[i], rows[j], dim=0) for i, j in itertools.permutations(range(7), 2)]
    assert math.isclose(mean_token_cosine(hidden, mask), float(torch.stack(pairs).mean()), rel_tol=1e-5)


def test_collapse_is_flagged_and_healthy_states_are_not():
    same = torch.ones(1, 10, 4) + 1e-4 * torch.randn(1, 10, 4)
    assert is_collapsed(mean_token_cosine(same))
    assert not is_collapsed(mean_token_cosine(torch.randn(1, 50, 64)))
    assert not is_collapsed(mean_token_cosine(torch.randn(1, 1, 4)))  # one token: undefined, not collapsed


def test_unigram_accuracy_is_the_frequency_of_the_most_common_token():
    counts = torch.tensor([0, 5, 50, 7])
    assert unigram_accuracy(counts, torch.tensor([2, 2, 1, 3])) == 0.5
