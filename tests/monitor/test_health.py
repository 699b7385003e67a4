"""Representation-health metrics against direct computations."""
from __future__ import annotations

import itertools
import math

import torch

from pipeline.monitor.health import is_collapsed, mean_token_cosine, unigram_accuracy


def test_mean_token_cosine_equals_the_mean_over_distinct_pairs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    rows = hidden[mask]
    pairs = [torch.nn.functional.cosine_similarity(rows[i], rows[j], dim=0) for i, j in itertools.permutations(range(7), 2)]
    assert math.isclose(mean_token_cosine(hidden, mask), float(torch.stack(pairs).mean()), rel_tol=1e-5)


def test_collapse_is_flagged_and_healthy_states_are_not():
    same = torch.ones(1, 10, 4) + 1e-4 * torch.randn(1, 10, 4)
    assert is_collapsed(mean_token_cosine(same))
    assert not is_collapsed(mean_token_cosine(torch.randn(1, 50, 64)))
    assert not is_collapsed(mean_token_cosine(torch.randn(1, 1, 4)))  # one token: undefined, not collapsed


def test_unigram_accuracy_is_the_frequency_of_the_most_common_token():
    counts = torch.tensor([0, 5, 50, 7])
    assert unigram_accuracy(counts, torch.tensor([2, 2, 1, 3])) == 0.5


# ---- during training ---------------------------------------------------------------------------

import logging  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pipeline.monitor.health import (  # noqa: E402
    CollapseMonitor,
    collapse_problems,
    step_health,
    token_cosine_tensor,
    unigram_counts,
)
from tests.objectives.conftest import SPECIAL, make_batch, tiny_model  # noqa: E402


def test_token_cosine_tensor_matches_the_indexed_computation_and_is_nan_below_two_rows():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 6, 16, generator=g)
    mask = torch.rand(3, 6, generator=g) > 0.4
    rows = torch.nn.functional.normalize(hidden[mask], dim=-1)
    n = rows.shape[0]
    direct = float(((rows @ rows.T).sum() - n) / (n * (n - 1)))
    assert float(token_cosine_tensor(hidden, mask)) == pytest.approx(direct, rel=1e-5)
    one = torch.zeros(3, 6, dtype=torch.bool)
    one[0, 0] = True
    assert math.isnan(float(token_cosine_tensor(hidden, one)))


class _Rows:
    """A `ShardDataset` stand-in with the three members `unigram_counts` reads (test data only)."""

    def __init__(self, ids: np.ndarray, vocab_size: int) -> None:
        self.ids, self.vocab_size, self.special_tokens = ids, vocab_size, dict(SPECIAL)
        self.taken: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, rows):
        self.taken = list(rows)
        return self.ids[rows], np.zeros_like(self.ids[rows])


def test_unigram_counts_reads_a_bounded_even_sample_and_zeroes_special_tokens():
    ids = np.full((100, 6), 7)
    ids[:, 0], ids[:, 5] = SPECIAL["cls"], SPECIAL["sep"]
    ids[::2, 1] = 9
    ids[:, 3:5] = SPECIAL["mask"]  # special: never the unigram answer, however frequent
    data = _Rows(ids, vocab_size=12)
    counts = unigram_counts(data, max_rows=10)
    assert data.taken == [0, 11, 22, 33, 44, 55, 66, 77, 88, 99]  # evenly spaced, first and last included
    assert counts.tolist() == [0, 0, 0, 0, 0, 0, 0, 15, 0, 5, 0, 0]
    assert int(counts.argmax()) == 7


def test_step_health_reads_the_masked_view_output_and_the_batch_plateau():
    model = tiny_model({"mlm": 1.0, "capt": 1.0}, dropout=0.0, attention_dropout=0.0).eval()
    batch = make_batch()
    model.health_top_token = int(batch["mlm_labels"][batch["mlm_labels"] != -100][0])
    with torch.no_grad():
        _, metrics = model(batch)
        hidden = model.bert(batch["masked_ids"], batch["attention_mask"]).last_hidden
    content = batch["attention_mask"].bool() & ~batch["special_mask"].bool()
    assert float(metrics["health/token_cosine"]) == pytest.approx(mean_token_cosine(hidden, content), rel=1e-5)
    labels = batch["mlm_labels"][batch["mlm_labels"] != -100]
    assert float(metrics["health/unigram_accuracy"]) == pytest.approx(
        float((labels == model.health_top_token).float().mean()))
    # no cached output, no top token: nothing to report
    assert step_health({}, batch, torch.tensor([0, 1, 2]), None) == {}


def test_cocolm_logs_the_scl_positive_cosine():
    model = tiny_model({"cocolm": 1.0}, {"cocolm": {"generator_layers": 1}}).eval()
    with torch.no_grad():
        _, metrics = model(make_batch())
    value = float(metrics["cocolm/positive_cosine"])
    assert -1.0 <= value <= 1.0
    assert "health/token_cosine" in metrics  # the crop view's output (X^MLM is private to the objective)


def test_collapse_monitor_flags_every_step_and_warns_on_entering_and_leaving(caplog):
    assert collapse_problems({"health/token_cosine": 0.5, "capt/positive_cosine": 0.2}) == []
    assert len(collapse_problems({"health/token_cosine": 0.99, "cocolm/positive_cosine": 0.9995})) == 2
    monitor = CollapseMonitor(logging.getLogger("test.health"))
    cosines = [0.4, 0.95, 0.97, 0.3, 0.2]
    with caplog.at_level(logging.WARNING, logger="test.health"):
        flags = [monitor.observe(step, {"health/token_cosine": c})["health/collapsed"]
                 for step, c in enumerate(cosines, start=1)]
    assert flags == [0.0, 1.0, 1.0, 0.0, 0.0]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "COLLAPSE at step 2" in messages[0] and "recovered" in messages[1]
