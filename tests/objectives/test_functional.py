"""Every loss in `pipeline.kernels.functional` against a naive loop written from the paper's
equation: forward value and gradients, what must be detached, known special values, bf16."""
from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from pipeline.kernels import functional as Fn

torch.set_default_dtype(torch.float32)


def leaf(*shape, scale: float = 1.0, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_(True)


def twin(t: torch.Tensor) -> torch.Tensor:
    """float64 copy with its own gradient, for the naive reference."""
    return t.detach().double().requires_grad_(t.requires_grad)


def check(actual: torch.Tensor, expected: torch.Tensor, inputs: list[torch.Tensor], refs: list[torch.Tensor]) -> None:
    assert actual.dtype == torch.float32 and actual.dim() == 0
    assert_close(actual, expected.float(), rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(actual, inputs, allow_unused=True)
    ref_grads = torch.autograd.grad(expected, refs, allow_unused=True)
    for got, want in zip(grads, ref_grads):
        if want is None:
            assert got is None or torch.count_nonzero(got) == 0
        else:
            assert_close(got, want.float(), rtol=1e-4, atol=1e-5)


# ---- MLM -----------------------------------------------------------------------------------
def naive_linear_ce(h, w, b, t, ignore=-100):
    losses = []
    for n in range(h.shape[0]):
        if t[n] == ignore:
            continue
        logits = torch.stack([w[v] @ h[n] + b[v] for v in range(w.shape[0])])
        losses.append(-(logits[t[n]] - torch.log(torch.exp(logits).sum())))
    return torch.stack(losses).mean() if losses else (h.sum() + w.sum()) * 0


@pytest.mark.parametrize("n,v,h", [(7, 13, 8), (1, 5, 3), (16, 31, 4)])
def test_linear_cross_entropy_matches_naive(n, v, h):
    hidden, weight, bias = leaf(n, h, seed=1), leaf(v, h, seed=2), leaf(v, seed=3)
    targets = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(4))
    targets[::3] = -100 if n > 1 else targets[::3]
    refs = [twin(hidden), twin(weight), twin(bias)]
    check(Fn.linear_cross_entropy(hidden, weight, bias, targets), naive_linear_ce(*refs, targets), [hidden, weight, bias], refs)


def test_linear_cross_entropy_without_bias_and_all_ignored():
    hidden, weight = leaf(4, 6), leaf(9, 6, seed=1)
    targets = torch.tensor([1, 2, 3, 4])
    expected = naive_linear_ce(twin(hidden), twin(weight), torch.zeros(9, dtype=torch.float64), targets)
    assert_close(Fn.linear_cross_entropy(hidden, weight, None, targets), expected.float())
    none = Fn.linear_cross_entropy(hidden, weight, None, torch.full((4,), -100))
    assert none.item() == 0.0
    none.backward()  # still part of the graph
    assert hidden.grad is not None and torch.count_nonzero(hidden.grad) == 0


# ---- BERT-NCE --------------------------------------------------------------------------------
def naive_row_loss(h_n, w, b, target, negative_ids):
    """-log(e^{s_t} / (e^{s_t} + sum over negatives v != t of e^{s_v})), s_v = w_v . h + b_v, one loop."""
    pos = torch.exp(w[target] @ h_n + b[target])
    denom = pos.clone()
    for v in negative_ids:
        if v != target:  # a negative equal to the target is not a negative
            denom = denom + torch.exp(w[v] @ h_n + b[v])
    return -torch.log(pos / denom)


def naive_sampled_softmax(h, w, b, t, neg):
    return torch.stack([naive_row_loss(h[n], w, b, int(t[n]), neg[n].tolist()) for n in range(h.shape[0])]).mean()


def test_sampled_softmax_matches_naive_and_skips_target_duplicates():
    n, v, hsz, k = 6, 11, 5, 4
    hidden, weight, bias = leaf(n, hsz), leaf(v, hsz, seed=1), leaf(v, seed=2)
    g = torch.Generator().manual_seed(3)
    targets = torch.randint(0, v, (n,), generator=g)
    negatives = torch.randint(0, v, (n, k), generator=g)
    negatives[0, 1] = targets[0]  # a duplicate of the positive
    negatives[2, :] = targets[2]  # only duplicates: loss 0 for that row
    refs = [twin(hidden), twin(weight), twin(bias)]
    check(
        Fn.sampled_softmax_cross_entropy(hidden, weight, bias, targets, negatives),
        naive_sampled_softmax(*refs, targets, negatives),
        [hidden, weight, bias],
        refs,
    )


def test_sampled_softmax_with_full_vocabulary_equals_cross_entropy():
    n, v, hsz = 5, 7, 4
    hidden, weight, bias = leaf(n, hsz), leaf(v, hsz, seed=1), leaf(v, seed=2)
    targets = torch.tensor([0, 3, 6, 2, 2])
    negatives = torch.arange(v).expand(n, v)  # every id; the target's own copy is masked out
    assert_close(
        Fn.sampled_softmax_cross_entropy(hidden, weight, bias, targets, negatives),
        Fn.linear_cross_entropy(hidden, weight, bias, targets),
    )


def naive_nce_every_token(h, w, b, t, anchor_seq, pool_ids, pool_seq):
    """BERT-NCE whose negatives are every pool token (each occurrence) of the *other* sequences."""
    losses = []
    for n in range(h.shape[0]):
        others = [v for v, seq in zip(pool_ids.tolist(), pool_seq.tolist()) if seq != anchor_seq[n]]
        losses.append(naive_row_loss(h[n], w, b, int(t[n]), others))
    return torch.stack(losses).mean()


def test_sampled_softmax_shared_layout_is_every_token_of_the_other_sequences():
    n, v, hsz, seqs = 7, 13, 5, 3
    hidden, weight, bias = leaf(n, hsz), leaf(v, hsz, seed=1), leaf(v, seed=2)
    g = torch.Generator().manual_seed(3)
    pool_ids = torch.randint(0, v, (40,), generator=g)  # repeated ids, as in real text
    pool_seq = torch.sort(torch.randint(0, seqs, (40,), generator=g)).values
    anchor_seq = torch.randint(0, seqs, (n,), generator=g)
    targets = pool_ids[torch.randint(0, 40, (n,), generator=g)]  # targets also occur as negatives
    ids = torch.tensor([3, 0, 5, 7, 3, 1, 2, 4, 6, 8, 9, 10, 11, 12])  # every id; 3 twice (counts add up)
    counts = torch.zeros(seqs, ids.numel(), dtype=torch.long)
    for s in range(seqs):  # occurrences outside sequence s, all put on the first copy of each id
        for tok, seq in zip(pool_ids.tolist(), pool_seq.tolist()):
            if seq != s:
                counts[s, (ids == tok).nonzero()[0, 0]] += 1
    refs = [twin(hidden), twin(weight), twin(bias)]
    shared = Fn.sampled_softmax_cross_entropy(hidden, weight, bias, targets, ids, counts, anchor_seq)
    check(shared, naive_nce_every_token(*refs, targets, anchor_seq, pool_ids, pool_seq), [hidden, weight, bias], refs)
    # the same multiset as per-row negatives (padded with the target, which is masked out)
    rows = [[tok for tok, seq in zip(pool_ids.tolist(), pool_seq.tolist()) if seq != anchor_seq[i]] for i in range(n)]
    width = max(map(len, rows))
    per_row = torch.tensor([r + [int(targets[i])] * (width - len(r)) for i, r in enumerate(rows)])
    assert_close(Fn.sampled_softmax_cross_entropy(hidden, weight, bias, targets, per_row), shared)
    with pytest.raises(ValueError, match=r"negative_counts must be \[G, 14\]"):
        Fn.sampled_softmax_cross_entropy(hidden, weight, bias, targets, ids, counts[:, :3], anchor_seq)


# ---- COCO-LM -------------------------------------------------------------------------------
def naive_corrective_lm(h, w, b, copy_prob, corrupted, targets):
    losses = []
    for n in range(h.shape[0]):
        logits = torch.stack([w[v] @ h[n] + b[v] for v in range(w.shape[0])])
        p_lm = torch.exp(logits[targets[n]]) / torch.exp(logits).sum()
        pc = copy_prob[n].detach()  # sg(p_copy)
        p = (1.0 if targets[n] == corrupted[n] else 0.0) * pc + (1 - pc) * p_lm
        losses.append(-torch.log(p))
    return torch.stack(losses).mean()


def test_corrective_lm_matches_naive_and_stops_copy_gradient():
    n, v, hsz = 8, 9, 6
    hidden, weight, bias = leaf(n, hsz), leaf(v, hsz, seed=1), leaf(v, seed=2)
    copy_prob = torch.rand(n, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    g = torch.Generator().manual_seed(4)
    targets = torch.randint(0, v, (n,), generator=g)
    corrupted = torch.where(torch.rand(n, generator=g) < 0.5, targets, torch.randint(0, v, (n,), generator=g))
    refs = [twin(hidden), twin(weight), twin(bias), twin(copy_prob)]
    actual = Fn.corrective_lm_loss(hidden, weight, bias, copy_prob, corrupted, targets)
    expected = naive_corrective_lm(*refs[:3], refs[3], corrupted, targets)
    check(actual, expected, [hidden, weight, bias, copy_prob], refs)


def test_corrective_lm_saturated_copy_head_stays_finite():
    hidden, weight = leaf(3, 4), leaf(6, 4, seed=1)
    targets = torch.tensor([1, 2, 3])
    corrupted = torch.tensor([1, 5, 3])  # row 1 was replaced, but the copy head says "copy" with p = 1
    loss = Fn.corrective_lm_loss(hidden, weight, None, torch.ones(3), corrupted, targets)
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(hidden.grad).all()


def test_copy_loss_matches_binary_cross_entropy_formula():
    logits = leaf(10)
    target = torch.rand(10, generator=torch.Generator().manual_seed(1)) < 0.5
    ref = twin(logits)
    p = torch.sigmoid(ref)
    expected = -torch.stack([torch.log(p[i]) if target[i] else torch.log(1 - p[i]) for i in range(10)]).mean()
    check(Fn.copy_loss(logits, target), expected, [logits], [ref])


# ---- TACO ----------------------------------------------------------------------------------
def naive_token_contrastive(g, anchors, positives, negatives, tau, detach=True):
    def f(a, b):  # Eq. 7
        return torch.dot(a, b) / (a.norm() * b.norm()) / tau

    losses = []
    for n in range(anchors.shape[0]):
        gx = g[anchors[n]]
        cand = g.detach() if detach else g
        pos = torch.exp(f(gx, cand[positives[n]]))
        neg = sum(torch.exp(f(gx, cand[k])) for k in negatives[n].tolist())
        losses.append(-torch.log(pos / (pos + neg)))  # Eq. 6
    return torch.stack(losses).mean()  # Eq. 8


@pytest.mark.parametrize("detach", [True, False])
def test_token_contrastive_matches_naive(detach):
    t, hsz, n, k = 20, 6, 7, 5
    g = leaf(t, hsz)
    gen = torch.Generator().manual_seed(1)
    anchors = torch.randperm(t, generator=gen)[:n]
    positives = torch.randint(0, t, (n,), generator=gen)
    negatives = torch.randint(0, t, (n, k), generator=gen)
    ref = twin(g)
    check(
        Fn.token_contrastive_loss(g, anchors, positives, negatives, 0.1, detach),
        naive_token_contrastive(ref, anchors, positives, negatives, 0.1, detach),
        [g],
        [ref],
    )


def test_token_contrastive_gradient_reaches_anchors_only_when_detached():
    g = leaf(10, 4)
    anchors, positives = torch.tensor([0, 1]), torch.tensor([2, 3])
    negatives = torch.tensor([[4, 5], [6, 7]])
    (grad,) = torch.autograd.grad(Fn.token_contrastive_loss(g, anchors, positives, negatives, 0.07), g)
    assert torch.count_nonzero(grad[2:]) == 0 and torch.count_nonzero(grad[:2]) > 0


def test_token_contrastive_known_values():
    k, tau = 50, 0.07
    same = torch.ones(60, 8)  # identical vectors everywhere: every score is 1/tau
    anchors = torch.arange(5)
    negatives = torch.randint(0, 60, (5, k), generator=torch.Generator().manual_seed(0))
    assert_close(Fn.token_contrastive_loss(same, anchors, anchors + 1, negatives, tau), torch.tensor(math.log(k + 1)))
    # anchor == positive direction, negatives orthogonal: -log(e^{1/tau} / (e^{1/tau} + K))
    g = torch.zeros(3, 2)
    g[0, 0], g[1, 0], g[2, 1] = 1.0, 2.0, 3.0
    loss = Fn.token_contrastive_loss(g, torch.tensor([0]), torch.tensor([1]), torch.full((1, k), 2), tau)
    assert_close(loss, torch.tensor(math.log(1 + k * math.exp(-1 / tau))))


# ---- sequence contrast (CAPT / COCO-LM SCL / InfoWord DIM) ------------------------------------
def naive_capt(s, s_hat, tau, queue=None):
    """CAPT Eq. 2-4 (averaged), cosine scores, queue rows as extra negatives."""
    s = [x / x.norm() for x in s]
    s_hat = [x / x.norm() for x in s_hat]
    q = [] if queue is None else [x / x.norm() for x in queue.detach()]

    def one(anchor, other_view, same_view, i):
        num = torch.exp(anchor[i] @ other_view[i] / tau)
        den = sum(torch.exp(anchor[i] @ other_view[j] / tau) for j in range(len(s)))
        den = den + sum(torch.exp(anchor[i] @ same_view[j] / tau) for j in range(len(s)) if j != i)
        den = den + sum(torch.exp(anchor[i] @ x / tau) for x in q)
        return -torch.log(num / den)

    losses = [(one(s, s_hat, s, i) + one(s_hat, s, s_hat, i)) / 2 for i in range(len(s))]
    return torch.stack(losses).mean()


@pytest.mark.parametrize("with_queue", [False, True])
def test_sequence_contrastive_matches_capt_equations(with_queue):
    a, b = leaf(5, 6), leaf(5, 6, seed=1)
    queue = leaf(7, 6, seed=2) if with_queue else None
    refs = [twin(a), twin(b)]
    qref = None if queue is None else twin(queue)
    actual = Fn.sequence_contrastive_loss(a, b, 0.2, queue)
    check(actual, naive_capt(refs[0], refs[1], 0.2, qref), [a, b] + ([queue] if queue is not None else []), refs + ([qref] if qref is not None else []))


def test_sequence_contrastive_is_nt_xent_over_2n():
    a, b = leaf(4, 5), leaf(4, 5, seed=1)
    ra, rb = twin(a), twin(b)
    z = torch.cat([ra, rb])
    z = z / z.norm(dim=1, keepdim=True)
    n, tau, losses = 4, 0.5, []
    for k in range(2 * n):
        partner = (k + n) % (2 * n)
        den = sum(torch.exp(z[k] @ z[m] / tau) for m in range(2 * n) if m != k)
        losses.append(-torch.log(torch.exp(z[k] @ z[partner] / tau) / den))
    check(Fn.sequence_contrastive_loss(a, b, tau), torch.stack(losses).mean(), [a, b], [ra, rb])


def test_sequence_contrastive_dot_product_dim_form():
    a, b = leaf(6, 4), leaf(6, 4, seed=1)
    ra, rb = twin(a), twin(b)
    expected = torch.stack(
        [-(ra[i] @ rb[i] - torch.log(sum(torch.exp(ra[i] @ rb[j]) for j in range(6)))) for i in range(6)]
    ).mean()
    actual = Fn.sequence_contrastive_loss(a, b, 1.0, normalize=False, symmetric=False, same_view_negatives=False)
    check(actual, expected, [a, b], [ra, rb])


def naive_capt_eq4(s, s_hat, tau):
    """CAPT Eq. 4 exactly: the *sum* of L(x_i) + L(x^_i) (Eq. 2, 3) over the n pairs."""
    s = [x / x.norm() for x in s]
    s_hat = [x / x.norm() for x in s_hat]

    def loss(anchor, other, same, i):
        den = sum(torch.exp(anchor[i] @ other[j] / tau) for j in range(len(s)))
        den = den + sum(torch.exp(anchor[i] @ same[j] / tau) for j in range(len(s)) if j != i)
        return -torch.log(torch.exp(anchor[i] @ other[i] / tau) / den)

    return sum(loss(s, s_hat, s, i) + loss(s_hat, s, s_hat, i) for i in range(len(s)))


def test_sequence_contrastive_sum_is_capt_eq4_and_mean_divides_by_2n():
    a, b = leaf(5, 6), leaf(5, 6, seed=1)
    refs = [twin(a), twin(b)]
    total = Fn.sequence_contrastive_loss(a, b, 0.2, reduction="sum")
    check(total, naive_capt_eq4(*refs, 0.2), [a, b], refs)
    assert_close(Fn.sequence_contrastive_loss(a, b, 0.2) * 10, total)  # mean = sum / 2n
    with pytest.raises(ValueError, match="reduction must be one of"):
        Fn.sequence_contrastive_loss(a, b, 0.2, reduction="avg")


def naive_dim_pairs(sentences, ngrams, owner, extra, tau):
    """InfoWord I_DIM with several n-grams per sentence: pair m = (sentence owner[m], n-gram m);
    negatives = the n-grams of the other sentences and the extra rows (other ranks)."""
    losses = []
    for m in range(ngrams.shape[0]):
        a = sentences[owner[m]]
        num = torch.exp(a @ ngrams[m] / tau)
        den = num + sum(torch.exp(a @ ngrams[j] / tau) for j in range(ngrams.shape[0]) if owner[j] != owner[m])
        den = den + sum(torch.exp(a @ q / tau) for q in extra.detach())
        losses.append(-torch.log(num / den))
    return torch.stack(losses).mean()


def test_sequence_contrastive_groups_give_infoword_dim_with_several_ngrams():
    sentences, ngrams, extra = leaf(4, 6, scale=0.5), leaf(9, 6, seed=1, scale=0.5), leaf(5, 6, seed=2, scale=0.5)
    owner = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3])
    refs = [twin(sentences), twin(ngrams)]
    actual = Fn.sequence_contrastive_loss(sentences[owner], ngrams, 0.7, extra, normalize=False, symmetric=False,
                                          same_view_negatives=False, groups=owner)
    check(actual, naive_dim_pairs(*refs, owner, twin(extra), 0.7), [sentences, ngrams], refs)


def test_adaptive_temperature_inverted_triangle():
    assert Fn.adaptive_temperature(0, 1000) == pytest.approx(0.55)
    assert Fn.adaptive_temperature(500, 1000) == pytest.approx(0.05)
    assert Fn.adaptive_temperature(1000, 1000) == pytest.approx(0.55)
    assert Fn.adaptive_temperature(250, 1000) == pytest.approx(0.30)
    with pytest.raises(ValueError, match="total_steps"):
        Fn.adaptive_temperature(0, 0)


# ---- metrics -------------------------------------------------------------------------------
def pairwise_auc(scores, positive, keep):
    """AUC by its definition: over every (positive, negative) pair of kept rows, 1 if the positive
    scores higher, 1/2 on a tie."""
    pos = [float(s) for s, p, k in zip(scores, positive, keep) if k and p]
    neg = [float(s) for s, p, k in zip(scores, positive, keep) if k and not p]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def midrank_auc(scores, positive, keep):
    """The rank-sum form: ranks 1..n of the kept rows, tied rows given their mean rank."""
    rows = sorted((float(s), bool(p)) for s, p, k in zip(scores, positive, keep) if k)
    ranks, i = [], 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j][0] == rows[i][0]:
            j += 1
        ranks += [(i + 1 + j) / 2] * (j - i)  # mean of ranks i+1 .. j
        i = j
    n_pos = sum(p for _, p in rows)
    n_neg = len(rows) - n_pos
    return (sum(r for r, (_, p) in zip(ranks, rows) if p) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def test_binary_auc_hand_values():
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.4])
    positive = torch.tensor([False, False, True, True, True])
    # positives 0.35 (beats 0.1), 0.8 (beats both), 0.4 (beats 0.1, ties 0.4): (1 + 2 + 1.5) / 6
    assert Fn.binary_auc(scores, positive).item() == pytest.approx(0.75)
    # the last row left out: (1 + 2) / 4
    assert Fn.binary_auc(scores, positive, torch.tensor([1, 1, 1, 1, 0])).item() == pytest.approx(0.75)
    assert Fn.binary_auc(-scores, positive).item() == pytest.approx(0.25)  # reversed ranking: 1 - AUC
    assert Fn.binary_auc(torch.zeros(6), torch.arange(6) % 2 == 0).item() == 0.5  # constant score: every pair tied
    perfect = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert Fn.binary_auc(perfect, perfect >= 2).item() == 1.0
    assert math.isnan(Fn.binary_auc(perfect, torch.zeros(4, dtype=torch.bool)).item())  # one class only


@pytest.mark.parametrize("levels", [None, 5])
def test_binary_auc_matches_pairwise_and_midrank_references(levels):
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(301, generator=g)
    if levels is not None:  # many ties
        scores = torch.randint(0, levels, (301,), generator=g).float()
    positive = torch.rand(301, generator=g) < 0.2
    keep = torch.rand(301, generator=g) < 0.8
    got = Fn.binary_auc(scores, positive, keep)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert got.item() == pytest.approx(pairwise_auc(scores, positive, keep), abs=1e-6)
    assert got.item() == pytest.approx(midrank_auc(scores, positive, keep), abs=1e-6)


# ---- numerics ------------------------------------------------------------------------------
def test_losses_stay_finite_in_bf16_autocast_at_low_temperature():
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(32, 16, generator=g) * 30).bfloat16().requires_grad_(True)
    weight = (torch.randn(50, 16, generator=g) * 30).bfloat16()
    targets = torch.randint(0, 50, (32,), generator=g)
    idx = torch.randint(0, 32, (32, 8), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [
            Fn.linear_cross_entropy(hidden, weight, None, targets),
            Fn.sampled_softmax_cross_entropy(hidden, weight, None, targets, idx),
            Fn.corrective_lm_loss(hidden, weight, None, torch.rand(32, generator=g).bfloat16(), targets, targets),
            Fn.token_contrastive_loss(hidden, torch.arange(32), idx[:, 0], idx, 0.05),
            Fn.sequence_contrastive_loss(hidden[:16], hidden[16:], 0.05, queue=hidden[:8]),
            Fn.sequence_contrastive_loss(hidden[:16], hidden[16:], 0.05, normalize=False, symmetric=False),
        ]
    for loss in losses:
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        (grad,) = torch.autograd.grad(loss, hidden, allow_unused=True)
        assert grad is None or torch.isfinite(grad.float()).all()
