"""Issue 29's proof stays true under today's rules: every committed run of
`benchmarks/results/learning_signals_8x/` (every objective x seeds 1-3 at 2,400 steps; the harness
that produced them is retired, last present at commit 76db60d) is judged again here by
`pipeline.monitor.signals`, the code the training loop and the model card use: each signal learned at the
end, each contrastive term's window mean still moving down (on the committed curves; not each beyond
noise), no collapse, held-out accuracy above
the plateau, COCO-LM RTD AUC >= 0.85. A change that makes
those rules stricter than the committed runs meet (a lower LOSS_RATIO, a larger PLATEAU_MARGIN, a
smaller COLLAPSE_COSINE) fails here and must say why the proof no longer holds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.monitor.health import COLLAPSE_COSINE
from pipeline.monitor.signals import PLATEAU_MARGIN, final_signals, learning_signals, still_improving

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "learning_signals_8x"
OBJECTIVES = ("mlm", "mlm-nce", "taco", "infoword", "capt", "cocolm")
#: Terms each objective must log against a chance level of its own (a term missing it cannot pass).
REQUIRED_CHANCE_TERMS = {"mlm-nce": {"mlm-nce/loss"}, "taco": {"taco/loss"}, "capt": {"capt/loss"},
                         "infoword": {"infoword/dim_loss", "infoword/nce_loss"}, "cocolm": {"cocolm/scl_loss"}}
#: CAPT's Eq. 6 raises its temperature over the run's second half, which raises `capt/loss` for unchanged
#: representations: "still falling" is judged on the same candidates scored at a fixed temperature.
TREND_TWINS = {"capt/loss": "capt/floor_tau_loss"}


def _metrics(final_signals: list[dict]) -> dict[str, float]:
    """The end-of-run metrics the committed signals were computed from (term and reference per signal)."""
    out = {}
    for s in final_signals:
        out[s["term"]] = s["value"]
        if s["reference_key"] != "COLLAPSE_COSINE":
            out[s["reference_key"]] = s["reference"]
    return out


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_every_committed_run_learns_every_signal_under_todays_rules(objective):
    report = json.loads((RESULTS / f"learning_signals_{objective}.json").read_text())
    runs = report["runs"]
    assert report["budget"].startswith("2400 steps")
    assert sorted(r["seed"] for r in runs) == [1, 2, 3] and all(r["status"] == "ok" for r in runs)
    for run in runs:
        signals = learning_signals(_metrics(run["final_signals"]))
        assert {s.term for s in signals} == {s["term"] for s in run["final_signals"]}
        assert [s.term for s in signals if not s.learned] == [], (objective, run["seed"])
        chance_terms = {s.term for s in signals if s.kind == "chance"}
        assert REQUIRED_CHANCE_TERMS.get(objective, set()) <= chance_terms
        held = run["heldout"]
        assert held["token_cosine"] < COLLAPSE_COSINE
        if objective == "cocolm":  # its main model never sees [MASK]: judged at the replaced positions
            assert held["replaced_acc"] > held["replaced_unigram_acc"] + PLATEAU_MARGIN
        else:
            assert held["mlm_acc"] > held["unigram_acc"] + PLATEAU_MARGIN
        for term in REQUIRED_CHANCE_TERMS.get(objective, ()):  # still being learned at the end of the budget
            twin = TREND_TWINS.get(term, term)
            records = [{"step": p[0], twin: p[1], f"{twin}_chance": p[2]} for p in run["curves"][twin]]
            # the window means moved the good way (min_z=0: not a test against noise; CAPT's at 0.6-1.7 standard
            # errors would not pass one, and cpt-status does not call those "still improving")
            assert still_improving(records, final_signals(records)[0], min_z=0), (objective, run["seed"], twin)
        if objective == "cocolm":
            auc = next(s for s in signals if s.term == "cocolm/rtd_auc")
            assert auc.value >= 0.85  # issue 29's bar for replaced-token detection
