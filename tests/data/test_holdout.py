"""`data_prep.build_shards --holdout-fraction`: a validation shard set of held-out documents (`data_prep.holdout`)."""
from __future__ import annotations

from pathlib import Path

from data_prep.build_shards import main
from data_prep.holdout import DocumentSplit, holdout_hash
from pipeline.data.shards import read_manifest


def _args(corpus: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return ["--input", str(corpus), "--tokenizer", str(tokenizer), "--out", str(out), "--seq-len", "64",
            "--num-proc", "1", "--no-progress", *extra]


def test_cli_writes_both_sets_and_a_rerun_confirms_them(tiny_corpus_file, tiny_tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "shards"
    assert main(_args(tiny_corpus_file, tiny_tokenizer_dir, out, "--holdout-fraction", "0.25")) == 0
    assert f"{out / 'validation'}:" in capsys.readouterr().out
    train, held = read_manifest(out), read_manifest(out / "validation")
    assert held.stats["documents"] == train.stats["other_side_documents"] > 0
    assert main(_args(tiny_corpus_file, tiny_tokenizer_dir, out, "--holdout-fraction", "0.25")) == 0  # complete: kept
    assert read_manifest(out / "validation").content_hash == held.content_hash
    # another fraction into the same directories is another build: refused, naming what differs
    assert main(_args(tiny_corpus_file, tiny_tokenizer_dir, out, "--holdout-fraction", "0.5")) == 2
    assert "holdout" in capsys.readouterr().err


def test_holdout_dir_and_a_bad_fraction(tiny_corpus_file, tiny_tokenizer_dir, tmp_path, capsys):
    out, held = tmp_path / "train", tmp_path / "held"
    assert main(_args(tiny_corpus_file, tiny_tokenizer_dir, out, "--holdout-fraction", "0.25", "--holdout-dir",
                      str(held))) == 0
    assert read_manifest(held).seq_len == 64 and not (out / "validation").exists()
    bad = tmp_path / "bad"
    assert main(_args(tiny_corpus_file, tiny_tokenizer_dir, bad, "--holdout-fraction", "1.5")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: --holdout-fraction 1.5: must be in (0, 1), e.g. 0.05"] and not bad.exists()


def test_the_rule_is_a_function_of_the_text_alone():
    """The same text is held out or not whatever else is in the corpus; the share is about the fraction."""
    texts = [f"document number {i} about something" for i in range(4000)]
    split = DocumentSplit(0.05, "validation")
    held = [t for t in texts if split.keeps(t)]
    assert 0.035 < len(held) / len(texts) < 0.065
    assert all(DocumentSplit(0.05, "train").keeps(t) != split.keeps(t) for t in texts[:200])
    assert holdout_hash("héllo \udcff") == holdout_hash("héllo \udcff")  # surrogates from undecodable bytes hash


def test_a_corpus_too_small_to_split_says_why_and_leaves_nothing(tiny_tokenizer_dir, tmp_path, capsys):
    """Issue 57: one document with --holdout-fraction 0.5 said "no non-empty documents" (the document exists)
    and left an empty validation/ behind. Whichever side the document falls on, the other is empty: one line
    saying so, and no directory left (a training set alone would refuse the re-run with another fraction)."""
    import re

    text = "the only document of this corpus, long enough to pack a few rows of tokens: " * 8
    sides = {}
    for i in range(40):  # documents that fall on each side of the 0.5 rule
        doc = f"{i} {text}"
        sides.setdefault(DocumentSplit(0.5, "validation").keeps(doc), doc)
        if len(sides) == 2:
            break
    assert len(sides) == 2
    for held, doc in sides.items():
        corpus = tmp_path / f"held{held}.txt"
        corpus.write_text(doc + "\n")
        out = tmp_path / f"shards{held}"
        assert main(_args(corpus, tiny_tokenizer_dir, out, "--holdout-fraction", "0.5")) == 2
        (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert "no non-empty documents" not in error and error.endswith("; nothing was written")
        if held:
            assert re.search(r"--holdout-fraction 0.5: all 1 non-empty document\(s\) of --input .* are held out", error)
        else:
            assert re.search(r"--holdout-fraction 0.5: none of the 1 non-empty document\(s\) .* is held out", error)
        assert not out.exists()
    held_dir = tmp_path / "held_elsewhere"  # --holdout-dir outside OUT: removed as well
    out = tmp_path / "shards_dir"
    assert main(_args(tmp_path / "heldFalse.txt", tiny_tokenizer_dir, out, "--holdout-fraction", "0.5",
                      "--holdout-dir", str(held_dir))) == 2
    assert not out.exists() and not held_dir.exists()
