"""TACO token InfoNCE kernel (and the gathered-candidate kernel) against the torch reference."""
from __future__ import annotations

import pytest
import torch

from pipeline.kernels import token_contrastive as fused
from pipeline.kernels import functional as ref
from tests.kernels.helpers import assert_matches

TOKENS, HIDDEN, K = 3 * 37, 48, 7


def make(device, anchors=40, k=K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(TOKENS, HIDDEN, generator=gen)
    anchor = torch.randint(0, TOKENS, (anchors,), generator=gen)
    anchor[1] = anchor[0]  # an anchor row used twice accumulates twice
    positive = torch.randint(0, TOKENS, (anchors,), generator=gen)
    negative = torch.randint(0, TOKENS, (anchors, k), generator=gen)
    negative[2, 0] = anchor[2]  # candidates may coincide with anchors
    return g.to(device), anchor.to(device), positive.to(device), negative.to(device)


@pytest.mark.parametrize("detach", [True, False])
@pytest.mark.parametrize("tau", [0.07, 1.0])
def test_matches_reference(device, detach, tau):
    g, a, p, n = make(device)
    assert_matches(lambda *x: ref.token_contrastive_loss(*x, tau, detach),
                   lambda *x: fused.token_contrastive_loss(*x, tau, detach), [g, a, p, n], [0])


def test_detach_sends_gradient_through_anchor_rows_only(device):
    g, a, p, n = make(device, anchors=10, seed=1)
    g = g.detach().requires_grad_()
    fused.token_contrastive_loss(g, a, p, n, 0.07, detach_candidates=True).backward()
    touched = g.grad.abs().sum(1) > 0
    expected = torch.zeros(TOKENS, dtype=torch.bool, device=device)
    expected[a] = True
    assert torch.equal(touched, expected)


def test_many_candidate_tiles_online_rescaling(device, monkeypatch):
    monkeypatch.setattr(fused, "MAX_TILE", 128)  # BLOCK_H = 64 -> 2 candidates per tile, 19 tiles
    g, a, p, n = make(device, anchors=12, k=37, seed=2)
    for detach in (True, False):
        assert_matches(lambda *x: ref.token_contrastive_loss(*x, 0.05, detach),
                       lambda *x: fused.token_contrastive_loss(*x, 0.05, detach), [g, a, p, n], [0])


def test_zero_and_tiny_rows_follow_f_normalize(device):
    g, a, p, n = make(device, seed=3)
    g[a[3]] = 0.0  # |g| <= eps: no radial projection, gradient scaled by 1 / eps
    g[n[4, 1]] = 1e-9
    g[p[5]] *= 1e3
    assert_matches(lambda *x: ref.token_contrastive_loss(*x, 0.07, False),
                   lambda *x: fused.token_contrastive_loss(*x, 0.07, False), [g, a, p, n], [0], rtol=1e-4, atol=1e-3)


def test_single_negative_and_no_anchor(device):
    g, a, p, n = make(device, anchors=5, k=1, seed=4)
    assert_matches(lambda *x: ref.token_contrastive_loss(*x, 0.1),
                   lambda *x: fused.token_contrastive_loss(*x, 0.1), [g, a, p, n], [0])
    loss, grads = assert_matches(lambda *x: ref.token_contrastive_loss(*x, 0.1),
                                 lambda *x: fused.token_contrastive_loss(*x, 0.1), [g, a[:0], p[:0], n[:0]], [0])
    assert loss.item() == 0.0 and grads[0].abs().max() == 0


def test_index_shape_errors(device):
    g, a, p, n = make(device, anchors=6)
    with pytest.raises(ValueError, match="same number of rows"):
        fused.token_contrastive_loss(g, a, p[:5], n, 0.07)
    with pytest.raises(ValueError, match=r"g must be \[T, H\]"):
        fused.token_contrastive_loss(g[None], a, p, n, 0.07)
