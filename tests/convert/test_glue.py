"""GLUE-format reading and task detection (the metrics: tests/eval/test_metrics.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.eval import glue


def _write(path: Path, header: list[str] | None, rows: list[list[str]]) -> None:
    lines = (["\t".join(header)] if header else []) + ["\t".join(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")


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
