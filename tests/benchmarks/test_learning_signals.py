"""Issue 29's proof harness: the criteria on synthetic curves (met and missed), and one tiny end-to-end
run (1 objective x 1 seed x a few steps) that writes every file and is skipped when run again."""
from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest

from benchmarks.health.learning_signals import main, parse_args, smoothed, thinned
from benchmarks.health.signal_criteria import RTD_AUC_MIN, judge_run

CHANCE = math.log(9)
HEALTHY = {"token_cosine": 0.1, "mlm_acc": 0.12, "unigram_acc": 0.057, "replaced_acc": 0.11, "replaced_unigram_acc": 0.057}


def curve(values, **extra):
    """Logged records of TACO (MLM + TACO) with `taco/loss` following `values`."""
    return [{"step": i + 1, "taco/loss": v, "taco/loss_chance": CHANCE, "mlm/accuracy": 0.12,
             "health/unigram_accuracy": 0.057, "health/token_cosine": 0.1, **extra} for i, v in enumerate(values)]


def missed(verdict):
    return [c["criterion"] for c in verdict["criteria"] if not c["met"]]


def test_a_falling_term_below_085x_chance_with_healthy_heldout_numbers_meets_every_criterion():
    verdict = judge_run("taco", curve([CHANCE * (1 - 0.6 * s / 100) for s in range(100)]), HEALTHY, token_head=True)
    assert verdict["met"] and missed(verdict) == []
    names = [c["criterion"] for c in verdict["criteria"]]
    assert names == ["taco/loss <= 0.85x chance at the end", "taco/loss still falling",
                     "held-out token cosine < 0.9", "held-out masked accuracy > plateau + 0.01"]


@pytest.mark.parametrize("values,heldout,expected", [
    ([CHANCE * 0.99] * 100, HEALTHY, ["taco/loss <= 0.85x chance at the end", "taco/loss still falling"]),  # at chance
    ([CHANCE * (0.2 + 0.6 * (s > 50)) for s in range(100)][::-1], HEALTHY, ["taco/loss still falling"]),  # low, flat
    ([CHANCE * (1 - 0.6 * s / 100) for s in range(100)], {**HEALTHY, "token_cosine": 0.95},
     ["held-out token cosine < 0.9"]),
    ([CHANCE * (1 - 0.6 * s / 100) for s in range(100)], {**HEALTHY, "mlm_acc": 0.06},
     ["held-out masked accuracy > plateau + 0.01"]),
])
def test_each_criterion_misses_on_its_own(values, heldout, expected):
    verdict = judge_run("taco", curve(values), heldout, token_head=True)
    assert not verdict["met"] and missed(verdict) == expected


def test_a_required_term_without_its_chance_and_cocolm_without_rtd_auc_miss():
    records = [{"step": s, "infoword/dim_loss": 3.4, "infoword/nce_loss": 2.0, "infoword/nce_loss_chance": 2.83,
                "health/token_cosine": 0.1} for s in range(1, 11)]
    verdict = judge_run("infoword", records, HEALTHY, token_head=True)
    assert "infoword/dim_loss <= 0.85x chance at the end" in missed(verdict)
    cocolm = [{"step": s, "cocolm/scl_loss": 3.0 - 0.1 * s, "cocolm/scl_loss_chance": 4.14,
               "cocolm/clm_softmax_ce": 6.5, "health/unigram_entropy": 6.4, "cocolm/rtd_auc": 0.8,
               "cocolm/rtd_auc_chance": 0.5, "health/token_cosine": 0.1} for s in range(1, 21)]
    verdict = judge_run("cocolm", cocolm, HEALTHY, token_head=True)
    assert missed(verdict) == [f"cocolm/rtd_auc >= {RTD_AUC_MIN}", "cocolm/clm_softmax_ce below the unigram entropy"]
    good = [{**r, "cocolm/rtd_auc": 0.9, "cocolm/clm_softmax_ce": 6.0} for r in cocolm]
    assert judge_run("cocolm", good, HEALTHY, token_head=True)["met"]
    older = [{k: v for k, v in r.items() if k != "cocolm/clm_softmax_ce"} | {"cocolm/clm_lm_loss": 6.0} for r in good]
    assert missed(judge_run("cocolm", older, HEALTHY, token_head=True)) == [  # a run logged before the metric
        "cocolm/clm_softmax_ce below the unigram entropy"]
    assert "held-out evaluation" in missed(judge_run("taco", curve([1.0] * 10), None, token_head=True))


def test_cocolm_corrective_lm_is_judged_by_its_softmax_not_the_copy_mixture():
    """The copy mixture pays -log(1 - p_copy) at replaced positions: above the entropy while the softmax is
    below it is met (the copy head is judged by the AUC), and the mixture's numbers are in the detail."""
    records = [{"step": s, "cocolm/scl_loss": 3.0 - 0.1 * s, "cocolm/scl_loss_chance": 4.14,
                "cocolm/clm_softmax_ce": 5.8, "cocolm/clm_lm_loss": 7.2, "cocolm/clm_copy_penalty": 1.4,
                "health/unigram_entropy": 6.3, "cocolm/rtd_auc": 0.9, "cocolm/rtd_auc_chance": 0.5,
                "health/token_cosine": 0.1} for s in range(1, 21)]
    verdict = judge_run("cocolm", records, HEALTHY, token_head=True)
    assert verdict["met"], missed(verdict)
    clm = next(c for c in verdict["criteria"] if c["criterion"].startswith("cocolm/clm_softmax_ce"))
    assert clm["value"] == pytest.approx(5.8) and clm["threshold"] == pytest.approx(6.3)
    assert "cocolm/clm_lm_loss 7.2000" in clm["detail"] and "cocolm/clm_copy_penalty 1.4000" in clm["detail"]
    above = [{**r, "cocolm/clm_softmax_ce": 6.31} for r in records]
    assert missed(judge_run("cocolm", above, HEALTHY, token_head=True)) == [
        "cocolm/clm_softmax_ce below the unigram entropy"]


def test_cocolm_accuracy_is_judged_at_replaced_positions_not_at_mask():
    """COCO-LM's main model never sees [MASK]: its held-out accuracy criterion reads the replaced positions;
    every other objective still reads [MASK]."""
    records = [{"step": s, "cocolm/scl_loss": 3.0 - 0.1 * s, "cocolm/scl_loss_chance": 4.14, "cocolm/clm_softmax_ce": 6.0,
                "health/unigram_entropy": 6.4, "cocolm/rtd_auc": 0.9, "cocolm/rtd_auc_chance": 0.5,
                "health/token_cosine": 0.1} for s in range(1, 21)]
    at_plateau_at_mask = {**HEALTHY, "mlm_acc": 0.057}
    verdict = judge_run("cocolm", records, at_plateau_at_mask, token_head=True)
    assert verdict["met"], missed(verdict)
    assert "at [MASK] 0.0570" in verdict["criteria"][-1]["detail"]
    replaced_at_plateau = {**HEALTHY, "replaced_acc": 0.06}
    assert missed(judge_run("cocolm", records, replaced_at_plateau, token_head=True)) == [
        "held-out accuracy at replaced positions > plateau + 0.01"]
    older = {k: v for k, v in HEALTHY.items() if not k.startswith("replaced")}
    assert missed(judge_run("cocolm", records, older, token_head=True)) == [
        "held-out accuracy at replaced positions > plateau + 0.01"]
    assert missed(judge_run("taco", curve([CHANCE * (1 - 0.6 * s / 100) for s in range(100)]),
                            replaced_at_plateau, token_head=True)) == []


def test_curves_are_smoothed_as_ratios_to_their_reference():
    points = [[s, 2.0 * s, 2.0] for s in range(1, 21)]
    assert smoothed(points, window=10) == [(10, 5.5), (20, 15.5)]


def test_thinned_curves_keep_every_nth_logged_step_and_nothing_else_changes():
    runs = [{"seed": 1, "met": True, "curves": {"taco/loss": [[s, 1.0 / s, 2.0] for s in range(1, 11)]}}]
    (thin,) = thinned(runs, 4)
    assert [p[0] for p in thin["curves"]["taco/loss"]] == [1, 5, 9] and thin["met"] is True
    assert len(runs[0]["curves"]["taco/loss"]) == 10  # the judged runs are not modified
    assert thinned(runs, 1) == runs


def test_arguments_take_the_studys_learning_rates(tmp_path: Path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("x\n")
    base = ["--text", str(text), "--heldout", str(text)]
    args = parse_args([*base, "--objectives", "mlm,taco"])
    assert args.lrs == {"mlm": 1e-3, "taco": 1e-3} and args.seeds == [1, 2, 3] and args.eval_every == 2400
    assert "model.hidden_size=128" in args.set and args.steps == 2400 and args.vocab_size == 4096
    study = tmp_path / "ttq.json"
    study.write_text(json.dumps({"selection": {"mlm": {"lr": 0.002}}}))
    with pytest.raises(SystemExit):
        parse_args([*base, "--objectives", "mlm,taco", "--lrs-from", str(study)])
    assert "no selected learning rate for 'taco'" in capsys.readouterr().err
    assert parse_args([*base, "--objectives", "taco", "--lr", "5e-4"]).lrs == {"taco": 5e-4}
    with pytest.raises(SystemExit):
        parse_args([*base, "--objectives", "taco", "--lr", "5e-4", "--curve-every", "0"])
    assert "--curve-every must be >= 1, got 0" in capsys.readouterr().err


def test_tiny_harness_run_writes_every_file_and_skips_a_finished_run(tiny_corpus_file: Path, tmp_path: Path):
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["--text", str(tiny_corpus_file), "--heldout", str(tiny_corpus_file), "--objectives", "taco",
            "--seeds", "1", "--steps", "6", "--micro-batch", "4", "--vocab-size", "800", "--eval-sequences", "16",
            "--set", "model.dropout=0.0", "--lr", "1e-3", "--out", str(out), "--work-dir", str(work)]
    handler = signal.getsignal(signal.SIGTERM)
    assert main(argv) == 0
    assert signal.getsignal(signal.SIGTERM) is handler  # the driver's clean-stop handler is gone again
    result = json.loads((out / "learning_signals_taco.json").read_text())
    (run,) = result["runs"]
    assert run["status"] == "ok" and run["wall_s"] > 0 and isinstance(run["met"], bool)
    assert {c["criterion"] for c in run["criteria"]} >= {"taco/loss <= 0.85x chance at the end", "taco/loss still falling",
                                                          "held-out token cosine < 0.9"}
    assert len(run["curves"]["taco/loss"]) == 6 and run["curves"]["taco/loss"][0][2] == pytest.approx(math.log(9))
    assert {"taco/loss", "mlm/accuracy", "mlm/loss", "health/token_cosine"} <= {s["term"] for s in run["final_signals"]}
    assert (out / "learning_signals_taco.png").stat().st_size > 0
    table = (out / "learning_signals.md").read_text()
    assert "| taco | 1 |" in table and "verdict per objective" in table
    log = next(work.glob("runs/taco/*/seed_1/train.log"))
    size = log.stat().st_size
    assert main(argv) == 0  # finished: nothing trains again
    assert log.stat().st_size == size
    assert json.loads((out / "learning_signals_taco.json").read_text())["runs"][0]["wall_s"] == run["wall_s"]
    # a work directory made with other settings is refused
    assert main([*argv[:-4], "--steps", "7", "--out", str(out), "--work-dir", str(work)]) == 2


def test_capt_loss_trend_is_judged_at_the_fixed_floor_temperature():
    """CAPT's Eq. 6 raises tau in the second half, so `capt/loss` rises while its fixed-tau twin falls:
    the twin decides "still falling"; when the twin rises too, the criterion misses."""
    chance = math.log(127)

    def capt(loss, floor):
        return [{"step": s + 1, "capt/loss": loss(s), "capt/loss_chance": chance, "capt/floor_tau_loss": floor(s),
                 "capt/floor_tau_loss_chance": chance, "mlm/accuracy": 0.08, "health/unigram_accuracy": 0.057,
                 "health/token_cosine": 0.2} for s in range(100)]
    rising_with_tau = capt(lambda s: chance * (0.5 + 0.002 * s), lambda s: chance * (0.6 - 0.002 * s))
    verdict = judge_run("capt", rising_with_tau, HEALTHY, token_head=True)
    assert verdict["met"], missed(verdict)
    assert any("judged on capt/floor_tau_loss" in c["detail"] for c in verdict["criteria"])
    both_rising = capt(lambda s: chance * (0.5 + 0.002 * s), lambda s: chance * (0.4 + 0.002 * s))
    assert missed(judge_run("capt", both_rising, HEALTHY, token_head=True)) == [
        "capt/floor_tau_loss still falling", "capt/loss still falling"]
