"""Two-view sequence InfoNCE with queue (CAPT / COCO-LM SCL / InfoWord DIM) against the torch reference."""
from __future__ import annotations

import itertools

import pytest
import torch

from pipeline.kernels import sequence_contrastive as fused
from pipeline.kernels import functional as ref
from tests.kernels.helpers import assert_matches

BATCH, DIM, QUEUE = 5, 48, 40
FLAGS = list(itertools.product([True, False], repeat=3))  # normalize, symmetric, same_view_negatives


def make(device, batch=BATCH, queue=QUEUE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, DIM, generator=gen)
    b = a + 0.5 * torch.randn(batch, DIM, generator=gen)  # correlated views, like a real positive pair
    q = torch.randn(queue, DIM, generator=gen)
    return a.to(device), b.to(device), q.to(device)


@pytest.mark.parametrize("normalize,symmetric,same_view", FLAGS)
@pytest.mark.parametrize("with_queue", [True, False])
def test_matches_reference(device, normalize, symmetric, same_view, with_queue):
    a, b, q = make(device)
    tau = 0.1 if normalize else 5.0  # dot-product scores need a larger temperature to stay O(10)
    kwargs = dict(normalize=normalize, symmetric=symmetric, same_view_negatives=same_view)
    queue = q if with_queue else None
    _, grads = assert_matches(lambda x, y: ref.sequence_contrastive_loss(x, y, tau, queue, **kwargs),
                              lambda x, y: fused.sequence_contrastive_loss(x, y, tau, queue, **kwargs), [a, b], [0, 1])
    assert all(g.abs().max() > 0 for g in grads)


def test_odd_sizes_span_several_tiles(device):
    a, b, q = make(device, batch=37, queue=70, seed=1)  # 2B = 74 rows and 144 columns: 2 x 3 tiles of 64
    assert_matches(lambda x, y: ref.sequence_contrastive_loss(x, y, 0.05, q),
                   lambda x, y: fused.sequence_contrastive_loss(x, y, 0.05, q), [a, b], [0, 1])


def test_queue_gets_no_gradient_and_adaptive_tau_values(device):
    a, b, q = make(device, seed=2)
    q = q.clone().requires_grad_()
    for tau in (ref.adaptive_temperature(0, 100), ref.adaptive_temperature(50, 100)):
        loss = fused.sequence_contrastive_loss(a.clone().requires_grad_(), b, tau, q)
        loss.backward()
        assert q.grad is None
        torch.testing.assert_close(loss.detach(), ref.sequence_contrastive_loss(a, b, tau, q.detach()), rtol=1e-4, atol=1e-6)


def test_single_pair_and_empty_batch(device):
    a, b, q = make(device, batch=1, seed=3)
    assert_matches(lambda x, y: ref.sequence_contrastive_loss(x, y, 0.1, q),
                   lambda x, y: fused.sequence_contrastive_loss(x, y, 0.1, q), [a, b], [0, 1])
    loss, grads = assert_matches(lambda x, y: ref.sequence_contrastive_loss(x, y, 0.1, q),
                                 lambda x, y: fused.sequence_contrastive_loss(x, y, 0.1, q), [a[:0], b[:0]], [0, 1])
    assert loss.item() == 0.0 and grads[0].shape == (0, DIM)


def test_zero_row_follows_f_normalize(device):
    a, b, q = make(device, seed=4)
    a[2] = 0.0
    q[7] = 0.0
    assert_matches(lambda x, y: ref.sequence_contrastive_loss(x, y, 0.1, q),
                   lambda x, y: fused.sequence_contrastive_loss(x, y, 0.1, q), [a, b], [0, 1], rtol=1e-4, atol=1e-4)


def test_bad_shapes_and_temperature(device):
    a, b, q = make(device)
    with pytest.raises(ValueError, match=r"a and b must both be \[B, D\]"):
        fused.sequence_contrastive_loss(a, b[:3], 0.1)
    with pytest.raises(ValueError, match=r"queue must be \[Q, 48\]"):
        fused.sequence_contrastive_loss(a, b, 0.1, q[:, :7])
    with pytest.raises(ValueError, match="tau must be positive"):
        fused.sequence_contrastive_loss(a, b, 0.0)


def test_mixed_dtypes_compute_in_the_widest(device):
    a, b, q = make(device, seed=5)
    a16 = a.to(torch.bfloat16)
    _, grads = assert_matches(lambda x, y: ref.sequence_contrastive_loss(x, y, 0.1, q),
                              lambda x, y: fused.sequence_contrastive_loss(x, y, 0.1, q), [a16, b], [0, 1],
                              rtol=8e-3, atol=1e-5)  # a's gradient is rounded to bf16 on both sides
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32


@pytest.mark.parametrize("normalize,symmetric,same_view", FLAGS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_groups_and_reduction_match_reference(device, normalize, symmetric, same_view, reduction):
    """InfoWord's several n-grams per sentence (groups) and CAPT's Eq. 4 sum, over 2 x 2 tiles."""
    a, b, q = make(device, batch=70, queue=9, seed=6)
    groups = (torch.arange(70) // 3).to(device)  # pairs of one group are not each other's negatives
    tau = 0.1 if normalize else 5.0
    kwargs = dict(normalize=normalize, symmetric=symmetric, same_view_negatives=same_view, groups=groups,
                  reduction=reduction)
    _, grads = assert_matches(lambda x, y: ref.sequence_contrastive_loss(x, y, tau, q, **kwargs),
                              lambda x, y: fused.sequence_contrastive_loss(x, y, tau, q, **kwargs), [a, b], [0, 1])
    assert all(g.abs().max() > 0 for g in grads)


def test_groups_exclude_exactly_the_same_group_pairs(device):
    a, b, _ = make(device, seed=7)
    kwargs = dict(symmetric=False, same_view_negatives=False)
    distinct = torch.arange(BATCH, device=device)
    plain = fused.sequence_contrastive_loss(a, b, 0.1, **kwargs)
    torch.testing.assert_close(fused.sequence_contrastive_loss(a, b, 0.1, groups=distinct, **kwargs), plain)
    one_group = torch.zeros(BATCH, dtype=torch.long, device=device)  # every other pair excluded: only the positive
    assert fused.sequence_contrastive_loss(a, b, 0.1, groups=one_group, **kwargs).abs().item() < 1e-6
    with pytest.raises(ValueError, match=r"groups must be \[5\]"):
        fused.sequence_contrastive_loss(a, b, 0.1, groups=distinct[:2])
