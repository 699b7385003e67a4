"""Index sampling: negatives come from other sequences (uniformly), TACO positives stay inside the
window and on eligible tokens, and everything is reproducible from the generator."""
from __future__ import annotations

import torch

from pipeline.objectives.sampling import sample_from_other_groups, sample_per_row, sample_window_positives
from pipeline.objectives.taco import sample_taco_indices


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_other_row_samples_never_hit_the_anchor_row_and_cover_all_others_uniformly():
    candidate_rows = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    anchor_rows = torch.tensor([0, 1, 2, 3])
    picks = sample_from_other_groups(candidate_rows, anchor_rows, 4, 20000, gen())
    assert picks.shape == (4, 20000)
    for a, row in enumerate(anchor_rows.tolist()):
        hit_rows = candidate_rows[picks[a]]
        assert not (hit_rows == row).any()
        allowed = torch.nonzero(candidate_rows != row).squeeze(1)
        counts = torch.bincount(picks[a], minlength=10)[allowed].float()
        assert (counts > 0).all()
        freq = counts / counts.sum()
        assert torch.allclose(freq, torch.full_like(freq, 1 / allowed.numel()), atol=0.02)


def test_other_row_sampling_falls_back_when_only_one_row_has_candidates():
    picks = sample_from_other_groups(torch.tensor([1, 1, 1]), torch.tensor([1]), 3, 50, gen())
    assert picks.min() >= 0 and picks.max() <= 2


def test_other_row_sampling_is_reproducible():
    rows = torch.tensor([0, 0, 1, 1, 2])
    a = sample_from_other_groups(rows, torch.tensor([0, 2]), 3, 7, gen(5))
    b = sample_from_other_groups(rows, torch.tensor([0, 2]), 3, 7, gen(5))
    assert torch.equal(a, b)


def test_window_positive_is_an_eligible_neighbour_within_half_window():
    eligible = torch.zeros(2, 10, dtype=torch.bool)
    eligible[0, 1:9] = True
    eligible[1, 1:3] = True  # a two-token sequence
    eligible[1, 5] = True  # isolated token: no eligible neighbour within |d| <= 2
    rows, cols = torch.nonzero(eligible, as_tuple=True)
    for seed in range(20):
        pos, has = sample_window_positives(eligible, rows, cols, 5, gen(seed))
        assert has.tolist() == [True] * 8 + [True, True, False]
        d = (pos - cols)[has]
        assert ((d.abs() >= 1) & (d.abs() <= 2)).all()
        assert eligible[rows[has], pos[has]].all()


def test_window_positive_covers_every_neighbour():
    eligible = torch.ones(1, 9, dtype=torch.bool)
    rows, cols = torch.zeros(4000, dtype=torch.long), torch.full((4000,), 4)
    pos, _ = sample_window_positives(eligible, rows, cols, 5, gen())
    assert set(pos.tolist()) == {2, 3, 5, 6}


def test_taco_indices_shapes_and_membership():
    eligible = torch.zeros(3, 8, dtype=torch.bool)
    eligible[:, 1:7] = True
    anchors, positives, negatives = sample_taco_indices(eligible, eligible, 5, 50, gen())
    assert anchors.shape == positives.shape == (18,) and negatives.shape == (18, 50)
    assert torch.equal(anchors // 8, positives // 8)  # positives: same sequence
    assert ((negatives // 8) != (anchors // 8)[:, None]).all()  # negatives: other sequences
    assert eligible.reshape(-1)[negatives].all()


def test_per_row_picks_up_to_k_distinct_candidates_uniformly():
    cand = torch.tensor([[False, True, True, True], [False, False, False, False], [True, False, False, False]])
    for k in (1, 2, 5):
        chosen = sample_per_row(cand, k, gen(k))
        assert not (chosen & ~cand).any()
        assert chosen.sum(1).tolist() == [min(k, 3), 0, 1]
    hits = sum(sample_per_row(cand, 2, gen(s))[0].long() for s in range(3000))
    assert torch.allclose(hits[1:].float() / 3000, torch.full((3,), 2 / 3), atol=0.04)  # each of 3 columns: 2/3


def test_taco_max_anchors_subsamples_without_repetition():
    eligible = torch.zeros(3, 8, dtype=torch.bool)
    eligible[:, 1:7] = True
    anchors, positives, negatives = sample_taco_indices(eligible, eligible, 5, 4, gen(), max_anchors=5)
    assert anchors.shape == (5,) and anchors.unique().numel() == 5 and negatives.shape == (5, 4)
