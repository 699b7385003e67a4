"""COCO-LM's Figure 1 measurement (`benchmarks.quality.representation_cosines`): the held-out sentences and
random pairs it draws, the statistics per model and seed, the "more squeezed" verdict, and a run on two
converted tiny models (MLM and ELECTRA) that writes the JSON, Markdown and PNG."""
from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.quality.representation_cosines import (RANDOM_INIT, compare, heldout_sentences, main, parse_models,
                                                       random_pairs, summary)
from pipeline.export.convert import convert
from tests.train.runs import run_inprocess

TEXT = "\n".join([
    " = A heading = ",
    " the first sentence has exactly eight words in it . a short one . the second sentence is also long "
    "enough to be kept here .",
    " the first sentence has exactly eight words in it .",  # a duplicate: kept once
])


def test_heldout_sentences_drop_headings_short_ones_and_duplicates(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    assert heldout_sentences(path) == ["the first sentence has exactly eight words in it .",
                                       "the second sentence is also long enough to be kept here ."]
    path.write_text(" = Only = \n a few words .")
    with pytest.raises(ValueError, match="fewer than 2 sentences"):
        heldout_sentences(path)


def test_random_pairs_never_pair_a_sentence_with_itself_and_are_seeded():
    sentences = [f"s{i}" for i in range(5)]
    first, second = random_pairs(sentences, 2000, seed=1)
    assert all(a != b for a, b in zip(first, second))
    assert set(first) == set(sentences) and set(second) == set(sentences)
    assert random_pairs(sentences, 50, seed=1) == random_pairs(sentences, 50, seed=1) != random_pairs(sentences, 50, 2)


def test_summary_statistics():
    random, similar = np.array([0.1, 0.2, 0.3, 0.9]), np.array([0.5, 0.6, 0.7])
    s = summary(random, similar)
    assert s["random_mean"] == pytest.approx(0.375) and s["similar_mean"] == pytest.approx(0.6)
    assert s["gap"] == pytest.approx(0.225) and s["random_above_similar_median"] == 0.25  # only 0.9 > 0.6


def _records(random_means, gaps):
    return [{"random_mean": r, "gap": g} for r, g in zip(random_means, gaps)]


def test_more_squeezed_means_higher_random_cosine_and_no_larger_gap():
    measured = {"cls": {"electra": _records([0.95, 0.96, 0.97], [0.01, 0.02, 0.01]),
                        "mlm": _records([0.60, 0.62, 0.61], [0.10, 0.12, 0.11]),
                        "cocolm": _records([0.94, 0.98, 0.99], [0.05, 0.01, 0.02])}}
    line = compare(measured, "cls", "electra", "mlm")
    assert line.startswith("[cls] electra IS more squeezed than mlm") and "(intervals separate)" in line
    assert compare(measured, "cls", "mlm", "electra").startswith("[cls] mlm is NOT more squeezed")
    assert "(intervals overlap)" in compare(measured, "cls", "cocolm", "electra")
    assert compare(measured, "cls", "electra", "capt") == ""  # a model not measured: no line


def test_bad_model_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="expected NAME=DIR"):
        parse_models(["mlm"])
    with pytest.raises(ValueError, match="--model mlm: no converted model"):
        parse_models([f"mlm={tmp_path}"])


def test_measures_converted_models_and_random_init(tiny_shards_dir, tmp_path):
    dirs = {}
    for preset in ("tiny-mlm", "tiny-electra"):
        run = tmp_path / preset
        assert run_inprocess(preset, tiny_shards_dir, run, "train.total_steps=3", "train.checkpoint_every=3") == 0
        dirs[preset.removeprefix("tiny-")] = convert(run, tmp_path / f"{preset}-hf")
    text = tmp_path / "heldout.txt"
    text.write_text("\n".join(f" sentence number {i} talks about the river and the mill near the village ."
                              for i in range(40)))
    sts = tmp_path / "sts.tsv"
    sts.write_text("".join(f"main\tf\t2012\t{i}\t{score}\tthe river flows past the mill .\tthe mill is by the river .\n"
                           for i, score in enumerate([4.5, 5.0, 1.0, 4.0])))
    out = tmp_path / "out"
    code = main(["--model", f"mlm={dirs['mlm']}", "--model", f"electra={dirs['electra']}", "--heldout-text", str(text),
                 "--sts", str(sts), "--pairs", "30", "--init-seeds", "1,2", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "representation_cosines.json").read_text())
    assert (out / "representation_cosines.md").is_file() and (out / "representation_cosines.png").is_file()
    for pooling in ("cls", "mean"):
        measured = report["measured"][pooling]
        assert list(measured) == [RANDOM_INIT, "mlm", "electra"] and len(measured[RANDOM_INIT]) == 2
        record = measured["electra"][0]
        histogram = record["histogram"]  # counts over the report's bins, every pair in one
        assert sum(histogram["random"]) == 30 and sum(histogram["similar"]) == 3  # scores >= 4
        assert len(histogram["random"]) == len(report["histogram_bins"]) - 1
        assert -1.0 <= record["random_mean"] <= 1.0
    assert any(n.startswith("[cls] electra") for n in report["notes"])
    assert "the 3 pairs of sts.tsv with gold score >= 4" in report["notes"][0]
