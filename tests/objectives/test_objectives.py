"""Objectives inside `PretrainModel`: they learn, the right parameters get gradients (and COCO-LM's
sampling none), bf16 stays finite at tau 0.05, combinations share passes, no vocabulary-sized
logits exist for unselected positions, the NCE samplers hold log q outside the loss, and each
objective declares how it trains the MLM head."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.objectives.registry import OBJECTIVES
from pipeline.objectives.base import StepContext, StepProgress
from pipeline.kernels.functional import sequence_contrastive_loss
from pipeline.objectives.infoword import build_ngram_inputs
from tests.objectives.conftest import VOCAB, make_batch, tiny_model

ALL = ["mlm", "mlm-nce", "taco", "capt", "cocolm", "electra", "infoword"]
#: options making each objective quick and deterministic to train on one repeated batch (no CAPT
#: queue here: queued copies of the very same batch would be negatives equal to the positives)
FAST = {"capt": {"tau": 0.1, "queue_size": 0}, "mlm-nce": {"num_negatives": 16}, "infoword": {"num_negatives": 16}}


def test_registry_holds_every_objective():
    assert set(ALL) <= set(OBJECTIVES)


@pytest.mark.parametrize("name", ALL)
def test_loss_decreases_on_a_tiny_batch(name):
    model = tiny_model({name: 1.0}, FAST, dropout=0.0, attention_dropout=0.0)
    batch = make_batch(batch_size=6, seq_len=20, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for step in range(30):
        loss, metrics = model(batch, StepProgress(step, 30))
        assert torch.isfinite(loss) and metrics["loss"] == loss.detach()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, f"{name}: {losses}"


def _trainable(model, prefixes):
    return {n: p for n, p in model.named_parameters() if n.startswith(prefixes)}


EXPECTED_LEARNERS = {
    # every parameter under these prefixes must receive a non-zero gradient
    "mlm": ("bert.", "cls."),
    "mlm-nce": ("bert.", "cls."),
    "taco": ("bert.",),
    "capt": ("bert.", "objectives.capt."),
    "cocolm": ("bert.", "cls.", "objectives.cocolm."),
    "electra": ("bert.", "objectives.electra."),  # not cls.: the generator has its own head, the tied weight is bert.*
    "infoword": ("bert.", "cls."),
}


@pytest.mark.parametrize("name", ALL)
def test_every_parameter_that_should_learn_gets_a_gradient(name):
    model = tiny_model({name: 1.0}, FAST)
    loss, _ = model(make_batch(seed=2))
    loss.backward()
    learners = _trainable(model, EXPECTED_LEARNERS[name])
    assert learners
    missing = [n for n, p in learners.items() if p.grad is None or not torch.count_nonzero(p.grad)]
    assert not missing, f"{name}: no gradient for {missing}"
    idle = [n for n, p in model.named_parameters() if n not in learners and p.grad is not None and torch.count_nonzero(p.grad)]
    assert not idle, f"{name}: unexpected gradient for {idle}"


def test_cocolm_generator_learns_only_from_its_mlm_loss():
    model = tiny_model({"cocolm": 1.0}, {"cocolm": {"lambda_gen": 0.0}})
    loss, _ = model(make_batch(seed=3))
    loss.backward()
    gen = _trainable(model, ("objectives.cocolm.generator.", "objectives.cocolm.generator_head."))
    assert gen and all(p.grad is None or not torch.count_nonzero(p.grad) for p in gen.values())
    main = _trainable(model, ("objectives.cocolm.copy_head.", "objectives.cocolm.scl_head.", "bert.encoder."))
    assert all(p.grad is not None and torch.count_nonzero(p.grad) for p in main.values())


@pytest.mark.parametrize("mode", ["eval", "zero_dropout"])
def test_cocolm_replacements_are_sampled_without_dropout_at_selected_positions(mode):
    model = tiny_model({"cocolm": 1.0}, {"cocolm": {"sample_mode": mode}}, dropout=0.5, attention_dropout=0.5)
    model.train()
    batch = make_batch(seed=4)
    objective = model.objectives["cocolm"]
    replaced = []
    for _ in range(2):  # same sampling seed, different dropout draws
        g = torch.Generator().manual_seed(123)
        _, ids, flat, _ = objective.generate(StepContext(model.bert, model.cls, batch, StepProgress(), g, "torch"))
        replaced.append(ids)
    assert torch.equal(replaced[0], replaced[1])
    assert model.bert.embeddings.training and objective.generator.training  # modes restored
    changed = (replaced[0] != batch["masked_ids"]).reshape(-1).nonzero().squeeze(1)
    assert set(changed.tolist()) <= set(flat.tolist())
    assert flat.numel() == int((batch["mlm_labels"] != -100).sum())


def test_cocolm_generator_defaults_to_a_third_of_the_depth():
    model = tiny_model({"cocolm": 1.0}, num_layers=6)
    assert len(model.objectives["cocolm"].generator.layer) == 2
    assert not any("embeddings" in n for n, _ in model.objectives["cocolm"].named_parameters())


TAU_005 = {
    "mlm": {},
    "mlm-nce": {},
    "taco": {"tau": 0.05},
    "capt": {"tau": 0.05},
    "cocolm": {"tau": 0.05},
    "electra": {},
    "infoword": {"tau": 0.05, "score": "cosine"},
}


@pytest.mark.parametrize("name", ALL)
def test_bf16_autocast_at_tau_005_stays_finite(name):
    model = tiny_model({name: 1.0}, {name: TAU_005[name]})
    for seed in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, metrics = model(make_batch(seed=10 + seed))
        assert loss.dtype == torch.float32 and torch.isfinite(loss), metrics
        loss.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad


def test_infoword_dot_product_dim_is_finite_in_bf16():
    model = tiny_model({"infoword": 1.0})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = model(make_batch(seed=5))
    assert torch.isfinite(loss)


def _count_encoder_calls(model) -> list[int]:
    calls = []
    model.bert.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    return calls


def test_mlm_and_taco_share_one_encoder_pass():
    model = tiny_model({"mlm": 1.0, "taco": 1.0})
    calls = _count_encoder_calls(model)
    loss, metrics = model(make_batch())
    loss.backward()
    assert len(calls) == 1
    assert {"mlm/loss", "taco/loss", "taco/anchors"} <= set(metrics)
    assert metrics["loss"] == pytest.approx(float(metrics["mlm/loss"] + metrics["taco/loss"]), rel=1e-6)


def test_capt_encodes_both_views_once_each_and_mlm_reuses_the_masked_one():
    model = tiny_model({"mlm": 1.0, "capt": 1.0})
    calls = _count_encoder_calls(model)
    model(make_batch())
    assert len(calls) == 2


def test_cocolm_plus_taco_in_one_model():
    model = tiny_model({"cocolm": 1.0, "taco": 0.5})
    loss, metrics = model(make_batch())
    loss.backward()
    assert torch.isfinite(loss)
    assert metrics["loss"] == pytest.approx(float(metrics["cocolm/loss"] + 0.5 * metrics["taco/loss"]), rel=1e-6)
    assert model.views == {"original", "masked", "crop"}


@pytest.mark.parametrize("name", ALL)
def test_no_vocabulary_logits_for_unselected_positions(name, monkeypatch):
    """Every matmul against the [V, H] embedding matrix sees at most the selected rows."""
    batch = make_batch()
    labels = batch["span_labels"] if name == "infoword" else batch["mlm_labels"]
    selected = int((labels != -100).sum())
    rows_seen = []
    real_linear = F.linear

    def spy(x, weight, bias=None):
        if weight.shape[0] == VOCAB:
            rows_seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real_linear(x, weight, bias)

    monkeypatch.setattr(F, "linear", spy)
    model = tiny_model({name: 1.0}, FAST)
    model(batch)
    assert all(r <= selected for r in rows_seen), (rows_seen, selected)
    if name in ("mlm", "cocolm"):
        assert rows_seen  # the projection really went through F.linear


def test_capt_temperature_follows_progress_and_queue_fills_only_in_training():
    model = tiny_model({"capt": 1.0}, {"capt": {"queue_size": 20}})
    batch = make_batch(batch_size=4)
    for step, tau in [(0, 0.55), (50, 0.05), (100, 0.55)]:
        _, metrics = model(batch, StepProgress(step, 100))
        assert metrics["capt/tau"].item() == pytest.approx(tau)
    assert len(model.objectives["capt"].queue) == 20  # 3 steps x 2 views x 4 = 24 > capacity
    model.eval()
    before = model.objectives["capt"].queue.state_dict()
    model(batch)
    assert torch.equal(model.objectives["capt"].queue.state_dict()["buffer"], before["buffer"])
    fixed = tiny_model({"capt": 1.0}, {"capt": {"tau": 0.2}})
    assert fixed(batch, StepProgress(50, 100))[1]["capt/tau"].item() == pytest.approx(0.2)


def test_capt_queue_rows_are_negatives_of_the_next_step():
    model = tiny_model({"capt": 1.0}, {"capt": {"tau": 0.1, "queue_size": 64}}, dropout=0.0, attention_dropout=0.0)
    batch = make_batch()
    first, _ = model(batch)  # empty queue
    second, _ = model(batch)  # same batch, now with 2B queued negatives identical to its own views
    assert second.item() > first.item()
    no_queue = tiny_model({"capt": 1.0}, {"capt": {"tau": 0.1, "queue_size": 0}}, dropout=0.0, attention_dropout=0.0)
    assert no_queue(batch)[0].item() == pytest.approx(first.item(), rel=1e-5)
    assert no_queue.extra_state_for_checkpoint() == {}


def test_capt_queue_joins_at_queue_start_of_the_run():
    model = tiny_model({"capt": 1.0}, {"capt": {"tau": 0.1, "queue_size": 64, "queue_start": 0.2}},
                       dropout=0.0, attention_dropout=0.0)
    capt, batch = model.objectives["capt"], make_batch()
    for step in (1, 19):  # before step 0.2 x 100: neither read nor filled
        _, metrics = model(batch, StepProgress(step, 100))
        assert len(capt.queue) == 0 and metrics["capt/negatives"].item() == 2 * 4 - 2
    _, metrics = model(batch, StepProgress(20, 100))
    assert len(capt.queue) == 8 and metrics["capt/negatives"].item() == 2 * 4 - 2  # filled, read from the next step
    _, metrics = model(batch, StepProgress(21, 100))
    assert len(capt.queue) == 16 and metrics["capt/negatives"].item() == 2 * 4 - 2 + 8
    paper = tiny_model({"capt": 1.0}, {"capt": {"queue_size": 64}})
    paper(batch, StepProgress(1, 100))
    assert len(paper.objectives["capt"].queue) == 8  # default 0: the paper's queue from the first step


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_capt_loss_chance_is_log_candidates_and_what_an_uninformed_encoder_scores(reduction):
    """Every candidate scored alike (tau -> inf): the loss is ln(2b - 1 + queue rows) per term."""
    model = tiny_model({"capt": 1.0}, {"capt": {"tau": 1e6, "queue_size": 64, "reduction": reduction}})
    batch = make_batch(batch_size=4)
    model(batch, StepProgress(1, 10, micro_batches=2))  # fills 8 queue rows
    loss, metrics = model(batch, StepProgress(2, 10, micro_batches=2))
    terms = 2 * 4 * 2 if reduction == "sum" else 1
    assert metrics["capt/loss_chance"].item() == pytest.approx(terms * math.log(2 * 4 - 1 + 8), rel=1e-6)
    assert metrics["capt/loss_chance"].item() == pytest.approx(terms * math.log(metrics["capt/negatives"].item() + 1))
    assert loss.item() == pytest.approx(metrics["capt/loss_chance"].item(), rel=1e-4)


def test_capt_spread_metrics_are_the_mean_cosines_and_logged_steps_only():
    model = tiny_model({"capt": 1.0}, {"capt": {"queue_size": 16}}, dropout=0.0, attention_dropout=0.0)
    capt = model.objectives["capt"]
    model(make_batch(batch_size=8, seed=1), StepProgress(1, 10))  # the queue is full: the loss reads its storage
    batch, queued = make_batch(batch_size=5), capt.queue.ordered()
    _, metrics = model(batch, StepProgress(2, 10))
    with torch.no_grad():
        s = capt.represent(model.bert(batch["input_ids"], batch["attention_mask"]).last_hidden[:, 0])
        s_hat = capt.represent(model.bert(batch["masked_ids"], batch["attention_mask"]).last_hidden[:, 0])
    views, b = torch.cat([s, s_hat]), s.shape[0]
    sequence = torch.arange(2 * b) % b
    other = sequence[:, None] != sequence[None, :]
    assert metrics["capt/negative_cosine"].item() == pytest.approx((views @ views.T)[other].mean().item(), abs=1e-5)
    expected_queue = (views @ F.normalize(queued, dim=-1).T).mean().item()
    assert metrics["capt/queue_cosine"].item() == pytest.approx(expected_queue, abs=1e-5)
    # the adaptive tau's floor, 0.05, scores the same candidates: comparable over the whole run
    floor = sequence_contrastive_loss(s, s_hat, 0.05, queued, normalize=True, symmetric=True, same_view_negatives=True)
    assert metrics["capt/floor_tau_loss"].item() == pytest.approx(floor.item(), rel=1e-5)
    assert metrics["capt/floor_tau_loss_chance"].item() == pytest.approx(math.log(2 * b - 1 + len(queued)))
    _, quiet = model(batch, StepProgress(3, 10, record_metrics=False))
    assert not {"capt/negative_cosine", "capt/queue_cosine", "capt/floor_tau_loss", "capt/loss_chance"} & set(quiet)
    fixed = tiny_model({"capt": 1.0}, {"capt": {"tau": 0.1, "queue_size": 0}})
    assert "capt/floor_tau_loss" not in fixed(batch, StepProgress(1, 10))[1]  # a fixed tau: the loss itself compares


def test_taco_anchor_choice_and_log_k_plus_one_at_initialisation():
    batch = make_batch()
    eligible = batch["attention_mask"].bool() & ~batch["special_mask"]
    selected = batch["mlm_labels"] != -100
    for anchors, expected in [("all", eligible.sum()), ("masked", selected.sum()), ("unmasked", (eligible & ~selected).sum())]:
        model = tiny_model({"taco": 1.0}, {"taco": {"anchors": anchors, "tau": 1e6}})
        loss, metrics = model(batch)
        assert metrics["taco/anchors"].item() == expected.item()
        assert loss.item() == pytest.approx(math.log(51), rel=1e-4)  # tau -> inf: every score equal


def test_infoword_ngram_inputs():
    input_ids = torch.tensor([[1, 10, 11, 12, 13, 2], [1, 20, 21, 22, 2, 0]])
    span_index = torch.tensor([[-1, 0, 0, -1, 1, -1], [-1, -1, 0, 0, -1, -1]])
    ids, mask = build_ngram_inputs(input_ids, span_index, torch.tensor([0, 0]), 1, 2, 0)
    assert ids.tolist() == [[1, 10, 11, 2], [1, 21, 22, 2]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    ids, mask = build_ngram_inputs(input_ids, span_index, torch.tensor([1, 0]), 1, 2, 0)
    assert ids.tolist() == [[1, 13, 2, 0], [1, 21, 22, 2]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


def test_infoword_encodes_the_ngrams_alone_and_skips_sentences_without_spans():
    batch = make_batch()
    batch["span_index"][0] = -1
    batch["span_labels"][0] = -100
    batch["span_masked_ids"][0] = batch["input_ids"][0]
    model = tiny_model({"infoword": 1.0})
    calls = _count_encoder_calls(model)
    _, metrics = model(batch)
    assert calls == [4, 3]  # span-masked sentences, then the 3 n-grams
    assert metrics["infoword/dim_sentences"].item() == 3


def test_infoword_nce_view_masked_scores_the_bert_masked_positions_in_a_pass_of_its_own():
    """nce_view "masked": I_MLM on the BERT-masked view (its own encoder pass, its selected positions), DIM
    still on the span-masked sentences and their n-grams; the default keeps one pass for both terms."""
    batch = make_batch()
    masked = tiny_model({"infoword": 1.0}, {"infoword": {"nce_view": "masked"}})
    calls = _count_encoder_calls(masked)
    _, metrics = masked(batch)
    with_span = int((batch["span_index"].max(1).values >= 0).sum())  # ngrams_per_sentence 1: one n-gram a row
    assert calls == [4, 4, with_span]  # the masked view, the span view, the n-grams
    assert metrics["infoword/selected_tokens"].item() == int((batch["mlm_labels"] != -100).sum())
    default = tiny_model({"infoword": 1.0})
    calls = _count_encoder_calls(default)
    _, metrics = default(batch)
    assert len(calls) == 2
    assert metrics["infoword/selected_tokens"].item() == int((batch["span_labels"] != -100).sum())
    assert int((batch["span_labels"] != -100).sum()) != int((batch["mlm_labels"] != -100).sum())


@pytest.mark.parametrize(
    "name,options,match",
    [
        ("mlm", {"view": "bogus"}, "objective_options.mlm.view"),
        ("mlm-nce", {"negatives": "zipf"}, "objective_options.mlm-nce.negatives"),
        ("taco", {"anchors": "some"}, "objective_options.taco.anchors"),
        ("taco", {"window": 1}, "objective_options.taco.window"),
        ("capt", {"corruption": "drop"}, "objective_options.capt.corruption"),
        ("capt", {"tau": -1.0}, "objective_options.capt.tau"),
        ("capt", {"queue_start": 1.0}, "objective_options.capt.queue_start"),
        ("capt", {"queue_spread": 1.0}, "objective_options.capt.queue_spread"),
        ("capt", {"queue_spread": 0.5, "queue_size": 0}, "objective_options.capt.queue_spread"),
        ("cocolm", {"sample_mode": "train"}, "objective_options.cocolm.sample_mode"),
        ("cocolm", {"sample_temperature": 0.0}, "objective_options.cocolm.sample_temperature"),
        ("infoword", {"score": "l1"}, "objective_options.infoword.score"),
        ("infoword", {"nce_view": "wwm_masked"}, "objective_options.infoword.nce_view"),
    ],
)
def test_bad_options_name_the_option(name, options, match):
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        tiny_model({name: 1.0}, {name: options})


def test_objective_views_drive_the_model_views():
    assert tiny_model({"infoword": 1.0}).views == {"original", "span_masked"}
    assert tiny_model({"infoword": 1.0}, {"infoword": {"nce_view": "masked"}}).views == {"original", "span_masked",
                                                                                         "masked"}
    assert tiny_model({"capt": 1.0}, {"capt": {"corruption": "shuffled"}}).views == {"original", "shuffled"}
    assert tiny_model({"mlm": 1.0}, {"mlm": {"view": "wwm_masked"}}).views == {"original", "wwm_masked"}


@pytest.mark.parametrize("name", ALL)
def test_degenerate_micro_batches_give_finite_losses(name):
    """One sequence (no "other sequences" for negatives) and nothing selected must not crash."""
    model = tiny_model({name: 1.0}, FAST)
    single = make_batch(batch_size=1, seed=6)
    loss, _ = model(single)
    assert torch.isfinite(loss)
    loss.backward()
    empty = make_batch(batch_size=3, seed=6)
    for key in ("mlm_labels", "span_labels"):
        empty[key].fill_(-100)
    empty["span_index"].fill_(-1)
    empty["masked_ids"], empty["span_masked_ids"] = empty["input_ids"].clone(), empty["input_ids"].clone()
    loss, _ = model(empty)
    assert torch.isfinite(loss)
    loss.backward()


def test_taco_contrasts_h_minus_e_of_the_masked_view():
    from pipeline.kernels.functional import token_contrastive_loss
    from pipeline.objectives.taco import sample_taco_indices
    from pipeline.seeding import sampling_seed

    model = tiny_model({"taco": 1.0}, dropout=0.0, attention_dropout=0.0)
    batch = make_batch()
    loss, _ = model(batch)
    out = model.bert(batch["masked_ids"], batch["attention_mask"])
    g = (out.last_hidden - out.embedding_output).reshape(-1, out.last_hidden.shape[-1])
    gen = torch.Generator().manual_seed(sampling_seed(0, int(batch["sample_index"][0])))
    eligible = batch["attention_mask"].bool() & ~batch["special_mask"]
    expected = token_contrastive_loss(g, *sample_taco_indices(eligible, eligible, 5, 50, gen), 0.07)
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize(
    "name,options,parts",
    [
        ("cocolm", {"lambda_copy": 50.0, "lambda_gen": 0.5, "lambda_scl": 2.0},
         {"gen_loss": 0.5, "copy_loss": 50.0, "clm_lm_loss": 1.0, "scl_loss": 2.0}),
        ("infoword", {"lambda_mlm": 1.0, "lambda_dim": 0.4}, {"nce_loss": 1.0, "dim_loss": 0.4}),
    ],
)
def test_composite_losses_are_the_weighted_sum_of_their_parts(name, options, parts):
    _, metrics = tiny_model({name: 1.0}, {name: options})(make_batch())
    total = sum(w * metrics[f"{name}/{k}"] for k, w in parts.items())
    assert metrics[f"{name}/loss"].item() == pytest.approx(total.item(), rel=1e-5)
    assert all(metrics[f"{name}/{k}"] > 0 for k in parts)


def test_mlm_is_cross_entropy_of_the_tied_head_at_selected_positions():
    model = tiny_model({"mlm": 1.0}, dropout=0.0, attention_dropout=0.0)
    batch = make_batch()
    loss, metrics = model(batch)
    logits = model.cls(model.bert(batch["masked_ids"], batch["attention_mask"]).last_hidden)  # [B, L, V], test only
    labels = batch["mlm_labels"]
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100))
    sel = labels != -100
    assert metrics["mlm/accuracy"].item() == pytest.approx((logits[sel].argmax(-1) == labels[sel]).float().mean().item())
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


def test_cocolm_copy_loss_counts_non_pad_positions_only():
    """L_copy = mean over non-pad positions of BCE(sigmoid(w . h_i), 1[x^MLM_i == x_i]) (COCO-LM Sec. 3.1),
    recomputed position by position; padding (where x^MLM == x trivially) must not enter the mean."""
    from pipeline.seeding import sampling_seed

    model = tiny_model({"cocolm": 1.0}, dropout=0.0, attention_dropout=0.0)
    batch = make_batch(batch_size=4, seq_len=24, seed=7)
    mask = batch["attention_mask"]
    assert (mask == 0).sum() >= 8  # the rows are padded
    _, metrics = model(batch)
    objective = model.objectives["cocolm"]
    gen = torch.Generator().manual_seed(sampling_seed(0, int(batch["sample_index"][0])))
    _, replaced, _, _ = objective.generate(StepContext(model.bert, model.cls, batch, StepProgress(), gen, "torch"))
    h = model.bert(replaced, mask).last_hidden
    terms = []
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            if mask[i, j]:
                p = torch.sigmoid(objective.copy_head(h[i, j]))[0]
                terms.append(-torch.log(p) if replaced[i, j] == batch["input_ids"][i, j] else -torch.log(1 - p))
    assert metrics["cocolm/copy_loss"].item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-5)
    # and more padding changes nothing
    wide = {k: (F.pad(v, (0, 8)) if v.dim() == 2 and k != "special_mask" else v) for k, v in batch.items()}
    wide["special_mask"] = F.pad(batch["special_mask"], (0, 8), value=True)
    wide["document_ids"] = F.pad(batch["document_ids"], (0, 8), value=-1)
    for key in ("mlm_labels", "span_labels"):
        wide[key] = F.pad(batch[key], (0, 8), value=-100)
    wide["span_index"] = F.pad(batch["span_index"], (0, 8), value=-1)
    model_wide = tiny_model({"cocolm": 1.0}, dropout=0.0, attention_dropout=0.0)
    assert model_wide(wide)[1]["cocolm/copy_loss"].item() == pytest.approx(metrics["cocolm/copy_loss"].item(), rel=1e-5)


def test_cocolm_copy_head_read_as_replaced_token_detection():
    """rtd_auc / rtd_accuracy / rtd_accuracy_chance recomputed position by position over the non-pad
    tokens (positive class = replaced, score = -copy logit); padding must not enter them."""
    from pipeline.seeding import sampling_seed

    model = tiny_model({"cocolm": 1.0}, dropout=0.0, attention_dropout=0.0)
    batch = make_batch(batch_size=4, seq_len=24, seed=7)
    mask = batch["attention_mask"]
    _, metrics = model(batch)
    objective = model.objectives["cocolm"]
    gen = torch.Generator().manual_seed(sampling_seed(0, int(batch["sample_index"][0])))
    _, replaced, _, _ = objective.generate(StepContext(model.bert, model.cls, batch, StepProgress(), gen, "torch"))
    logits = objective.copy_head(model.bert(replaced, mask).last_hidden).squeeze(-1)
    kept = [(float(logits[i, j]), bool(replaced[i, j] != batch["input_ids"][i, j]))
            for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]
    swapped = [-s for s, r in kept if r]
    original = [-s for s, r in kept if not r]
    assert swapped and original
    pairs = [1.0 if a > b else 0.5 if a == b else 0.0 for a in swapped for b in original]
    assert metrics["cocolm/rtd_auc"].item() == pytest.approx(sum(pairs) / len(pairs), abs=1e-6)
    assert metrics["cocolm/rtd_accuracy"].item() == pytest.approx(
        sum((s > 0) == (not r) for s, r in kept) / len(kept), abs=1e-6)
    assert metrics["cocolm/rtd_accuracy_chance"].item() == pytest.approx(len(original) / len(kept), abs=1e-6)
    # the corrective LM's copy penalty: -log(1 - p_copy) at the masked positions the generator replaced
    labels = batch["mlm_labels"]
    at = [(float(torch.sigmoid(logits[i, j])), bool(replaced[i, j] != labels[i, j]))
          for i in range(mask.shape[0]) for j in range(mask.shape[1]) if labels[i, j] != -100]
    penalty = sum(-math.log(1 - p) for p, r in at if r) / len(at)
    assert any(r for _, r in at) and metrics["cocolm/clm_copy_penalty"].item() == pytest.approx(penalty, rel=1e-5)
    # the corrective LM's softmax alone: cross-entropy of the original token through the shared MLM head,
    # below the mixture loss by about the copy penalty (the copy head's cost at the replaced positions)
    h = model.bert(replaced, mask).last_hidden
    ce = F.cross_entropy(model.cls.predictions(h[labels != -100]), labels[labels != -100]).item()
    assert metrics["cocolm/clm_softmax_ce"].item() == pytest.approx(ce, rel=1e-5)
    assert metrics["cocolm/clm_softmax_ce"].item() < metrics["cocolm/clm_lm_loss"].item()


# ---- the NCE head's log q (`log_proposal`) and how each objective trains the MLM head -------------

def _counts(seed: int = 0) -> np.ndarray:
    counts = np.random.RandomState(seed).zipf(1.5, VOCAB).clip(max=10_000)
    counts[:5] = 0  # special ids, as `unigram_counts` leaves them
    return counts


def _nce_model(options: dict):
    from pipeline.pretrain.build import fill_unigram_tensors

    model = tiny_model({"mlm-nce": 1.0, "infoword": 1.0}, options, dropout=0.0, attention_dropout=0.0)
    fill_unigram_tensors(model, _counts(), output_biases=False)
    return model


def test_nce_samplers_hold_log_q_as_a_persistent_float32_buffer_outside_the_loss():
    from pipeline.pretrain.build import unigram_bias

    model = _nce_model({"mlm-nce": {"num_negatives": 16, "negatives": "uniform"}, "infoword": {"num_negatives": 16}})
    state = model.state_dict()
    log_q = unigram_bias(_counts())
    assert log_q.std() > 1.0  # frequent and rare ids far apart: not a no-op
    assert torch.equal(state["objectives.infoword.sampler.log_proposal"], log_q)  # unigram pool: log q
    assert state["objectives.mlm-nce.sampler.log_proposal"].dtype == torch.float32
    assert not state["objectives.mlm-nce.sampler.log_proposal"].any()  # uniform pool: q constant
    assert not model.cls.predictions.decoder.bias.detach().any()  # log q is not an output bias
    # the loss is the paper's: log q does not enter it (same batch, same stream, with and without it);
    # only the accuracy metrics read it (the implied masked LM's argmax, test below)
    batch = make_batch(seed=3)
    loss, metrics = model(batch, sampling_seed=11)
    for sampler in (model.objectives["mlm-nce"].sampler, model.objectives["infoword"].sampler):
        sampler.log_proposal.zero_()
    loss_without, metrics_without = model(batch, sampling_seed=11)
    assert torch.equal(loss, loss_without)
    assert {k: v for k, v in metrics.items() if not k.endswith("/accuracy")} == {
        k: v for k, v in metrics_without.items() if not k.endswith("/accuracy")}


@pytest.mark.parametrize("name,labels", [("mlm-nce", "mlm_labels"), ("infoword", "span_labels")])
def test_nce_accuracy_is_the_argmax_of_the_implied_masked_lm(name, labels):
    """`<name>/accuracy` scores argmax_v s(v, c) + log q(v), the masked LM that conversion exports, not
    argmax s: a log q that outweighs every score makes the prediction its mode everywhere, so the
    accuracy is the share of targets equal to that token, and 0 when log q favours a token no target is."""
    model = tiny_model({name: 1.0}, {name: {"num_negatives": 16}}, dropout=0.0, attention_dropout=0.0)
    batch = make_batch(seed=3)
    targets = batch[labels][batch[labels] != -100]
    mode = int(torch.bincount(targets).argmax())
    share = float((targets == mode).float().mean())
    assert 0.0 < share < 0.5
    sampler = model.objectives[name].sampler
    sampler.log_proposal.fill_(-50.0)[mode] = 50.0
    _, metrics = model(batch, sampling_seed=11)
    assert metrics[f"{name}/accuracy"].item() == pytest.approx(share)
    absent = int(torch.nonzero(torch.bincount(targets, minlength=VOCAB)[5:] == 0)[0]) + 5  # not special, no target
    sampler.log_proposal.fill_(-50.0)[absent] = 50.0
    _, other = model(batch, sampling_seed=11)
    assert other[f"{name}/accuracy"].item() == 0.0


def test_a_checkpoint_from_before_log_q_still_loads_strictly():
    """A run written before the buffer existed resumes: the buffer keeps the value the run model was
    built with; every other key is still checked strictly."""
    model = _nce_model({})
    built = model.objectives["mlm-nce"].sampler.log_proposal.clone()
    old = {k: v for k, v in tiny_model({"mlm-nce": 1.0, "infoword": 1.0}, seed=5).state_dict().items()
           if not k.endswith("log_proposal")}
    model.load_state_dict(old, strict=True)
    assert torch.equal(model.objectives["mlm-nce"].sampler.log_proposal, built) and built.any()
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, old["bert.embeddings.word_embeddings.weight"])
    del old["cls.predictions.decoder.bias"]
    with pytest.raises(RuntimeError, match="cls.predictions.decoder.bias"):
        model.load_state_dict(old, strict=True)


@pytest.mark.parametrize("name", ALL)
def test_objectives_declare_how_they_train_the_mlm_head(name):
    """`Objective.mlm_head` (read by conversion) matches what the objective does: it is set exactly when
    the objective calls the shared MLM head, and says sampled softmax exactly for the NCE objectives."""
    from pipeline.objectives.base import FULL_SOFTMAX, SAMPLED_SOFTMAX

    model = tiny_model({name: 1.0}, FAST)
    calls = []
    model.cls.register_forward_hook(lambda *_: calls.append(1))
    model(make_batch())
    declared = OBJECTIVES[name].mlm_head
    assert (declared is not None) == bool(calls), f"{name}: mlm_head={declared!r}, head called {len(calls)} times"
    assert declared == {"mlm-nce": SAMPLED_SOFTMAX, "infoword": SAMPLED_SOFTMAX}.get(
        name, FULL_SOFTMAX if calls else None)
