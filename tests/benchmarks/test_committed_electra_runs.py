"""The ELECTRA learning proof stays true under today's rules: the committed runs of
`benchmarks/results/electra_learns/` (the study's size, 2,400 steps, seeds 1-3; `docs/objectives.md#electra`)
are judged again by `pipeline.monitor.signals`: `tiny-electra` (T = 2) learns replaced-token detection (AUC
learned and still rising at the end), its generator leaves the unigram plateau and its loss the unigram
entropy, and its token states do not collapse, in training and held out; the paper's sampling (T = 1)
collapses them. A stricter rule the committed runs do not meet fails here and must say why."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.monitor.health import COLLAPSE_COSINE
from pipeline.monitor.signals import PLATEAU_MARGIN, learning_signals

REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "electra_learns" / "electra_learns.json"


def _signals(run: dict) -> dict:
    metrics = {}
    for s in run["final_signals"]:
        metrics[s["term"]] = s["value"]
        if s["reference_key"] != "COLLAPSE_COSINE":
            metrics[s["reference_key"]] = s["reference"]
    return {s.term: s for s in learning_signals(metrics)}


@pytest.fixture(scope="module")
def runs() -> dict:
    return json.loads(REPORT.read_text())["runs"]


def test_tiny_electra_learns_on_every_seed(runs):
    assert len(runs["electra"]) == 3 and all(r["steps"] == 2400 for r in runs["electra"])
    for run in runs["electra"]:
        signals = _signals(run)
        for term in ("electra/rtd_auc", "electra/gen_accuracy", "electra/gen_loss", "health/token_cosine"):
            assert signals[term].learned, (run["run"], term)
        assert signals["electra/rtd_auc"].value >= 0.8 and run["still_improving"]["electra/rtd_auc"]
        held = run["heldout"]
        assert held["token_cosine"] < COLLAPSE_COSINE and held["mlm_acc"] > held["unigram_acc"] + PLATEAU_MARGIN


def test_the_papers_sampling_collapses_the_discriminator(runs):
    paper = runs["electra-paper-T1"]
    assert paper
    for run in paper:
        assert not _signals(run)["health/token_cosine"].learned and run["heldout"]["token_cosine"] > COLLAPSE_COSINE
