"""Learning signals against chance (`pipeline.monitor.signals`) and the references the step logs for them:
the objectives' `_chance` metrics and `health/unigram_entropy`."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.monitor.health import unigram_log_probs
from pipeline.monitor.signals import (
    ENTROPY_RATIO,
    LOSS_RATIO,
    PLATEAU_MARGIN,
    direction_of,
    final_signals,
    format_signals,
    learning_signals,
    still_improving,
    tail_windows,
    trend,
)
from pipeline.objectives.base import OBJECTIVES, StepProgress
from tests.objectives.conftest import SPECIAL, VOCAB, make_batch, tiny_model
from tests.objectives.test_host_reads import collated

SILENT = StepProgress(2, 10, 1, record_metrics=False)


def by_term(metrics):
    return {s.term: s for s in learning_signals(metrics)}


def test_declared_chance_pairs_judge_losses_by_ratio_and_scores_by_skill():
    k = 16
    chance = math.log(k + 1)
    signals = by_term({"mlm-nce/loss": 0.84 * chance, "mlm-nce/loss_chance": chance,
                       "taco/loss": 0.9 * chance, "taco/loss_chance": chance,
                       "cocolm/rtd_auc": 0.62, "cocolm/rtd_auc_chance": 0.5,
                       "cocolm/rtd_accuracy": 0.87, "cocolm/rtd_accuracy_chance": 0.864})
    assert signals["mlm-nce/loss"].learned and signals["mlm-nce/loss"].threshold == pytest.approx(LOSS_RATIO * chance)
    assert not signals["taco/loss"].learned  # 0.9x chance: still at chance by the 0.85x rule
    assert signals["cocolm/rtd_auc"].learned  # skill (0.62 - 0.5) / 0.5 = 0.24 >= 0.15
    assert not signals["cocolm/rtd_accuracy"].learned  # the all-original answer, almost
    assert {s.kind for s in signals.values()} == {"chance"}
    assert signals["mlm-nce/loss"].ratio == pytest.approx(0.84)


def test_unigram_and_collapse_references_pair_only_terms_without_their_own_chance():
    metrics = {"health/unigram_accuracy": 0.057, "health/unigram_entropy": 6.4, "health/token_cosine": 0.95,
               "mlm/accuracy": 0.116, "infoword/accuracy": 0.06, "cocolm/gen_accuracy": 0.2,
               "mlm/loss": 6.1, "cocolm/clm_softmax_ce": 6.5, "cocolm/clm_lm_loss": 6.0,
               "cocolm/rtd_accuracy": 0.9,
               "mlm-nce/accuracy": 0.3, "mlm-nce/accuracy_chance": 0.25, "loss": 1.0, "lr": 1e-3}
    signals = by_term(metrics)
    assert signals["mlm/accuracy"].learned and signals["mlm/accuracy"].kind == "plateau"
    assert signals["mlm/accuracy"].threshold == pytest.approx(0.057 + PLATEAU_MARGIN)
    assert not signals["infoword/accuracy"].learned  # 0.003 above the plateau: not beyond the margin
    assert signals["cocolm/gen_accuracy"].kind == "plateau"
    assert signals["mlm/loss"].learned and signals["mlm/loss"].kind == "entropy"
    assert not signals["cocolm/clm_softmax_ce"].learned  # above the unigram entropy
    # the copy mixture's loss has no unigram chance level (it pays the copy head's cost too): not paired
    assert "cocolm/clm_lm_loss" not in signals
    assert signals["mlm-nce/accuracy"].kind == "chance"  # its own chance wins over the plateau
    assert not signals["health/token_cosine"].learned  # collapsed
    assert "cocolm/rtd_accuracy" not in signals  # not a token-prediction accuracy, and no chance declared
    assert {"loss", "lr"}.isdisjoint(signals)
    line = format_signals(list(signals.values()))
    assert line.startswith("3/7 learned: ") and "COLLAPSED" in line and "AT CHANCE" in line


def test_a_reference_missing_or_not_finite_gives_no_learned_signal():
    assert learning_signals({"mlm/accuracy": 0.5}) == []  # no plateau logged
    assert learning_signals({"x/loss_chance": 2.0}) == []  # a chance without its term
    assert learning_signals({"x/margin": 1.0, "x/margin_chance": 2.0}) == []  # no known direction
    assert not by_term({"x/loss": float("nan"), "x/loss_chance": 2.0})["x/loss"].learned
    assert direction_of("cocolm/rtd_auc") == "higher" and direction_of("infoword/dim_loss") == "lower"


def test_end_windows_and_still_improving_on_curves():
    assert tail_windows(10) == (slice(6, 8), slice(8, 10))
    assert tail_windows(1) == (slice(0, 0), slice(0, 1))
    chance = math.log(9)
    falling = [{"step": s, "taco/loss": chance * (1 - s / 100), "taco/loss_chance": chance} for s in range(1, 101)]
    flat_low = [{**r, "taco/loss": 0.5 * chance} for r in falling]
    rising = list(reversed([{**r, "step": i + 1} for i, r in enumerate(falling)]))
    end = {s.term: s for s in final_signals(falling)}["taco/loss"]
    assert end.value == pytest.approx(np.mean([chance * (1 - s / 100) for s in range(81, 101)]))
    assert end.learned and still_improving(falling, end)
    flat = final_signals(flat_low)[0]
    assert flat.learned and not still_improving(flat_low, flat)  # low but no longer falling
    assert not still_improving(rising, final_signals(rising)[0])
    assert not still_improving(falling[:1], end)  # one logged step: no window before the end


def test_a_move_within_noise_is_no_trend_and_rising_towards_collapse_is_worsening():
    """Issue 58: cpt-status said "(still improving)" of a signal at chance moving 0.0002 and of a token cosine
    rising towards collapse."""
    chance = math.log(9)
    rng = np.random.default_rng(0)
    at_chance = [{"step": s, "taco/loss": chance + 0.01 * rng.standard_normal() - (0.0002 if s > 80 else 0),
                  "taco/loss_chance": chance} for s in range(1, 101)]
    signal = {s.term: s for s in final_signals(at_chance)}["taco/loss"]
    assert trend(at_chance, signal) == "" and not still_improving(at_chance, signal)
    smooth = [{**r, "taco/loss": chance - (0.0002 if r["step"] > 80 else 0)} for r in at_chance]  # no noise at all
    assert trend(smooth, final_signals(smooth)[0]) == ""  # 0.01% of the value: below TREND_MIN_RELATIVE
    cosine = [{"step": s, "health/token_cosine": 0.5 + 0.004 * s + 0.002 * rng.standard_normal()} for s in range(1, 101)]
    collapse = final_signals(cosine)[0]
    assert collapse.term == "health/token_cosine" and collapse.direction == "lower"
    assert trend(cosine, collapse) == "worsening" and not still_improving(cosine, collapse)
    falling = [{**r, "health/token_cosine": 1.0 - r["health/token_cosine"]} for r in cosine]
    assert trend(falling, final_signals(falling)[0]) == "improving"


def test_unigram_entropy_is_the_smoothed_unigram_cross_entropy_at_the_masked_positions():
    counts = np.arange(VOCAB) % 7
    model = tiny_model({"mlm": 1.0})
    model.set_health_unigram(counts)
    batch = make_batch()
    with torch.no_grad():
        _, metrics = model(batch)
    q = (counts + 1.0) / (counts + 1.0).sum()
    targets = batch["mlm_labels"][batch["mlm_labels"] != -100].numpy()
    assert float(metrics["health/unigram_entropy"]) == pytest.approx(float(-np.log(q[targets]).mean()), rel=1e-5)
    assert model.health_top_token == int(counts.argmax())
    assert unigram_log_probs(counts).exp().sum().item() == pytest.approx(1.0)
    with torch.no_grad():
        _, quiet = model(batch, SILENT)
    assert not any(k.startswith("health/") for k in quiet)


@pytest.mark.parametrize("options,candidates", [
    ({"negatives": "uniform", "num_negatives": 16}, None),  # sampled per row, copies of the target excluded
    ({"negatives": "uniform", "num_negatives": "all"}, VOCAB - len(SPECIAL)),  # every non-special id once
])
def test_nce_chance_is_the_log_of_the_candidates_per_position(options, candidates):
    model = tiny_model({"mlm-nce": 1.0}, {"mlm-nce": options})
    with torch.no_grad():
        _, metrics = model(make_batch())
        _, quiet = model(make_batch(), SILENT)
    if candidates is None:  # 16 draws less the copies of the target: ln(1 + negatives) up to Jensen
        assert float(metrics["mlm-nce/loss_chance"]) <= math.log(1 + float(metrics["mlm-nce/negatives"])) + 1e-6
        assert float(metrics["mlm-nce/loss_chance"]) > math.log(1 + 14)
    else:  # the target excluded from the V - 5 non-special ids
        assert float(metrics["mlm-nce/loss_chance"]) == pytest.approx(math.log(candidates), rel=1e-6)
    assert "mlm-nce/loss_chance" not in quiet


def test_nce_loss_equals_its_chance_when_every_score_is_equal():
    model = tiny_model({"mlm-nce": 1.0}, {"mlm-nce": {"negatives": "uniform", "num_negatives": 16}})
    with torch.no_grad():
        model.cls.predictions.decoder.bias.zero_()
        model.bert.embeddings.word_embeddings.weight.zero_()  # tied: every score E_v . T(h) + b_v is 0
        _, metrics = model(make_batch())
    assert float(metrics["mlm-nce/loss"]) == pytest.approx(float(metrics["mlm-nce/loss_chance"]), rel=1e-5)


def test_taco_chance_is_ln_one_plus_negatives():
    model = tiny_model({"mlm": 1.0, "taco": 1.0}, {"taco": {"num_negatives": 8}})
    with torch.no_grad():
        _, metrics = model(collated(model))
    assert float(metrics["taco/loss_chance"]) == pytest.approx(math.log(9))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_chance_an_objective_logs_pairs_with_a_term_of_known_direction(name):
    """A `_chance` metric the report could not read (no term, or a name without a direction) fails here,
    not silently in a training log."""
    options = {"capt": {"queue_size": 0}, "cocolm": {"generator_layers": 1}}.get(name, {})
    model = tiny_model({name: 1.0}, {name: options} if options else {})
    model.set_health_unigram(np.arange(VOCAB))
    with torch.no_grad():
        _, metrics = model(collated(model))
    chances = [k for k in metrics if k.endswith("_chance")]
    paired = {s.reference_key for s in learning_signals({k: float(v) for k, v in metrics.items()})}
    assert set(chances) <= paired, f"{name}: unpaired {sorted(set(chances) - paired)}"


def test_an_lm_loss_at_the_unigram_entropy_is_not_learned():
    """Issue 49: 6.479 against an entropy of 6.497 (1.00x: a model that learned the unigram distribution,
    a little better than its add-one smoothed estimate) was called learned; it needs ENTROPY_RATIO x H."""
    at_plateau = by_term({"health/unigram_entropy": 6.497, "mlm/loss": 6.479})["mlm/loss"]
    assert at_plateau.kind == "entropy" and not at_plateau.learned
    assert at_plateau.threshold == pytest.approx(ENTROPY_RATIO * 6.497) and "AT CHANCE" in format_signals([at_plateau])
    assert by_term({"health/unigram_entropy": 6.497, "mlm/loss": 0.97 * 6.497})["mlm/loss"].learned
    # the closest learned LM loss of the committed learning-signals results (COCO-LM copy 0.5's generator, 1x)
    assert by_term({"health/unigram_entropy": 6.2571, "cocolm/gen_loss": 6.077})["cocolm/gen_loss"].learned
