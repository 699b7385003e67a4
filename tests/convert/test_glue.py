"""GLUE-format reading, task detection and metrics (checked against scikit-learn / scipy)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.eval import glue


def _write(path: Path, header: list[str] | None, rows: list[list[str]]) -> None:
    lines = (["\t".join(header)] if header else []) + ["\t".join(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_classification_metrics_match_sklearn(seed):
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(seed)
    gold = rng.integers(0, 2, 200)
    pred = np.where(rng.random(200) < 0.7, gold, 1 - gold)
    assert glue.accuracy(pred, gold) == pytest.approx(metrics.accuracy_score(gold, pred))
    assert glue.f1_binary(pred, gold, 1) == pytest.approx(metrics.f1_score(gold, pred))
    assert glue.matthews(pred, gold) == pytest.approx(metrics.matthews_corrcoef(gold, pred))
    gold3, pred3 = rng.integers(0, 3, 300), rng.integers(0, 3, 300)
    assert glue.matthews(pred3, gold3) == pytest.approx(metrics.matthews_corrcoef(gold3, pred3))
    assert glue.matthews(np.zeros(5, int), np.zeros(5, int)) == 0.0  # undefined -> 0, as sklearn


def test_correlations_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x = rng.normal(size=100)
    y = 0.5 * x + rng.normal(size=100)
    y_ties = np.round(y)  # many ties: average ranks matter
    assert glue.pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0])
    assert glue.spearman(x, y_ties) == pytest.approx(stats.spearmanr(x, y_ties)[0])
    np.testing.assert_allclose(glue.average_ranks(y_ties), stats.rankdata(y_ties))


def test_detects_sentence_pair_regression(tmp_path):
    header = ["index", "sentence1", "sentence2", "score"]
    _write(tmp_path / "train.tsv", header, [["0", "a b", "c d", "1.5"], ["1", "e", "f", "3.0"], ["2", "g", "h", "0"]])
    _write(tmp_path / "dev.tsv", header, [["0", "a", "b", "2.25"]])
    spec, train, dev = glue.resolve_task(tmp_path, "generic")
    assert spec.text_cols == ("sentence1", "sentence2") and spec.label_col == "score"
    assert spec.labels is None and spec.metrics == ("pearson", "spearman")
    assert train.texts[1] == ("e", "f") and train.labels == [1.5, 3.0, 0.0] and dev.labels == [2.25]


def test_detects_single_sentence_classification_with_string_labels(tmp_path):
    header = ["id", "text", "label"]
    _write(tmp_path / "train.tsv", header, [["1", "x y", "pos"], ["2", "z", "neg"], ["3", "w", "pos"]])
    _write(tmp_path / "dev.tsv", header, [["4", "q", "neg"]])
    spec, train, dev = glue.resolve_task(tmp_path, "generic")
    assert spec.text_cols == ("text",) and spec.labels == ("neg", "pos")
    assert train.labels == [1, 0, 1] and dev.labels == [0]
    assert spec.positive_label == "pos" and spec.metrics[0] == "accuracy"


def test_known_task_layouts(tmp_path):
    # MRPC's real header; CoLA's original files have none.
    _write(tmp_path / "train.tsv", ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"], [["1", "7", "8", "a", "b"]])
    _write(tmp_path / "dev.tsv", ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"], [["0", "7", "8", "c", "d"]])
    spec, train, _ = glue.resolve_task(tmp_path, "mrpc")
    assert spec.metrics == ("f1", "accuracy") and train.texts == [("a", "b")] and train.labels == [1]
    cola = tmp_path / "cola"
    cola.mkdir()
    _write(cola / "train.tsv", None, [["gj04", "1", "", "The book fell."], ["gj04", "0", "*", "Book the fell."]])
    _write(cola / "dev.tsv", None, [["gj04", "1", "", "It rained."]])
    spec, train, dev = glue.resolve_task(cola, "cola")
    assert spec.metrics[0] == "matthews" and train.texts[1] == ("Book the fell.",) and train.labels == [1, 0]


def test_errors_name_the_file_and_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.tsv"):
        glue.resolve_task(tmp_path, "generic")
    _write(tmp_path / "train.tsv", ["sentence", "label"], [["a", "0"], ["b", "1"]])
    _write(tmp_path / "dev.tsv", ["sentence", "label"], [["a", "2"]])
    with pytest.raises(ValueError, match=r"dev.tsv: labels \['2'\]"):
        glue.resolve_task(tmp_path, "generic")
    with pytest.raises(ValueError, match="no column 'nope'.*--label-col"):
        glue.resolve_task(tmp_path, "generic", label_col="nope")
    with pytest.raises(ValueError, match="--task 'glue'"):
        glue.resolve_task(tmp_path, "glue")
    _write(tmp_path / "dev.tsv", ["sentence", "label"], [["only-one-field"]])
    with pytest.raises(ValueError, match="dev.tsv: line 2 has 1 fields"):
        glue.resolve_task(tmp_path, "generic")
