"""`pipeline.eval.finetune` options: a training subset, saved models, prediction files per split,
and the random-initialisation baseline. Run on the tiny Hugging Face BERT directory (fast)."""
from __future__ import annotations

import json
from argparse import Namespace

import numpy as np
import pytest
import torch

from pipeline.eval import glue
from pipeline.eval.finetune import _model, build_parser, main, predict, _encode
from tests.convert.test_finetune import write_keyword_task


def _unlabelled_test_file(task, n=6):
    lines = ["index\tsentence"] + [f"{100 + i}\tthe file is {'open' if i % 2 else 'closed'} now" for i in range(n)]
    (task / "test.tsv").write_text("\n".join(lines) + "\n")


def test_subset_predictions_saved_model_and_random_baseline(bert_dir, tmp_path, capsys):
    task = write_keyword_task(tmp_path / "task", n_train=120, n_dev=30)
    _unlabelled_test_file(task)
    output, saved = tmp_path / "results" / "kw.json", tmp_path / "saved"
    argv = ["--model", str(bert_dir), "--task-dir", str(task), "--seeds", "1", "--epochs", "1", "--batch-size", "16",
            "--max-length", "24", "--threads", "1", "--lr", "1e-3", "--train-subset", "40", "--eval-file", "test.tsv",
            "--save-model", str(saved), "--random-init", "--output", str(output), "--json"]
    assert main(argv) == 0
    result = json.loads(output.read_text())
    assert result == json.loads(capsys.readouterr().out)
    assert (result["n_train"], result["n_train_available"], result["train_subset"]) == (40, 120, 40)

    preds = tmp_path / "results" / "kw.predictions"
    expected = {str(preds / m / "seed_1" / f"{s}.tsv") for m in ("pretrained", "random_init") for s in ("dev", "test")}
    assert set(result["prediction_files"]) == expected
    dev_rows = (preds / "pretrained" / "seed_1" / "dev.tsv").read_text().splitlines()
    assert dev_rows[0] == "index\tprediction\tlabel" and len(dev_rows) == 31
    test_rows = (preds / "pretrained" / "seed_1" / "test.tsv").read_text().splitlines()
    assert test_rows[0] == "index\tprediction" and [r.split("\t")[0] for r in test_rows[1:]] == [
        str(100 + i) for i in range(6)]
    # the dev accuracy in the JSON is the accuracy of the written predictions
    pred, gold = zip(*(r.split("\t")[1:] for r in dev_rows[1:]))
    assert result["runs"][0]["metrics"]["accuracy"] == pytest.approx(np.mean(np.array(pred) == np.array(gold)))

    # the saved model is the fine-tuned one: it reproduces the written predictions
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(saved))
    tokenizer = AutoTokenizer.from_pretrained(str(saved))
    spec, _, dev = glue.resolve_task(task, "generic")
    again = predict(model, _encode(tokenizer, dev, 24), 16, tokenizer, False, "cpu")
    assert [spec.labels[int(i)] for i in again] == list(pred)

    baseline = result["random_init"]
    assert [r["seed"] for r in baseline["runs"]] == [1]
    assert result["pretraining_gain"]["accuracy"] == pytest.approx(
        result["mean"]["accuracy"] - baseline["mean"]["accuracy"])


def test_random_init_is_a_random_model_of_the_same_shape(bert_dir):
    args = Namespace(model=str(bert_dir))
    spec = glue.TaskSpec(("sentence",), "label", ("0", "1"), ("accuracy",))
    torch.manual_seed(0)
    pretrained, random = _model(args, spec, False), _model(args, spec, True)
    a, b = pretrained.state_dict(), random.state_dict()
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    key = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.allclose(a[key], b[key])
    assert abs(float(b[key].std()) - 0.02) < 0.005  # BERT's normal(0, initializer_range) initialisation


def test_train_subset_is_a_fixed_draw_in_file_order():
    split = glue.Split([(f"s{i}",) for i in range(50)], list(range(50)))
    a, b = glue.subset_split(split, 10, seed=3), glue.subset_split(split, 10, seed=3)
    assert a == b and a.labels == sorted(a.labels) and len(set(a.labels)) == 10
    assert glue.subset_split(split, 10, seed=4).labels != a.labels
    assert a.index == [str(i) for i in a.labels]  # predictions keep the original row numbers
    assert glue.subset_split(split, 80, seed=3) is split


def test_bad_options_fail_before_training(bert_dir, tmp_path, capsys):
    task = write_keyword_task(tmp_path / "task", n_train=8, n_dev=4)
    base = ["--model", str(bert_dir), "--task-dir", str(task)]
    assert main([*base, "--train-subset", "0"]) == 2
    assert "--train-subset must be positive" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    assert main([*base, "--save-model", str(tmp_path / "busy")]) == 2
    assert "--save-model" in capsys.readouterr().err and (tmp_path / "busy" / "keep.txt").exists()
    assert build_parser().parse_args([*base]).predictions is None


def test_max_length_defaults_to_the_model_positions_and_refuses_longer(bert_dir, tmp_path, capsys):
    """A model pretrained on short shards has few positions: the default length fits them, and an
    explicit longer `--max-length` is refused before any fine-tuning, naming the flag."""
    from pipeline.eval.finetune import DEFAULT_MAX_LENGTH, resolve_max_length

    positions = json.loads((bert_dir / "config.json").read_text())["max_position_embeddings"]
    assert resolve_max_length(None, bert_dir) == min(DEFAULT_MAX_LENGTH, positions)
    assert resolve_max_length(positions, bert_dir) == positions
    task = write_keyword_task(tmp_path / "task", n_train=20, n_dev=10)
    output = tmp_path / "out.json"
    argv = ["--model", str(bert_dir), "--task-dir", str(task), "--max-length", str(positions + 1), "--output", str(output)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--max-length {positions + 1}" in err and f"max_position_embeddings {positions}" in err
    assert not output.exists()
