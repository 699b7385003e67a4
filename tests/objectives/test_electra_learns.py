"""Regression guard: the shipped small-scale ELECTRA recipe (`tiny-electra`) learns its task.

A tiny CPU run (300 steps of 8 x 64 tokens on the test shards) and its logged learning signals against
their chance levels over the last 50 steps:

* replaced-token detection: `electra/rtd_auc` well above `rtd_auc_chance` = 0.5;
* no collapse: `health/token_cosine` (the discriminator's states) below `COLLAPSE_COSINE`.

The same run with the paper's sampling (T = 1) is the fault this guards against: its discriminator's
token states collapse (docs/objectives.md#electra), and this test checks that they do, so the guard
is known to fail on that recipe. Measured (seed 1, steps 251-300): `tiny-electra` AUC 0.714, token
cosine 0.807; T = 1: AUC 0.535, cosine 0.949. The generator is not guarded here: at this size (a
16-wide generator, 300 steps of the test shards) its masked accuracy sits on the unigram plateau with
either sampling (0.050-0.053 against 0.050); at the study's size it leaves it (docs/objectives.md#electra).
"""
from __future__ import annotations

import pytest

from pipeline.monitor.health import COLLAPSE_COSINE
from pipeline.train.metrics import read_jsonl
from tests.train.runs import run_inprocess

STEPS = 300
WINDOW = 50
RECIPES = {"tiny-electra": [], "paper sampling (T = 1)": ["objective_options.electra.sample_temperature=1.0"]}


@pytest.fixture(scope="module", params=list(RECIPES))
def late_signals(request, tiny_shards_dir, tmp_path_factory) -> tuple[str, dict[str, float]]:
    """Means of the learning signals over the last `WINDOW` logged steps of one tiny run of a recipe."""
    out = tmp_path_factory.mktemp("electra_learns")
    code = run_inprocess("tiny-electra", tiny_shards_dir, out, f"train.total_steps={STEPS}", "train.seed=1",
                         f"train.checkpoint_every={STEPS}", *RECIPES[request.param])
    assert code == 0
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r["step"] > STEPS - WINDOW]
    assert len(rows) == WINDOW
    keys = ("electra/rtd_auc", "electra/rtd_auc_chance", "electra/gen_accuracy", "health/unigram_accuracy",
            "health/token_cosine")
    return request.param, {k: sum(r[k] for r in rows) / len(rows) for k in keys}


def test_the_recipe_learns_and_the_paper_sampling_collapses(late_signals):
    recipe, s = late_signals
    assert s["electra/rtd_auc_chance"] == 0.5
    if recipe == "tiny-electra":
        assert s["electra/rtd_auc"] >= 0.65, f"RTD AUC {s['electra/rtd_auc']:.3f} stays near chance 0.5"
        assert s["health/token_cosine"] < COLLAPSE_COSINE, s
    else:
        assert s["health/token_cosine"] > COLLAPSE_COSINE, s  # the fault the recipe fixes, still reproduced
