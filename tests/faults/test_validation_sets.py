"""Silently wrong, issue 57, validation (`eval.*`): a held-out set that holds the training data's documents or
rows in other shards (the training set rebuilt with another `--shard-size-mb`: other bytes, other content
hash, the same rows) is refused before compute, naming it; every `val/` record names the set it was
measured on, and a resume on another set says so in one line, keeps the best checkpoint of the earlier set,
and never compares values of the two (the best record, `validation_summary` for `cpt-status` and the card)."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from data_prep.build_shards import build_shards
from pipeline.data.overlap import row_overlap, shared_source
from pipeline.data.shards import read_manifest
from pipeline.train.checkpoint.best import read_best
from pipeline.train.cli import EXIT_CONFIG_ERROR
from pipeline.train.metrics import read_jsonl
from pipeline.train.validation import EVAL_SET_KEY, is_validation_record, validation_summary
from tests.faults.faults import error_line
from tests.fixtures_data import TINY_SEQ_LEN, stdlib_documents, write_corpus
from tests.train.runs import run_inprocess, tag_dir
from tests.train.test_validation import split_shards  # noqa: F401 - the module fixture: training + held-out shards

#: stdlib modules the tiny corpus does not read: documents no training set here holds
UNSEEN_MODULES = ("subprocess", "inspect", "enum", "socket", "sqlite3", "unittest", "asyncio", "typing")


def _eval(held: Path, *extra: str) -> list[str]:
    return [f"eval.shards_dir={held}", "eval.every=2", "eval.batches=2", *extra]


@pytest.fixture(scope="module")
def unseen_set(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A second held-out set: documents of modules the tiny corpus never read, the tiny tokenizer."""
    root = tmp_path_factory.mktemp("unseen")
    corpus = write_corpus(root / "unseen.txt", stdlib_documents(UNSEEN_MODULES))
    build_shards([corpus], tiny_tokenizer_dir, root / "shards", seq_len=TINY_SEQ_LEN, shard_size_mb=0.02, num_proc=1,
                 progress=False)
    return root / "shards"


def test_the_training_set_rebuilt_with_another_shard_size_is_refused_as_validation(tiny_shards_dir, tiny_corpus_file,
                                                                                tiny_tokenizer_dir, tmp_path, capsys):
    rebuilt = tmp_path / "rebuilt"
    build_shards([tiny_corpus_file], tiny_tokenizer_dir, rebuilt, seq_len=TINY_SEQ_LEN, shard_size_mb=0.05, num_proc=1,
                 progress=False)
    assert read_manifest(rebuilt).content_hash != read_manifest(tiny_shards_dir).content_hash  # other bytes
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=4", *_eval(rebuilt)) == EXIT_CONFIG_ERROR
    message = error_line(capsys.readouterr().err)
    assert message.startswith(f"eval.shards_dir={rebuilt} was built from {tiny_corpus_file.name} (sha256 "), message
    assert f"which the training data {tiny_shards_dir} was built from too: it holds training documents" in message
    assert not (out / "metrics.jsonl").exists()  # before compute
    assert row_overlap(rebuilt, tiny_shards_dir).refused()  # the rows say so too (below)


def test_the_same_rows_from_a_differently_written_corpus_are_refused(tiny_shards_dir, tiny_corpus_file,
                                                                     tiny_tokenizer_dir, tmp_path, capsys):
    """The same documents in a file with other bytes (blank lines added: the same documents, another sha256):
    the source check cannot see it, the rows check does."""
    copy = tmp_path / "corpus.txt"
    copy.write_text(tiny_corpus_file.read_text() + "\n\n\n")
    rebuilt = tmp_path / "rebuilt"
    build_shards([copy], tiny_tokenizer_dir, rebuilt, seq_len=TINY_SEQ_LEN, shard_size_mb=0.05, num_proc=1,
                 progress=False)
    assert shared_source(read_manifest(rebuilt), read_manifest(tiny_shards_dir)) is None
    overlap = row_overlap(rebuilt, tiny_shards_dir)
    assert overlap.share == 1.0 and overlap.hits == overlap.sampled
    assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path / "run", "train.total_steps=4",
                         *_eval(rebuilt)) == EXIT_CONFIG_ERROR
    message = error_line(capsys.readouterr().err)
    assert message.startswith(f"eval.shards_dir={rebuilt}: about 100% of its rows are rows of the training data "
                              f"{tiny_shards_dir}"), message


def test_a_held_out_set_shares_no_documents_and_few_rows(split_shards, unseen_set):
    """A proper held-out split shares no document; a few rows may coincide (the tiny corpus's docstrings repeat
    boilerplate such as "Return self==value."), far below the refusal's half."""
    shards, held = split_shards
    assert shared_source(read_manifest(held), read_manifest(shards)) is None  # the two sides of one rule
    assert row_overlap(held, shards).share < 0.1 and not row_overlap(held, shards).refused()
    assert not row_overlap(unseen_set, shards).refused()
    # the other way round (training side offered as the held-out set) they are not two sides of one rule
    assert shared_source(read_manifest(shards), read_manifest(held)) is not None


def test_a_resume_on_another_validation_set_says_so_and_compares_only_its_own_values(split_shards, unseen_set,
                                                                                     tmp_path, caplog):
    shards, held = split_shards
    out = tmp_path / "run"
    args = ["train.checkpoint_every=100", "train.keep_last=1", "train.keep_best=val/mlm/loss"]
    assert run_inprocess("tiny-mlm", shards, out, "train.total_steps=4", *args, *_eval(held)) == 0
    first = [r for r in read_jsonl(out / "metrics.jsonl") if is_validation_record(r)]
    assert [r["step"] for r in first] == [2, 4] and len({r[EVAL_SET_KEY] for r in first}) == 1
    old_set, old_best = first[0][EVAL_SET_KEY], read_best(out / "checkpoints")
    assert old_best.eval_set == old_set
    moved = shutil.copytree(held, tmp_path / "moved")  # the same set elsewhere: the same identity
    with caplog.at_level(logging.WARNING):
        assert run_inprocess("tiny-mlm", shards, out, "train.total_steps=6", "train.allow_config_change=true", *args, *_eval(moved)) == 0
    assert "validation set changed" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert run_inprocess("tiny-mlm", shards, out, "train.total_steps=8", "train.allow_config_change=true", *args, *_eval(unseen_set)) == 0
    changed = [r.getMessage() for r in caplog.records if "the validation set changed" in r.getMessage()]
    assert len(changed) == 1 and f"eval.shards_dir {moved} -> {unseen_set}" in changed[0], changed
    records = [r for r in read_jsonl(out / "metrics.jsonl") if is_validation_record(r)]
    new_set = records[-1][EVAL_SET_KEY]
    assert new_set != old_set and [r[EVAL_SET_KEY] for r in records] == [old_set] * 3 + [new_set]
    summary = validation_summary(read_jsonl(out / "metrics.jsonl"))
    assert summary[EVAL_SET_KEY] == new_set and summary["evaluations"] == 1 and summary["other_set_evaluations"] == 3
    assert summary["terms"]["val/loss"]["best_step"] == 8  # never a value of the earlier set
    best = read_best(out / "checkpoints")
    assert (best.step, best.eval_set) == (8, new_set)
    earlier_best = json.loads((tag_dir(out, 8) / "pipeline_meta.json").read_text())["best"]
    assert earlier_best["keep"] and all(tag_dir(out, int(t[5:])).is_dir() for t in earlier_best["keep"])
