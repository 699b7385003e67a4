"""Time-to-quality pieces: the held-out word-order task, device-hour bookkeeping, argument checks."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from benchmarks.probe_task import scramble, sentences_from_text, word_order_task
from benchmarks.time_to_quality import cumulative_hours, parse_args
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


def test_cumulative_hours_sum_step_times_times_world_size() -> None:
    records = [{"step": 2, "step_time_s": 7200.0}, {"step": 1, "step_time_s": 3600.0}]
    assert cumulative_hours(records, world_size=4) == {1: 4.0, 2: 12.0}


def test_arguments_are_checked_before_any_work(tmp_path: Path, capsys) -> None:
    text = tmp_path / "t.txt"
    text.write_text("x\n")
    for argv, message in ((["--text", str(text)], "--heldout is required"),
                          (["--shards", str(tmp_path)], "--heldout-shards"),
                          (["--text", str(tmp_path / "missing.txt"), "--heldout", str(text)], "missing.txt"),
                          (["--text", str(text), "--heldout", str(text), "--eval-every", "0"], "--eval-every"),
                          (["--text", str(text), "--heldout", str(text), "--objectives", "nope"], "nope")):
        with pytest.raises(SystemExit):
            parse_args([*argv, "--out", str(tmp_path / "o")])
        assert message in capsys.readouterr().err
    args = parse_args(["--text", str(text), "--heldout", str(text), "--target", "heldout_mlm_acc=0.3",
                       "--out", str(tmp_path / "o")])
    assert args.targets == {"heldout_mlm_acc": 0.3} and args.objectives == ["taco"]
