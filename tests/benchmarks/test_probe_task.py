"""The word-order probe task (an extra downstream check): sentences, scrambling, the GLUE-format files."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from benchmarks.quality.probe_task import main, scramble, sentences_from_text, word_order_task
from pipeline.eval.glue import resolve_task

WIKI_STYLE = [
    " = Valkyria Chronicles = ",
    " The game began development in 2010 , carrying over a large portion of the work . It was released in January",
    " 2011 in Japan and was later praised by critics for its art style and story . Too short here .",
]


def test_sentences_skip_headings_and_short_ones() -> None:
    sents = sentences_from_text(WIKI_STYLE + [" " + " ".join(["word"] * 41) + " ."])
    assert sents == ["The game began development in 2010 , carrying over a large portion of the work .",
                     "2011 in Japan and was later praised by critics for its art style and story ."]


def test_scramble_changes_exactly_one_window() -> None:
    rng = random.Random(0)
    words = "one two three four five six seven eight".split()
    for _ in range(50):
        out = scramble(words, 4, rng)
        assert out != words and sorted(out) == sorted(words)
        changed = [i for i, (a, b) in enumerate(zip(out, words)) if a != b]
        assert changed[-1] - changed[0] < 4
    assert scramble(["same"] * 6, 3, rng) == ["same"] * 6  # nothing to permute: unchanged (caller's concern)
    whole = scramble(words, 0, rng)  # window 0: the whole sentence
    assert whole != words and sorted(whole) == sorted(words)


def test_word_order_task_is_balanced_glue_format(tmp_path: Path) -> None:
    text = tmp_path / "held.txt"
    lines = [f" Sentence number {i} talks about the river , the hills and the town nearby ." for i in range(60)]
    text.write_text("\n".join(lines) + "\n")
    stats = word_order_task(text, tmp_path / "task", n_train=40, n_dev=20, window=4, seed=3)
    assert stats["train"] == {"examples": 40, "positive": 20} and stats["dev"] == {"examples": 20, "positive": 10}
    spec, train, dev = resolve_task(tmp_path / "task", "generic")
    assert spec.text_cols == ("sentence",) and spec.labels == ("0", "1")
    originals = {ln.strip() for ln in lines}
    rows = (tmp_path / "task" / "train.tsv").read_text().splitlines()[1:]
    for row in rows:
        sentence, label = row.split("\t")
        assert (sentence in originals) == (label == "1")
    dev_rows = (tmp_path / "task" / "dev.tsv").read_text().splitlines()[1:]
    numbers = sorted(int(w) for r in rows + dev_rows for w in r.split("\t")[0].split() if w.isdigit())
    assert numbers == list(range(60))  # every source sentence used once, in one form, in one split
    with pytest.raises(ValueError, match="need 100"):
        word_order_task(text, tmp_path / "t2", n_train=80, n_dev=20)


def test_command_line_writes_the_task_and_reports_bad_input(tmp_path: Path, capsys) -> None:
    text = tmp_path / "held.txt"
    text.write_text("\n".join(f" Line {i} says that the cat sat on the mat near the door ." for i in range(30)) + "\n")
    assert main(["--text", str(text), "--out", str(tmp_path / "task"), "--train", "20", "--dev", "10"]) == 0
    assert (tmp_path / "task" / "dev.tsv").read_text().count("\n") == 11
    assert main(["--text", str(text), "--out", str(tmp_path / "t2"), "--train", "40"]) == 2
    assert "need 540" in capsys.readouterr().err
