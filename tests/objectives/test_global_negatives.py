"""Negatives at scale: BERT-NCE over every token of the (global) batch, InfoWord DIM with several
n-grams per sentence and n-gram negatives all-gathered across ranks, CAPT's explicit reduction and
in-batch negatives gathered across ranks. Each against a loop written from the paper; the
cross-rank parts with 2 gloo ranks against a single-process computation over the concatenated batch."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pipeline.data.batch import content_tokens
from pipeline.kernels import functional as Fn
from pipeline.objectives.base import StepProgress
from pipeline.objectives.infoword import build_ngram_inputs, dim_contrastive_loss
from tests.gloo_ranks import spawn_gloo_ranks
from tests.objectives.conftest import SPECIAL, VOCAB, make_batch, tiny_model
from tests.objectives.test_functional import naive_dim_pairs

QUIET = dict(dropout=0.0, attention_dropout=0.0)


# ---- BERT-NCE: num_negatives "all" ------------------------------------------------------------------
def naive_nce(model, batch, negatives_of) -> tuple[float, float, float]:
    """mean over masked positions of -log(e^{s(t)} / (e^{s(t)} + sum_{v in Neg, v != t} e^{s(v)})), the
    mean |Neg \\ {t}| and the chance loss, mean ln(1 + |Neg \\ {t}|); `negatives_of(i)` lists the negative ids
    (each occurrence) of a position of row i."""
    with torch.no_grad():
        t_h = model.cls.predictions.transform(model.bert(batch["masked_ids"], batch["attention_mask"]).last_hidden)
        weight, bias = model.cls.predictions.decoder.weight, model.cls.predictions.decoder.bias
        losses, sizes = [], []
        for i, j in torch.nonzero(batch["mlm_labels"] != -100).tolist():
            target = int(batch["mlm_labels"][i, j])
            score = lambda v: t_h[i, j] @ weight[v] + bias[v]  # noqa: E731
            negatives = [v for v in negatives_of(i) if v != target]
            denominator = torch.exp(score(target)) + sum(torch.exp(score(v)) for v in negatives)
            losses.append(-torch.log(torch.exp(score(target)) / denominator))
            sizes.append(len(negatives))
    return torch.stack(losses).mean().item(), sum(sizes) / len(sizes), float(np.mean(np.log1p(sizes)))


def pool_of(batch, source: str) -> list[list[int]]:
    """Per row, the pool tokens of `source` (content tokens, or the masked targets)."""
    if source == "other_targets":
        keep, values = batch["mlm_labels"] != -100, batch["mlm_labels"]
    else:
        keep, values = content_tokens(batch), batch["input_ids"]
    return [values[i][keep[i]].tolist() for i in range(values.shape[0])]


@pytest.mark.parametrize("source", ["other_sequences", "other_targets", "batch", "uniform"])
def test_nce_all_negatives_are_every_token_of_the_pool(source):
    batch = make_batch(batch_size=4, seed=8)
    model = tiny_model({"mlm-nce": 1.0}, {"mlm-nce": {"negatives": source, "num_negatives": "all"}}, **QUIET)
    loss, metrics = model(batch)
    rows = pool_of(batch, source)
    negatives_of = {
        "other_sequences": lambda i: [v for r, row in enumerate(rows) if r != i for v in row],
        "other_targets": lambda i: [v for r, row in enumerate(rows) if r != i for v in row],
        "batch": lambda i: [v for row in rows for v in row],
        "uniform": lambda i: [v for v in range(VOCAB) if v not in SPECIAL.values()],
    }[source]
    expected, size, chance = naive_nce(model, batch, negatives_of)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["mlm-nce/negatives"].item() == pytest.approx(size)
    assert metrics["mlm-nce/loss_chance"].item() == pytest.approx(chance, rel=1e-6)


def test_nce_rejects_a_bad_count():
    with pytest.raises(ValueError, match="num_negatives must be an integer >= 1 or 'all'"):
        tiny_model({"mlm-nce": 1.0}, {"mlm-nce": {"num_negatives": "every"}})


# ---- InfoWord DIM: several n-grams per sentence -------------------------------------------------------
def test_infoword_all_ngrams_per_sentence_matches_the_pairs_loop():
    batch = make_batch(batch_size=4, seed=9)
    model = tiny_model({"infoword": 1.0}, {"infoword": {"ngrams_per_sentence": "all"}}, **QUIET)
    _, metrics = model(batch)
    span_index = batch["span_index"]
    with torch.no_grad():
        sentences = model.bert(batch["span_masked_ids"], batch["attention_mask"]).last_hidden[:, 0]
        owner, ngrams = [], []
        for i in range(span_index.shape[0]):
            for s in range(int(span_index[i].max()) + 1):  # every span, each n-gram encoded on its own
                ids, mask = build_ngram_inputs(batch["input_ids"][i : i + 1], span_index[i : i + 1], torch.tensor([s]),
                                               SPECIAL["cls"], SPECIAL["sep"], SPECIAL["pad"])
                ngrams.append(model.bert(ids, mask).last_hidden[0, 0])
                owner.append(i)
        owner_t = torch.tensor(owner)
        expected = naive_dim_pairs(sentences.double(), torch.stack(ngrams).double(), owner_t, torch.zeros(0, 1), 1.0)
    assert metrics["infoword/dim_pairs"].item() == len(owner) > span_index.shape[0]
    assert metrics["infoword/dim_loss"].item() == pytest.approx(expected.item(), rel=1e-4)
    same = torch.bincount(owner_t)[owner_t]
    per_pair = (len(owner) - same).float()
    assert metrics["infoword/dim_negatives"].item() == pytest.approx(per_pair.mean().item())
    assert metrics["infoword/dim_loss_chance"].item() == pytest.approx(torch.log1p(per_pair).mean().item())


def test_infoword_mean_pooled_centred_cosine_dim_matches_the_pairs_loop():
    """The small-scale DIM (tiny-infoword, issue 29): each view is the mean of its word states (the
    paper's footnote 4; the sentence's [MASK]ed spans are words of it, [CLS] / [SEP] / padding are
    not), minus the mean over the micro-batch's rows of that view, scored by cosine / tau."""
    batch = make_batch(batch_size=4, seed=9)
    options = {"ngrams_per_sentence": "all", "pool": "mean", "center": True, "score": "cosine", "tau": 0.1}
    model = tiny_model({"infoword": 1.0}, {"infoword": options}, **QUIET)
    _, metrics = model(batch)
    span_index, ids = batch["span_index"], batch["input_ids"]
    special = set(SPECIAL.values())
    with torch.no_grad():
        hidden = model.bert(batch["span_masked_ids"], batch["attention_mask"]).last_hidden
        sentences, owner, ngrams = [], [], []
        for i in range(span_index.shape[0]):
            words = [j for j in range(ids.shape[1]) if batch["attention_mask"][i, j] and int(ids[i, j]) not in special]
            sentences.append(hidden[i, words].mean(0))
            for s in range(int(span_index[i].max()) + 1):
                cols = [j for j in range(ids.shape[1]) if span_index[i, j] == s]
                row = torch.tensor([[SPECIAL["cls"], *ids[i, cols].tolist(), SPECIAL["sep"]]])
                ngrams.append(model.bert(row, torch.ones_like(row)).last_hidden[0, 1:-1].mean(0))
                owner.append(i)
        a, b = torch.stack(sentences).double(), torch.stack(ngrams).double()
        a, b = a - a.mean(0), b - b.mean(0)
        a, b = a / a.norm(dim=1, keepdim=True), b / b.norm(dim=1, keepdim=True)
        expected = naive_dim_pairs(a, b, torch.tensor(owner), torch.zeros(0, a.shape[1]), 0.1)
    assert metrics["infoword/dim_loss"].item() == pytest.approx(expected.item(), rel=1e-4)


def test_infoword_ngram_options_are_checked():
    for bad, match in (({"ngrams_per_sentence": 0}, "ngrams_per_sentence"), ({"dim_negatives": "all"}, "dim_negatives"),
                       ({"pool": "max"}, "pool"), ({"center": "yes"}, "center")):
        with pytest.raises(ValueError, match=match):
            tiny_model({"infoword": 1.0}, {"infoword": bad})


# ---- CAPT: reduction -----------------------------------------------------------------------------------
def test_capt_sum_is_eq4_over_the_global_batch_and_mean_divides_by_2n():
    batch = make_batch(batch_size=5, seed=11)
    options = {"tau": 0.1, "queue_size": 0}
    mean = tiny_model({"capt": 1.0}, {"capt": options}, **QUIET)(batch)[0]
    total = tiny_model({"capt": 1.0}, {"capt": {**options, "reduction": "sum"}}, **QUIET)(batch, StepProgress(1, 10, 3))[0]
    assert total.item() == pytest.approx(mean.item() * 2 * 5 * 3, rel=1e-5)  # 2n terms, 3 micro-batches per step
    with pytest.raises(ValueError, match="reduction"):
        tiny_model({"capt": 1.0}, {"capt": {"reduction": "avg"}})
    with pytest.raises(ValueError, match="batch_negatives"):
        tiny_model({"capt": 1.0}, {"capt": {"batch_negatives": "world"}})


def test_capt_global_batch_negatives_on_one_rank_are_the_local_ones():
    batch = make_batch(batch_size=4, seed=12)
    local = tiny_model({"capt": 1.0}, {"capt": {"tau": 0.1}}, **QUIET)
    glob = tiny_model({"capt": 1.0}, {"capt": {"tau": 0.1, "batch_negatives": "global"}}, **QUIET)
    for _ in range(2):  # the second step has 8 queued rows
        (loss_l, m_l), (loss_g, m_g) = local(batch), glob(batch)
        assert loss_g.item() == pytest.approx(loss_l.item(), rel=1e-6)
        assert m_g["capt/negatives"].item() == m_l["capt/negatives"].item()
    assert m_l["capt/negatives"].item() == 2 * 4 - 2 + 8


# ---- two gloo ranks --------------------------------------------------------------------------------------
DIM_OWNERS = ([0, 0, 1, 2, 2], [0, 2])  # rank 0: 5 n-grams of 3 sentences, rank 1: 2 n-grams


def dim_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    owner = torch.tensor(DIM_OWNERS[rank])
    return torch.randn(3, 8, generator=g) * 0.5, torch.randn(owner.numel(), 8, generator=g) * 0.5, owner


def _rank_main(rank: int, out_dir: str) -> None:
    out = {}
    sentences, ngrams, owner = (x.requires_grad_(x.is_floating_point()) for x in dim_inputs(rank))
    loss, negatives, chance = dim_contrastive_loss(Fn.sequence_contrastive_loss, sentences, ngrams, owner, 0.7, False,
                                                   True)
    loss.backward()
    out["dim"] = (loss.detach(), negatives, sentences.grad, ngrams.grad, chance)

    batch = make_batch(batch_size=3, seed=20 + rank)
    capt = tiny_model({"capt": 1.0}, {"capt": {"tau": 0.1, "queue_size": 0, "batch_negatives": "global"}}, **QUIET)
    loss, metrics = capt(batch)
    loss.backward()
    out["capt"] = (loss.detach(), metrics["capt/negatives"],
                   {n: p.grad.clone() for n, p in capt.named_parameters() if p.grad is not None})

    nce = tiny_model({"mlm-nce": 1.0}, {"mlm-nce": {"num_negatives": "all"}}, **QUIET)
    loss, metrics = nce(batch)
    out["nce"] = (loss.detach(), metrics["mlm-nce/negatives"])

    infoword = tiny_model({"infoword": 1.0}, **QUIET)
    _, metrics = infoword(make_batch(batch_size=2 + rank, seed=30 + rank))
    out["infoword"] = {k: v for k, v in metrics.items() if k.startswith("infoword/dim")}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("global_negatives")
    spawn_gloo_ranks(_rank_main, 2, str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_dim_negatives_are_every_other_sentences_ngrams(two_ranks):
    inputs = [dim_inputs(r) for r in range(2)]
    for rank in range(2):
        sentences, ngrams, owner = inputs[rank]
        other = inputs[1 - rank][1]
        s_ref, n_ref = sentences.clone().requires_grad_(), ngrams.clone().requires_grad_()
        expected = Fn.sequence_contrastive_loss(s_ref[owner], n_ref, 0.7, other, normalize=False, symmetric=False,
                                                same_view_negatives=False, groups=owner)
        expected.backward()
        loss, negatives, s_grad, n_grad, chance = two_ranks[rank]["dim"]
        torch.testing.assert_close(loss, expected.detach())
        torch.testing.assert_close(s_grad, s_ref.grad)  # the gradient flows through the local rows only
        torch.testing.assert_close(n_grad, n_ref.grad)
        same = torch.bincount(owner)[owner]
        per_pair = (owner.numel() - same + other.shape[0]).float()
        assert negatives.item() == pytest.approx(per_pair.mean().item())
        assert chance.item() == pytest.approx(torch.log1p(per_pair).mean().item())  # mean over pairs of ln(1 + K_m)
    # the pair-weighted mean over ranks is L_DIM over the concatenated global batch (the paper's loop)
    sentences = torch.cat([inputs[0][0], inputs[1][0]])
    ngrams = torch.cat([inputs[0][1], inputs[1][1]])
    owner = torch.cat([inputs[0][2], inputs[1][2] + 3])
    full = naive_dim_pairs(sentences.double(), ngrams.double(), owner, torch.zeros(0, 8), 0.7)
    sizes = [len(o) for o in DIM_OWNERS]
    combined = sum(two_ranks[r]["dim"][0] * sizes[r] for r in range(2)) / sum(sizes)
    assert combined.item() == pytest.approx(full.item(), rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_capt_in_batch_negatives_span_the_global_batch(two_ranks):
    model = tiny_model({"capt": 1.0}, {"capt": {"tau": 0.1, "queue_size": 0}}, **QUIET)
    capt = model.objectives["capt"]
    batches = [make_batch(batch_size=3, seed=20 + r) for r in range(2)]

    def views(batch):
        s = capt.represent(model.bert(batch["input_ids"], batch["attention_mask"]).last_hidden[:, 0])
        return s, capt.represent(model.bert(batch["masked_ids"], batch["attention_mask"]).last_hidden[:, 0])

    for rank in range(2):
        model.zero_grad()
        other = torch.cat(views(batches[1 - rank])).detach()
        expected = Fn.sequence_contrastive_loss(*views(batches[rank]), 0.1, other)
        expected.backward()
        loss, negatives, grads = two_ranks[rank]["capt"]
        torch.testing.assert_close(loss, expected.detach())
        assert negatives.item() == 2 * 3 - 2 + 6
        for name, param in model.named_parameters():
            if name in grads:
                torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():  # the mean over ranks is CAPT over the concatenated batch (values)
        s = [views(b) for b in batches]
        full = Fn.sequence_contrastive_loss(torch.cat([s[0][0], s[1][0]]), torch.cat([s[0][1], s[1][1]]), 0.1)
    assert (two_ranks[0]["capt"][0] + two_ranks[1]["capt"][0]).item() / 2 == pytest.approx(full.item(), rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_nce_all_negatives_are_every_token_of_the_global_batch(two_ranks):
    batches = [make_batch(batch_size=3, seed=20 + r) for r in range(2)]
    model = tiny_model({"mlm-nce": 1.0}, {"mlm-nce": {"num_negatives": "all"}}, **QUIET)
    for rank in range(2):
        rows = pool_of(batches[rank], "other_sequences")
        remote = [v for row in pool_of(batches[1 - rank], "other_sequences") for v in row]
        expected, size, _ = naive_nce(model, batches[rank], lambda i: [v for r, row in enumerate(rows) if r != i for v in row] + remote)
        loss, negatives = two_ranks[rank]["nce"]
        assert loss.item() == pytest.approx(expected, rel=1e-5)
        assert negatives.item() == pytest.approx(size)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_infoword_logs_global_negatives(two_ranks):
    pairs = [two_ranks[r]["infoword"]["infoword/dim_pairs"].item() for r in range(2)]
    for rank in range(2):  # one n-gram per sentence: the other local pairs and every pair of the other rank
        got = two_ranks[rank]["infoword"]["infoword/dim_negatives"].item()
        assert got == pairs[rank] - 1 + pairs[1 - rank]
