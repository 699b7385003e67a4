"""A tool given another run's tokenizer or weights: every tool checks what training checks.

Each case used to end with exit 0 and a wrong result; now each is one `error:` line and exit 2,
before anything is written (the export directory, the shards, the fine-tuning result), and what
was there before survives:

* `cpt-convert TAG OUT --weights DIR` with `zero_to_fp32.py`'s output of another step;
* `cpt-convert ... --tokenizer DIR` with a tokenizer of the same size but another vocabulary;
* `build_shards --tokenizer DIR` / `finetune --model DIR` where DIR lost its tokenizer files (a
  5-token placeholder: ~96% [UNK]), refused with the unknown share;
* an empty config file (or one holding `0` / `null` / a list);
* `cpt-convert` of a run whose shards were rebuilt in place with other text: converts, but the health
  check is not run on the new rows, and the card and stderr say why.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep.build_shards import build_shards
from data_prep.build_shards import main as build_main
from data_prep.train_tokenizer import train_tokenizer
from pipeline.eval.finetune import main as finetune_main
from pipeline.export.convert import main as convert_main
from pipeline.train.cli import main as train_main
from tests.faults.faults import copy_shards, error_line
from tests.fixtures_data import TINY_SEQ_LEN, TINY_SHARD_MB, TINY_VOCAB_SIZE, stdlib_documents, write_corpus
from tests.train.runs import run_inprocess, tag_dir

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")
OTHER_MODULES = ("json", "csv", "pathlib", "argparse", "logging", "subprocess", "collections", "functools")


@pytest.fixture()
def run(small_run):
    return small_run


@pytest.fixture()
def exported(small_export):
    return small_export


def _zero_to_fp32(run: Path, step: int, out: Path) -> Path:
    proc = subprocess.run([sys.executable, "zero_to_fp32.py", ".", str(out), "-t", tag_dir(run, step).name],
                          cwd=run / "checkpoints", env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _without_tokenizer(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    for name in TOKENIZER_FILES:
        (target / name).unlink(missing_ok=True)
    return target


def test_convert_refuses_the_weights_of_another_step(run, tmp_path, capsys):
    weights_2 = _zero_to_fp32(run, 2, tmp_path / "fp32_step2")
    capsys.readouterr()
    out = tmp_path / "hf"
    assert convert_main([str(tag_dir(run, 4)), str(out), "--weights", str(weights_2)]) == 2
    message = error_line(capsys.readouterr().err)
    assert re.fullmatch(
        rf"--weights {re.escape(str(weights_2))}: not the weights of step_00000004 \((\d+) of (\d+) tensors differ from "
        r"the checkpoint's own \(largest: \S+, max \|difference\| \S+\)\); pass zero_to_fp32.py's output for this tag "
        rf"\(python {re.escape(str(run / 'checkpoints' / 'zero_to_fp32.py'))} {re.escape(str(run / 'checkpoints'))} "
        r"OUT --tag step_00000004\), or convert without --weights", message), message
    assert not out.exists()
    assert convert_main([str(tag_dir(run, 2)), str(out), "--weights", str(weights_2)]) == 0  # its own tag: accepted
    assert "step_00000002" in (out / "README.md").read_text()


def test_convert_refuses_another_runs_tokenizer(run, tiny_tokenizer_dir, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "other.txt", stdlib_documents(OTHER_MODULES))
    other = train_tokenizer([corpus], tmp_path / "other_tokenizer", vocab_size=TINY_VOCAB_SIZE, progress=False)
    out = tmp_path / "hf"
    capsys.readouterr()
    assert convert_main([str(run), str(out), "--tokenizer", str(other)]) == 2
    message = error_line(capsys.readouterr().err)
    recorded = run.parent / "shards" / "tokenizer"
    assert re.fullmatch(rf"--tokenizer {re.escape(str(other))} is not the tokenizer the run trained with \(tokenizer_dir="
                        rf"{re.escape(str(recorded))}: vocabularies differ: \d+ vs \d+ entries, about \d+ token ids "
                        r"differ\); pass that one, or omit --tokenizer", message), message
    assert not out.exists()
    missing = _without_tokenizer(other, tmp_path / "no_tokenizer")
    assert convert_main([str(run), str(out), "--tokenizer", str(missing)]) == 2
    assert error_line(capsys.readouterr().err).startswith(f"--tokenizer {missing} has no tokenizer files (none of "
                                                           "tokenizer.json, vocab.txt, ")
    copy = Path(shutil.copytree(tiny_tokenizer_dir, tmp_path / "copy_of_the_runs_tokenizer"))
    assert convert_main([str(run), str(out), "--tokenizer", str(copy)]) == 0  # the same tokenizer elsewhere: fine


def test_build_shards_refuses_a_model_directory_without_its_tokenizer(exported, tiny_corpus_file, tmp_path, capsys):
    model_dir = _without_tokenizer(exported, tmp_path / "hf_without_tokenizer")
    out = tmp_path / "shards"
    assert build_main(["--input", str(tiny_corpus_file), "--tokenizer", str(model_dir), "--out", str(out),
                       "--seq-len", str(TINY_SEQ_LEN), "--num-proc", "1", "--no-progress"]) == 2
    message = error_line(capsys.readouterr().err)
    match = re.fullmatch(rf"--tokenizer {re.escape(str(model_dir))}: this tokenizer cannot represent the text: "
                         r"([\d.]+)% of the (\d+) tokens of the first (\d+) documents are the unknown token and its "
                         r"vocabulary has 5 entries \(limits: at most 25% unknown, at least 64 entries\); "
                         rf"{re.escape(str(model_dir))} has no tokenizer files \(none of .*\); a model directory "
                         r"without them loads only a placeholder of its special tokens; nothing was written", message)
    assert match, message
    assert float(match.group(1)) > 90
    assert not out.exists()  # not a single shard, not even the directory


def _task(directory: Path) -> Path:
    directory.mkdir()
    rows = [(f"the {word} module documents how to use it", str(i % 2))
            for i, word in enumerate(("json", "csv", "heapq", "bisect", "queue", "string", "textwrap", "fractions") * 4)]
    for name, part in (("train.tsv", rows[:24]), ("dev.tsv", rows[24:])):
        (directory / name).write_text("sentence\tlabel\n" + "".join(f"{s}\t{label}\n" for s, label in part))
    return directory


def test_finetune_refuses_a_model_without_its_tokenizer(exported, tmp_path, capsys):
    model_dir = _without_tokenizer(exported, tmp_path / "hf_without_tokenizer")
    output = tmp_path / "result.json"
    assert finetune_main(["--model", str(model_dir), "--task-dir", str(_task(tmp_path / "task")), "--epochs", "1",
                          "--output", str(output)]) == 2
    message = error_line(capsys.readouterr().err)
    match = re.fullmatch(rf"--model {re.escape(str(model_dir))}: this tokenizer cannot represent the text: ([\d.]+)% "
                         r"of the \d+ tokens of the first 24 training examples are the unknown token and its vocabulary "
                         rf"has 5 entries \(.*\); {re.escape(str(model_dir))} has no tokenizer files \(none of .*\); a model "
                         r"directory without them loads only a placeholder of its special tokens; nothing was trained",
                         message)
    assert match and float(match.group(1)) > 90, message
    assert not output.exists()


@pytest.mark.parametrize("text", ["", "0\n", "null\n", "- train\n- data\n"], ids=["empty", "zero", "null", "list"])
def test_an_empty_or_non_mapping_config_file_is_refused(text, tiny_shards_dir, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    out = tmp_path / "run"
    assert train_main(["--config", str(config), f"data.shards_dir={tiny_shards_dir}", f"train.output_dir={out}"]) == 2
    message = error_line(capsys.readouterr().err)
    if text.strip() in ("", "null"):
        assert message == (f"{config}: empty config (no settings); a config file is a mapping of sections, e.g. "
                           "`inherit: tiny-mlm` or `train: {total_steps: 100}`")
    else:
        assert message.startswith(f"{config}: expected a mapping of sections at the top level, got "), message
    assert not out.exists()


def test_convert_of_a_run_whose_shards_were_rebuilt_in_place_does_not_measure_them(tiny_shards_dir,
                                                                                  tiny_tokenizer_dir, tmp_path,
                                                                                  capsys):
    shards = copy_shards(tiny_shards_dir, tmp_path / "shards")
    run = tmp_path / "run"
    assert run_inprocess("tiny-mlm", shards, run, "train.total_steps=3", "train.checkpoint_every=3") == 0
    shutil.rmtree(shards)  # rebuilt in place, with other text and the same tokenizer
    corpus = write_corpus(tmp_path / "other.txt", stdlib_documents(OTHER_MODULES))
    build_shards([str(corpus)], tiny_tokenizer_dir, shards, seq_len=TINY_SEQ_LEN, shard_size_mb=TINY_SHARD_MB,
                 progress=False)
    capsys.readouterr()
    out = tmp_path / "hf"
    assert convert_main([str(run), str(out)]) == 0
    err = capsys.readouterr().err
    note = re.search(r"note: token-cosine health check not run \(shards at shards are not the data this checkpoint "
                     r"trained on \(manifest \w{12}, recorded at training \w{12}: rebuilt or replaced since\): pass "
                     r"--shards DIR of the run's data to measure\)", err)
    assert note, err
    assert "are not the data this checkpoint trained on" in (out / "README.md").read_text()
    assert "mean token cosine" in (out / "README.md").read_text()


def _renumbered(tokenizer_dir: Path, into: Path) -> Path:
    """The same tokenizer with two ordinary tokens' ids swapped: the same size, other ids."""
    import json

    copy = Path(shutil.copytree(tokenizer_dir, into))
    spec = json.loads((copy / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (copy / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return copy


def test_convert_refuses_shards_rebuilt_in_place_with_another_tokenizer(tiny_shards_dir, tiny_corpus_file,
                                                                        tiny_tokenizer_dir, tmp_path, capsys):
    """Issue 57: the export would carry the new tokenizer beside the old weights. The checkpoint records the
    fingerprint of the tokenizer it trained with (`tokenizer_hash`); conversion refuses another one, naming both
    fingerprints and paths, and accepts the run's own tokenizer given with --tokenizer."""
    import json

    from pipeline.io import hash_directory

    shards = copy_shards(tiny_shards_dir, tmp_path / "shards")
    run = tmp_path / "run"
    assert run_inprocess("tiny-mlm", shards, run, "train.total_steps=3", "train.checkpoint_every=3") == 0
    recorded = json.loads((tag_dir(run, 3) / "pipeline_meta.json").read_text())["tokenizer_hash"]
    assert recorded == hash_directory(shards / "tokenizer")
    other = _renumbered(tiny_tokenizer_dir, tmp_path / "renumbered")
    shutil.rmtree(shards)
    build_shards([str(tiny_corpus_file)], other, shards, seq_len=TINY_SEQ_LEN, shard_size_mb=TINY_SHARD_MB,
                 progress=False)
    current = hash_directory(shards / "tokenizer")
    capsys.readouterr()
    out = tmp_path / "hf"
    assert convert_main([str(run), str(out)]) == 2
    message = error_line(capsys.readouterr().err)
    assert message == (f"tokenizer_dir={shards / 'tokenizer'} is not the tokenizer this checkpoint was trained with: "
                       f"fingerprint {current[:16]} now, {recorded[:16]} recorded at training (pipeline_meta.json "
                       f"tokenizer_hash, of {(shards / 'tokenizer').resolve()}): the shards' tokenizer was rebuilt or "
                       "replaced since; pass the run's tokenizer with --tokenizer DIR"), message
    assert not out.exists()
    assert convert_main([str(run), str(out), "--tokenizer", str(other)]) == 2  # another dir with it: refused too
    assert "cannot be confirmed as the run's tokenizer" in error_line(capsys.readouterr().err)
    assert convert_main([str(run), str(out), "--tokenizer", str(tiny_tokenizer_dir)]) == 0  # the run's own files
