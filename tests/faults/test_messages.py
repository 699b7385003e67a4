"""Class 6, races and unclear messages: each says what is wrong, where, and what to do, in a line or two.

* converting a checkpoint that the training run prunes meanwhile: "removed while it was being
  converted", naming the checkpoint to convert instead (not "not a DeepSpeed checkpoint");
* re-running the shard build after an input file changed: the refusal names the file;
* fine-tuning a task whose train file lacks a label column: a short error naming train.tsv (not a
  megabyte-long label list blaming dev.tsv)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from data_prep.build_shards import main as build_main
from pipeline.eval.glue import resolve_task
from pipeline.export import convert as convert_module
from tests.train.runs import latest, run_inprocess, tag_dir


def test_converting_a_checkpoint_the_run_prunes_meanwhile(monkeypatch, tiny_shards_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, "train.total_steps=4", "train.checkpoint_every=2",
                         "train.keep_last=5") == 0
    original = convert_module.model_from_meta

    def pruned_meanwhile(meta):  # the conversion has verified step 2; the training run deletes it now
        shutil.rmtree(tag_dir(run, 2))
        return original(meta)

    monkeypatch.setattr(convert_module, "model_from_meta", pruned_meanwhile)
    assert convert_module.main([str(tag_dir(run, 2)), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {tag_dir(run, 2)}: removed while it was being converted (the training run writing to "
                   f"{run / 'checkpoints'} pruned it, train.keep_last); convert {latest(run)} instead, or convert once "
                   "the run has ended")
    assert not (tmp_path / "hf").exists()


def test_shard_rebuild_after_an_input_changed_names_the_file(tiny_corpus_file, tiny_tokenizer_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    shutil.copy(tiny_corpus_file, corpus)
    args = ["--input", str(corpus), "--tokenizer", str(tiny_tokenizer_dir), "--out", str(tmp_path / "shards"),
            "--seq-len", "64", "--no-progress"]
    assert build_main(args) == 0
    with corpus.open("a") as fh:
        fh.write("\n\nOne more document.\n")
    capsys.readouterr()
    assert build_main(args) == 2
    err = capsys.readouterr().err
    assert f"(input {corpus.resolve()} changed since the build (its sha256 differs))" in err
    assert len(err.strip().splitlines()) == 1 and "Use a new --out directory, or delete this one to rebuild" in err


def _write(path: Path, rows: list[list[str]]) -> None:
    path.write_text("".join("\t".join(r) + "\n" for r in rows))


def test_fine_tune_train_file_without_a_label_column(tmp_path):
    sentences = [[f"sentence number {i} with some words in it ."] for i in range(400)]
    _write(tmp_path / "train.tsv", [["sentence"], *sentences])
    _write(tmp_path / "dev.tsv", [["sentence", "label"], *[[s[0], str(i % 2)] for i, s in enumerate(sentences[:50])]])
    with pytest.raises(ValueError) as err:
        resolve_task(tmp_path, "generic")
    assert str(err.value) == (f"{tmp_path / 'train.tsv'}: no label column (columns: ['sentence']; looked for ['label', "
                              "'gold_label', 'score', 'is_duplicate', 'Quality'] or a last column besides the text); "
                              "add one or set --label-col")
    # a text column taken as the label is named in the train file, briefly
    _write(tmp_path / "train.tsv", [["id", "sentence"], *[[str(i), s[0]] for i, s in enumerate(sentences)]])
    with pytest.raises(ValueError, match=r"train.tsv: column 'sentence', taken as the label, has 400 distinct values in "
                                         r"400 rows: it holds text, not labels; name the label column with --label-col"):
        resolve_task(tmp_path, "generic")
    # a headerless train file of a known task: short, and says why
    _write(tmp_path / "train.tsv", [[s[0] * 20, "0"] for s in sentences])
    with pytest.raises(ValueError) as err:
        resolve_task(tmp_path, "sst2")
    assert str(err.value).startswith(f"{tmp_path / 'train.tsv'}: no column 'label'") and len(str(err.value)) < 300
    assert "its first line looks like data, not a header" in str(err.value)
