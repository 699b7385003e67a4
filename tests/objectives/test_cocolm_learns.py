"""Regression guard: the shipped small-scale COCO-LM recipe (`tiny-cocolm`) learns its token-level task.

A tiny CPU run (300 steps of 8 x 64 tokens on the test shards, about 40 s) and its logged learning
signals against their chance levels over the last 50 steps:

* replaced-token detection: `cocolm/rtd_auc` well above `rtd_auc_chance` = 0.5;
* no collapse: `health/token_cosine` below the collapse threshold (`COLLAPSE_COSINE`);
* the sequence contrast learns: `cocolm/scl_loss` below `scl_loss_chance` = ln(2N - 1).

Measured on these shards (seeds 1, 2, 3, means over steps 251-300): with the recipe (T = 2, copy
weight 1), AUC 0.68-0.69, token cosine 0.54-0.61, SCL 1.50-1.63 of ln 7 = 1.95; with the copy weight
50 AUC 0.71-0.72, cosine 0.73-0.76; with the generator sampled at T = 1 (the recipe before issue 29,
either copy weight), AUC 0.51-0.53, cosine 0.94-0.96 (collapsed), SCL 1.95 (chance). This test fails
on that code. The corrective-LM loss is not guarded: at this budget it stays above the unigram
entropy with every recipe (docs/objectives.md#coco-lm-at-small-scale).
"""
from __future__ import annotations

import math

import pytest

from pipeline.monitor.health import COLLAPSE_COSINE
from pipeline.train.metrics import read_jsonl
from tests.train.runs import run_inprocess

STEPS = 300
WINDOW = 50


@pytest.fixture(scope="module")
def late_signals(tiny_shards_dir, tmp_path_factory) -> dict[str, float]:
    """Means of the learning signals over the last `WINDOW` logged steps of one tiny run."""
    out = tmp_path_factory.mktemp("cocolm_learns")
    code = run_inprocess("tiny-cocolm", tiny_shards_dir, out, f"train.total_steps={STEPS}", "train.seed=1",
                         f"train.checkpoint_every={STEPS}")
    assert code == 0
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r["step"] > STEPS - WINDOW]
    assert len(rows) == WINDOW
    keys = ("rtd_auc", "rtd_auc_chance", "scl_loss", "scl_loss_chance")
    signals = {k: sum(r[f"cocolm/{k}"] for r in rows) / len(rows) for k in keys}
    signals["token_cosine"] = sum(r["health/token_cosine"] for r in rows) / len(rows)
    return signals


def test_copy_head_detects_replaced_tokens(late_signals):
    assert late_signals["rtd_auc_chance"] == 0.5
    assert late_signals["rtd_auc"] >= 0.62, f"RTD AUC {late_signals['rtd_auc']:.3f} stays near chance 0.5"


def test_token_states_do_not_collapse(late_signals):
    assert late_signals["token_cosine"] < COLLAPSE_COSINE, late_signals


def test_sequence_contrast_leaves_chance(late_signals):
    micro_batch = 4  # tiny-mlm's data.micro_batch_size: 2N - 1 = 7 candidates per anchor
    assert late_signals["scl_loss_chance"] == pytest.approx(math.log(2 * micro_batch - 1))
    assert late_signals["scl_loss"] <= 0.9 * late_signals["scl_loss_chance"], late_signals
