"""The front door: `python -m demo.run` end to end (a few steps), and its output-dir safety."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from demo.run import SUMMARY_FILE, main, prepare_out_dir

REPO = Path(__file__).resolve().parents[2]


def test_out_dir_is_cleared_only_when_it_is_the_demos(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(FileExistsError, match="not a previous demo output"):
        prepare_out_dir(foreign)
    assert (foreign / "thesis.tex").read_text() == "precious"
    previous = tmp_path / "demo"
    (previous / "shards").mkdir(parents=True)
    (previous / SUMMARY_FILE).write_text("{}")
    (previous / "notes.txt").write_text("kept: not one of the demo's entries")
    prepare_out_dir(previous)
    assert sorted(p.name for p in previous.iterdir()) == [SUMMARY_FILE, "notes.txt"]
    assert json.loads((previous / SUMMARY_FILE).read_text()) == {"status": "running"}
    fresh = tmp_path / "new" / "out"
    prepare_out_dir(fresh)
    assert (fresh / SUMMARY_FILE).is_file()


def test_bad_arguments_fail_before_any_work(tmp_path: Path, capsys) -> None:
    assert main(["--objective", "nope", "--out", str(tmp_path / "o")]) == 2
    assert "--objective 'nope'" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert main(["--prompt", "no mask here", "--out", str(tmp_path / "o")]) == 2
    assert "must contain [MASK]" in capsys.readouterr().err
    assert main(["--steps", "0", "--out", str(tmp_path / "o")]) == 2


@pytest.mark.timeout(180)
def test_demo_runs_every_stage_and_prints_a_fill_mask(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(REPO)  # the training child process imports `pipeline` from the checkout
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    corpus = tmp_path / "texts"
    corpus.mkdir()
    for doc in range(40):  # 40 documents (files) of ~6 KB: one in ten held out, >= 20 KB of it
        (corpus / f"{doc:02d}.txt").write_text("\n\n".join(
            f"The river number {doc * 100 + i} flows past the old mill and the quiet village near the hills."
            for i in range(70)))
    out = tmp_path / "demo"
    code = main(["--objective", "mlm", "--corpus", str(corpus), "--out", str(out), "--steps", "2",
                 "--vocab-size", "200", "--seq-len", "32", "--prompt", "The river flows past the [MASK] mill."])
    printed = capsys.readouterr().out
    assert code == 0, printed
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["status"] == "done"
    assert list(summary["stage_seconds"]) == ["corpus", "tokenizer", "shards", "pretrain", "convert", "fill_mask",
                                               "outcome"]
    held = summary["corpus"]["heldout"]  # by document, build_shards' holdout (data_prep.holdout)
    assert summary["corpus"]["documents"] == 40 and 0 < held["documents"] < 40 and held["sequences"] >= 32
    assert held["path"] == str(out / "shards" / "validation")
    assert "held out" in printed and "Trained on" in printed
    # the held-out numbers are validation's (one home): eval.* set on the run, its last val/ record reported
    assert any(o.startswith("eval.shards_dir=") for o in summary["training"]["overrides"])
    val = summary["final_validation"]
    assert val["step"] == 2 and summary["outcome"]["validation_step"] == 2
    assert summary["outcome"]["trained"]["mlm_acc"] == val["val/mlm_head/accuracy"]
    assert summary["outcome"]["trained"]["unigram_acc"] == val["val/health/unigram_accuracy"]
    init = summary["outcome"]["random_init"]
    assert 0 <= init["mlm_acc"] <= 1 and init["mlm_loss"] > 0 and init["mlm_loss"] != val["val/mlm_head/loss"]
    assert (out / "outcome.json").is_file()
    # the outcome measures what --objective mlm trains (issue 58: it printed a TACO loss), never TACO's probes
    assert "TACO" not in printed and "taco_loss" not in summary["outcome"]["trained"]
    signals = {s["term"]: s for s in summary["outcome"]["objective_signals"]}
    assert set(signals) == {"val/mlm/accuracy", "val/mlm/loss"}
    assert signals["val/mlm/loss"]["trained"] == val["val/mlm/loss"] and signals["val/mlm/loss"]["random_init"] > 0
    assert "  mlm signal  val/mlm/loss " in printed
    assert "validation at step 2" in printed
    assert "starting: imports, config and data checks" in printed  # the op-build note before the quiet start
    predictions = summary["fill_mask"][0]["predictions"]
    assert len(predictions) == 5 and all(0 <= p["score"] <= 1 for p in predictions)
    assert summary["final_metrics"]["step"] == 2
    assert (out / "hf" / "mlm" / "config.json").is_file() and (out / "runs" / "mlm" / "metrics.jsonl").is_file()
    assert "The river flows past the [MASK] mill." in printed and "Hugging Face model" in printed
    assert "python -m pipeline.train --config tiny-mlm" in printed  # the equivalent command is shown


def test_a_default_corpus_too_small_to_hold_out_is_an_error_before_training(tmp_path: Path, capsys) -> None:
    out = tmp_path / "demo"
    assert main(["--max-corpus-mb", "0.05", "--out", str(out)]) == 2  # 50 KB: 5 KB would be held out
    err = capsys.readouterr().err
    assert "too small" in err and "--corpus PATH" in err and "--max-corpus-mb" in err
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["status"] == "failed" and summary["stage"] == "shards" and "too small" in summary["error"]
    assert not (out / "runs").exists()  # no training


def test_a_user_corpus_too_small_to_hold_out_is_trained_on_whole(tmp_path: Path, tiny_tokenizer_dir) -> None:
    import argparse

    from data_prep.holdout import DEFAULT_SUBDIR
    from demo.run import build_demo_shards

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"The river number {i} flows past the old mill near the hills." for i in range(20)))
    args = argparse.Namespace(seq_len=32, corpus=[str(corpus)], max_corpus_mb=4.0)
    manifest, held = build_demo_shards(corpus, tiny_tokenizer_dir, tmp_path / "shards", args, num_proc=1)
    assert held is None and not (tmp_path / "shards" / DEFAULT_SUBDIR).exists()  # no validation, all trained on
    assert manifest.stats["documents"] == 20
    one = tmp_path / "one.txt"  # a single document the rule does not hold out: no validation set at all
    one.write_text("The river flows past the old mill near the hills, and the mill grinds the grain. " * 4)
    manifest, held = build_demo_shards(one, tiny_tokenizer_dir, tmp_path / "shards1", args, num_proc=1)
    assert held is None and manifest.stats["documents"] == 1
    args.corpus = []  # the installation's documentation that small: an error naming --corpus
    with pytest.raises(ValueError, match="too small.*--corpus PATH"):
        build_demo_shards(corpus, tiny_tokenizer_dir, tmp_path / "shards2", args, num_proc=1)


@pytest.mark.timeout(240)
def test_demo_with_electra_fills_masks_with_its_generator(tmp_path: Path, monkeypatch, capsys) -> None:
    """`--objective electra`: the export is the discriminator (`ElectraForPreTraining`) with the generator beside
    it; fill-mask and the outcome's masked-LM numbers are the generator's (the discriminator has no masked LM)."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    corpus = tmp_path / "texts"
    corpus.mkdir()
    for doc in range(40):
        (corpus / f"{doc:02d}.txt").write_text("\n\n".join(
            f"The river number {doc * 100 + i} flows past the old mill and the quiet village near the hills."
            for i in range(70)))
    out = tmp_path / "demo"
    code = main(["--objective", "electra", "--corpus", str(corpus), "--out", str(out), "--steps", "2",
                 "--vocab-size", "200", "--seq-len", "32", "--prompt", "The river flows past the [MASK] mill."])
    printed = capsys.readouterr().out
    assert code == 0, printed
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["status"] == "done" and "python -m pipeline.train --config tiny-electra" in printed
    config = json.loads((out / "hf" / "electra" / "config.json").read_text())
    assert config["architectures"] == ["ElectraForPreTraining"]
    assert json.loads((out / "hf" / "electra" / "generator" / "config.json").read_text())["architectures"] == [
        "ElectraForMaskedLM"]
    assert len(summary["fill_mask"][0]["predictions"]) == 5
    assert summary["outcome"]["trained"]["mlm_acc"] == summary["final_validation"]["val/electra/gen_accuracy"]
