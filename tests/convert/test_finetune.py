"""Fine-tuning a converted model on a task the test generates: accuracy far above chance."""
from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest
from scipy.stats import t as scipy_t

from pipeline.eval.finetune import main

pytestmark = pytest.mark.slow
WORDS = ("return", "the", "list", "value", "object", "string", "number", "function", "data", "time", "name",
         "new", "with", "from", "each", "item", "when", "default")
KEYWORD = "file"


def write_keyword_task(directory: Path, n_train: int = 320, n_dev: int = 160, seed: int = 0) -> Path:
    """Single-sentence binary task: label 1 iff the sentence contains KEYWORD (balanced)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("dev", n_dev)):
        lines = ["sentence\tlabel"]
        for i in range(n):
            words = [rng.choice(WORDS) for _ in range(rng.randint(6, 12))]
            label = i % 2
            if label:
                words[rng.randrange(len(words))] = KEYWORD
            lines.append(f"{' '.join(words)}\t{label}")
        (directory / f"{name}.tsv").write_text("\n".join(lines) + "\n")
    return directory


def test_keyword_task_accuracy_well_above_chance(converted, tmp_path, capsys):
    model_dir = converted("zero0-1rank-mlm")
    task = write_keyword_task(tmp_path / "keyword")
    output = tmp_path / "results" / "keyword.json"
    argv = ["--model", str(model_dir), "--task-dir", str(task), "--seeds", "1", "2", "--lr", "1e-3",
            "--epochs", "4", "--batch-size", "16", "--max-length", "32", "--threads", "1", "--output", str(output),
            "--json"]
    capsys.readouterr()  # what building the converted run printed (DeepSpeed's first import, alone in a process)
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    result = json.loads(output.read_text())
    assert printed == result
    assert result["problem"] == "classification" and result["metric"] == "accuracy"
    assert result["text_cols"] == ["sentence"] and result["n_train"] == 320 and result["n_dev"] == 160
    accuracies = [r["metrics"]["accuracy"] for r in result["runs"]]
    assert [r["seed"] for r in result["runs"]] == [1, 2]
    assert min(accuracies) >= 0.85, accuracies  # chance is 0.5 (balanced labels)
    assert result["mean"]["accuracy"] == pytest.approx(statistics.fmean(accuracies))
    assert result["std"]["accuracy"] == pytest.approx(statistics.stdev(accuracies))
    # the 95% interval over the two seeds: mean +- t(0.975, 1) s / sqrt(2), t from scipy
    half = scipy_t.ppf(0.975, 1) * statistics.stdev(accuracies) / 2 ** 0.5
    assert result["confidence"] == 0.95
    assert result["interval"]["accuracy"] == pytest.approx([statistics.fmean(accuracies) - half,
                                                            statistics.fmean(accuracies) + half])
    assert set(result["mean"]) == {"accuracy", "f1", "matthews"}


def test_regression_task_reports_correlations(converted, tmp_path, capsys):
    """Sentence-pair regression (STS-B layout): the target is how many KEYWORDs the pair holds."""
    rng = random.Random(1)
    task = tmp_path / "pairs"
    task.mkdir()
    for name, n in (("train", 240), ("dev", 80)):
        lines = ["index\tsentence1\tsentence2\tscore"]
        for i in range(n):
            a, b = ([rng.choice(WORDS) for _ in range(6)] for _ in range(2))
            k = rng.randint(0, 2)
            for words in (a, b)[:k]:
                words[rng.randrange(6)] = KEYWORD
            lines.append(f"{i}\t{' '.join(a)}\t{' '.join(b)}\t{k * 2.5}")
        (task / f"{name}.tsv").write_text("\n".join(lines) + "\n")
    argv = ["--model", str(converted("zero0-1rank-mlm")), "--task-dir", str(task), "--task", "stsb",
            "--seeds", "3", "--lr", "1e-3", "--epochs", "8", "--batch-size", "16", "--max-length", "32",
            "--threads", "1", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["problem"] == "regression" and result["metric"] == "pearson"
    assert result["runs"][0]["metrics"]["pearson"] > 0.7 and result["runs"][0]["metrics"]["spearman"] > 0.7
    # one seed has no spread: null with the reason, never 0
    assert result["std"] == {"pearson": None, "spearman": None} and "one seed" in result["undefined"]["std"]
    assert result["interval"] == {"pearson": None, "spearman": None} and "one seed" in result["undefined"]["interval"]


def test_bad_arguments_are_named(tmp_path, capsys):
    task = write_keyword_task(tmp_path / "task", n_train=8, n_dev=4)
    assert main(["--model", str(tmp_path / "nomodel"), "--task-dir", str(task)]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["--model", str(tmp_path), "--task-dir", str(task), "--lr", "0"]) == 2
    assert "--lr must be positive" in capsys.readouterr().err


def test_an_undefined_metric_is_null_with_its_reason(converted, tmp_path, capsys):
    """Issue 57: a one-pair STS-B dev set (no correlation exists) reported Pearson and Spearman 0.0, and a
    pretraining gain of 0.0 from them. Now null, with `undefined` saying why, for each seed, the mean and the gain."""
    task = tmp_path / "sts1"
    task.mkdir()
    rng = random.Random(2)
    for name, n in (("train", 16), ("dev", 1)):
        lines = ["index\tsentence1\tsentence2\tscore"]
        lines += [f"{i}\t{' '.join(rng.choice(WORDS) for _ in range(5))}\t{' '.join(rng.choice(WORDS) for _ in range(5))}"
                  f"\t{rng.choice([0.5, 2.5, 4.5])}" for i in range(n)]
        (task / f"{name}.tsv").write_text("\n".join(lines) + "\n")
    argv = ["--model", str(converted("zero0-1rank-mlm")), "--task-dir", str(task), "--task", "stsb", "--seeds", "1",
            "2", "--epochs", "1", "--batch-size", "8", "--max-length", "16", "--threads", "1", "--random-init", "--json"]
    capsys.readouterr()
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    for run in result["runs"] + result["random_init"]["runs"]:
        assert run["metrics"] == {"pearson": None, "spearman": None}
        assert run["undefined"]["pearson"] == "1 pair: a correlation needs at least 2"
    assert result["mean"] == {"pearson": None, "spearman": None} and result["std"] == result["mean"]
    assert result["undefined"]["pearson"].startswith("undefined on seed(s) 1, 2")
    assert result["pretraining_gain"] == {"pearson": None, "spearman": None}
    assert result["pretraining_gain_interval"] == result["interval"] == {"pearson": None, "spearman": None}
