"""Fused linear + cross-entropy (MLM), corrective LM (COCO-LM) and BERT-NCE against the torch reference."""
from __future__ import annotations

import pytest
import torch

from pipeline.kernels import linear_cross_entropy as fused
from pipeline.kernels import shared_negatives as fused_nce
from pipeline.kernels import functional as ref
from tests.kernels.helpers import assert_matches

TOKENS, HIDDEN, VOCAB = 3 * 37, 48, 1001


def make(device, rows=TOKENS, hidden=HIDDEN, vocab=VOCAB, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * 0.3
    b = torch.randn(vocab, generator=gen) * 0.1
    t = torch.randint(0, vocab, (rows,), generator=gen)
    return h.to(device), w.to(device), b.to(device), t.to(device)


@pytest.mark.parametrize("with_bias", [True, False])
def test_cross_entropy_matches_reference_with_ignored_rows(device, with_bias):
    h, w, b, t = make(device)
    t[::4] = -100
    _, grads = assert_matches(ref.linear_cross_entropy, fused.linear_cross_entropy,
                              [h, w, b if with_bias else None, t], [0, 1, 2] if with_bias else [0, 1])
    assert grads[0][::4].abs().max() == 0 and grads[0][1::4].abs().max() > 0  # ignored rows get nothing


@pytest.mark.parametrize("chunked", [False, True])
def test_accuracy_output_equals_the_reference_argmax(device, monkeypatch, chunked):
    """The kernel's argmax / correct count (first maximum, ignored rows left out) against the
    reference's argmax of the same logits; loss and gradients unchanged by asking for it."""
    if chunked:
        monkeypatch.setattr(fused, "CHUNK_BYTES", 4 * VOCAB * 20)  # 16-row chunks
    h, w, b, t = make(device, seed=4)
    t[::5] = -100
    best = (h @ w.t() + b).argmax(-1)
    t[1::3] = best[1::3]  # a third of the rows predicted right
    w[7] = w[best[2]]  # row 2's maximum tied by an earlier (or later) column: argmax takes the first
    b[7] = b[best[2]]
    t[2] = max(7, int(best[2]))  # the later of the tied columns: wrong under first-maximum argmax
    _, ref_acc = ref.linear_cross_entropy_with_accuracy(h, w, b, t)
    loss, acc = fused.linear_cross_entropy_with_accuracy(h, w, b, t)
    assert acc.shape == () and acc.dtype == torch.float32
    assert acc.item() == pytest.approx(ref_acc.item(), abs=1e-7) and 0.3 < acc.item() < 0.6
    assert_matches(lambda *a: ref.linear_cross_entropy_with_accuracy(*a)[0],
                   lambda *a: fused.linear_cross_entropy_with_accuracy(*a)[0], [h, w, b, t], [0, 1, 2])
    _, none = fused.linear_cross_entropy_with_accuracy(h, w, b, torch.full_like(t, -100))
    assert none.item() == 0.0


def test_cross_entropy_custom_ignore_index_and_multiple_chunks(device, monkeypatch):
    monkeypatch.setattr(fused, "CHUNK_BYTES", 4 * VOCAB * 20)  # 16-row chunks: 7 chunks, the last partial
    assert fused.chunk_rows_for(VOCAB, TOKENS) == 16
    h, w, b, t = make(device, seed=1)
    t[5:40] = 7  # rows whose target is the ignore index below
    assert_matches(lambda *a: ref.linear_cross_entropy(*a, ignore_index=7),
                   lambda *a: fused.linear_cross_entropy(*a, ignore_index=7), [h, w, b, t], [0, 1, 2])


def test_all_rows_ignored_gives_connected_zero(device):
    h, w, b, t = make(device, rows=9)
    t[:] = -100
    loss, grads = assert_matches(ref.linear_cross_entropy, fused.linear_cross_entropy, [h, w, b, t], [0, 1, 2])
    assert loss.item() == 0.0 and all(g.abs().max() == 0 for g in grads)


def test_no_rows(device):
    h, w, b, t = make(device, rows=0)
    loss, _ = assert_matches(ref.linear_cross_entropy, fused.linear_cross_entropy, [h, w, b, t], [0, 1, 2])
    assert loss.item() == 0.0


def test_large_logits_stay_finite(device):
    h, w, b, t = make(device, rows=13, seed=2)
    assert_matches(ref.linear_cross_entropy, fused.linear_cross_entropy, [h * 40, w, b, t], [0, 1, 2],
                   rtol=1e-4, atol=1e-4)


def test_gradient_is_scaled_by_upstream_gradient(device):
    h, w, b, t = make(device, rows=11, seed=3)
    hr, hk = h.clone().requires_grad_(), h.clone().requires_grad_()
    (3.5 * ref.linear_cross_entropy(hr, w, b, t)).backward()
    (3.5 * fused.linear_cross_entropy(hk, w, b, t)).backward()
    torch.testing.assert_close(hk.grad, hr.grad, rtol=1e-4, atol=1e-6)


def test_corrective_lm_matches_reference(device):
    h, w, b, t = make(device, seed=4)
    gen = torch.Generator().manual_seed(5)
    corrupted = torch.where(torch.rand(TOKENS, generator=gen) < 0.5, t.cpu(),
                            torch.randint(0, VOCAB, (TOKENS,), generator=gen)).to(device)
    copy_prob = torch.rand(TOKENS, generator=gen).to(device)
    copy_prob[:3] = torch.tensor([0.0, 1.0, 1.0 - 1e-9])  # clamped at both ends
    corrupted[:3] = t[:3]
    copy_prob[3], corrupted[3] = 1.0, (t[3] + 1) % VOCAB  # saturated copy head, replaced token
    _, grads = assert_matches(ref.corrective_lm_loss, fused.corrective_lm_loss,
                              [h, w, b, copy_prob, corrupted, t], [0, 1, 2, 3])
    assert grads[3] is None  # stop-gradient on the copy probability


def test_corrective_lm_without_bias(device):
    h, w, _, t = make(device, rows=17, seed=6)
    copy_prob = torch.rand(17, device=device)
    assert_matches(ref.corrective_lm_loss, fused.corrective_lm_loss, [h, w, None, copy_prob, t, t], [0, 1])


@pytest.mark.parametrize("with_bias", [True, False])
def test_sampled_softmax_matches_reference(device, with_bias):
    h, w, b, t = make(device, seed=7)
    negatives = torch.randint(0, VOCAB, (TOKENS, 7), generator=torch.Generator().manual_seed(8)).to(device)
    negatives[::3, 2] = t[::3]  # negatives equal to the target are excluded
    negatives[1::3, 4] = negatives[1::3, 5]  # repeated negatives count twice (and scatter twice)
    assert_matches(ref.sampled_softmax_cross_entropy, fused.sampled_softmax_cross_entropy,
                   [h, w, b if with_bias else None, t, negatives], [0, 1, 2] if with_bias else [0, 1])


def test_frozen_weight_gets_no_gradient_work(device):
    h, w, b, t = make(device, rows=10, seed=9)
    hk = h.clone().requires_grad_()
    loss = fused.linear_cross_entropy(hk, w, b, t)  # weight and bias do not require grad
    loss.backward()
    hr = h.clone().requires_grad_()
    ref.linear_cross_entropy(hr, w, b, t).backward()
    torch.testing.assert_close(hk.grad, hr.grad, rtol=1e-4, atol=1e-6)


def test_shape_errors_name_the_argument(device):
    h, w, b, t = make(device, rows=4)
    with pytest.raises(ValueError, match="bias must be"):
        fused.linear_cross_entropy(h, w, b[:-1], t)
    with pytest.raises(ValueError, match="targets has 3 rows"):
        fused.linear_cross_entropy(h, w, b, t[:3])
    with pytest.raises(ValueError, match="hidden"):
        fused.linear_cross_entropy(h[:, :5], w, b, t)


def shared_negatives(device, rows, seed, groups=3, distinct=200):
    """A shared negative multiset: `distinct` ids (some repeated) with per-group counts (zeros included)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (distinct,), generator=gen)
    counts = torch.randint(0, 4, (groups, distinct), generator=gen)
    anchor_groups = torch.randint(0, groups, (rows,), generator=gen)
    return ids.to(device), counts.to(device), anchor_groups.to(device)


@pytest.mark.parametrize("with_bias", [True, False])
def test_sampled_softmax_shared_negatives_match_reference(device, with_bias, monkeypatch):
    monkeypatch.setattr(fused, "CHUNK_BYTES", 4 * 2 * 250 * 20)  # several row chunks
    h, w, b, t = make(device, seed=10)
    ids, counts, groups = shared_negatives(device, TOKENS, seed=11)
    t[::5] = ids[::5][: t[::5].numel()]  # targets that are also negatives (masked out for their row)
    assert_matches(ref.sampled_softmax_cross_entropy, fused_nce.sampled_softmax_cross_entropy,
                   [h, w, b if with_bias else None, t, ids, counts, groups], [0, 1, 2] if with_bias else [0, 1])


def test_sampled_softmax_shared_negatives_edge_cases(device):
    h, w, b, t = make(device, rows=6, seed=12)
    ids, counts, groups = shared_negatives(device, 6, seed=13, distinct=30)
    counts[:] = 0  # no negative at all: every row's loss is 0
    loss, _ = assert_matches(ref.sampled_softmax_cross_entropy, fused_nce.sampled_softmax_cross_entropy,
                             [h, w, b, t, ids, counts, groups], [0, 1, 2])
    assert loss.item() == 0.0
    loss, _ = assert_matches(ref.sampled_softmax_cross_entropy, fused_nce.sampled_softmax_cross_entropy,
                             [h[:0], w, b, t[:0], ids, counts, groups[:0]], [0, 1, 2])
    assert loss.item() == 0.0
    with pytest.raises(ValueError, match=r"anchor_groups must be \[6\]"):
        fused_nce.sampled_softmax_cross_entropy(h, w, b, t, ids, counts, groups[:2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_half_width_gradient_written_over_the_scores_equals_a_separate_buffer(device, dtype, with_bias):
    """The low-precision path writes dL/dZ into Z's own rows (`narrow_view`): the same losses and the
    same gradient bits as the row kernel writing a separate [R, V] buffer, over several 4,096-wide blocks
    (so a block's stores land on scores earlier blocks read) and with excluded (-inf) entries."""
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 5, 9000  # 3 blocks of 4,096 columns, the last one partial
    z = (torch.randn(rows, vocab, generator=gen) * 3).to(device)
    z[1, 100:200] = float("-inf")
    targets = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    targets[2] = -100  # an ignored row: its gradient is zero
    bias = (torch.randn(vocab, generator=gen) * 0.1).to(device) if with_bias else None
    inv = torch.full((1,), 1.0 / 4, device=device)
    loss_ref, loss = (torch.empty(rows, device=device) for _ in range(2))
    separate = torch.empty(rows, vocab, dtype=dtype, device=device)
    fused.softmax_xent_rows(z.clone(), targets, loss_ref, inv, separate, bias)
    scores = z.clone()
    grad = fused.narrow_view(scores, dtype)
    assert grad.shape == (rows, vocab) and grad.stride(0) == 2 * vocab and grad.data_ptr() == scores.data_ptr()
    fused.softmax_xent_rows(scores, targets, loss, inv, grad, bias)
    assert torch.equal(loss, loss_ref)
    assert torch.equal(grad, separate) and grad[2].abs().max() == 0 and separate.abs().max() > 0
    with pytest.raises(ValueError, match="narrow_view"):  # z's memory in another layout: refused
        fused.softmax_xent_rows(scores, targets, loss, inv, scores.view(dtype).view(2 * rows, vocab)[:rows], bias)


def test_backward_scales_and_casts_in_one_op_and_chunk_budget_restores():
    g32 = torch.randn(6, 4)
    g16 = g32.to(torch.bfloat16)
    scale = torch.tensor(0.37)
    dh, dw, none = fused.scaled_grads((g32, g16, None), scale, (torch.bfloat16, torch.bfloat16, None))
    assert dh.dtype == dw.dtype == torch.bfloat16 and none is None
    assert torch.equal(dh, (g32 * scale).to(torch.bfloat16))  # one rounding of the fp32 product
    assert torch.equal(dw, g16 * scale)
    before = fused.CHUNK_BYTES
    with fused.chunk_budget(4 * VOCAB * 20):
        assert fused.chunk_rows_for(VOCAB, TOKENS) == 16
    assert fused.CHUNK_BYTES == before
