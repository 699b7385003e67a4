"""Regression guard of issue 29: InfoWord's learning signals leave their chance levels in a short CPU run.

`tiny-infoword` (2 x 64, dropout off so the curve is the objective's) trains 200 steps of 16
sequences x 64 tokens on the tiny real-text shards (~15 s of training on one shared core). Each
assertion reads the run's `metrics.jsonl` (every step logged): a term against its own
`<term>_chance`, which the objective logs beside it (docs/objectives.md#infoword).

At the study's size the paper's [CLS] / dot-product DIM stays at chance for 300 steps (the [CLS]
state is one vector for every input at initialisation and only DIM trains it). On these tiny shards,
a small corpus seen ~4 times, it creeps down instead: measured with the code before the fix, DIM
ends at 0.85 x chance (2.35 against ln 16 = 2.77, and 0.97 x at steps 41-60); with the fixed recipe
at 0.63 x (2.19 against 3.49, 0.75 x by step 60); with `lambda_dim` 0.1 and NCE on its own BERT-masked
view (the recipe since docs/objectives.md#bert-nce) at 0.67 x (2.34 against 3.49, 0.77 x at steps 41-60).
The guard asks for 0.75 x at the end, so it fails on the old recipe, and for a fall that is still going
on over the last steps.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.train.metrics import read_jsonl
from tests.train.runs import run_inprocess

STEPS = 200
RUN = [f"train.total_steps={STEPS}", "optim.warmup_steps=12", "train.checkpoint_every=1000",
       "data.micro_batch_size=16", "data.global_batch_size=16", "model.dropout=0.0", "model.attention_dropout=0.0",
       "train.deterministic=false", "train.seed=1"]
WINDOW = 30  # steps averaged at each end: one step's DIM over ~35 pairs is noisy


@pytest.fixture(scope="module")
def curve(tiny_shards_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    out = tmp_path_factory.mktemp("infoword_learns")
    assert run_inprocess("tiny-infoword", tiny_shards_dir, out, *RUN) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return {k: np.array([r[k] for r in rows]) for k in rows[-1]}


def ends(values: np.ndarray) -> tuple[float, float]:
    return float(values[:WINDOW].mean()), float(values[-WINDOW:].mean())


def test_dim_leaves_chance_and_is_still_falling(curve):
    dim, chance = curve["infoword/dim_loss"], curve["infoword/dim_loss_chance"]
    first, last = ends(dim)
    assert last <= 0.75 * float(chance[-WINDOW:].mean()), (first, last, float(chance.mean()))
    assert last < first - 0.2
    assert dim[-WINDOW:].mean() < dim[-3 * WINDOW : -WINDOW].mean()  # the last steps still lower it


def test_nce_leaves_chance(curve):
    """Only just, at this size: most of the NCE term's gain comes from the unchanged tokens (docs/objectives.md#bert-nce)."""
    nce, chance = curve["infoword/nce_loss"], curve["infoword/nce_loss_chance"]
    assert ends(nce)[1] < float(chance[-WINDOW:].mean()) - 0.02


def test_token_states_do_not_collapse(curve):
    assert curve["health/token_cosine"][-WINDOW:].mean() < 0.9

