"""A two-source mixture (`data.sources`) through the training loop: the per-source counters are logged
every step and match the mixture's shares, and a run killed with SIGKILL resumes bitwise (every
logged metric, per-source counters included), like `test_preemption.test_kill_9_then_resume`.

The sources are real shards (`data_prep.build_shards`, the tiny tokenizer): `wiki` from most of the
tiny corpus's modules, `books` from one small module only, so the 24-step run re-reads `books` (its default
`on_exhausted: repeat`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures_data import TINY_SEQ_LEN, stdlib_documents, write_corpus
from tests.train.runs import (kill_after_a_checkpoint, latest, losses, metric_rows, run_inprocess, start_subprocess,
                              tag_dir)

STEPS = ["train.total_steps=24", "train.checkpoint_every=4"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> tuple[Path, Path]:
    from data_prep.build_shards import build_shards

    root = tmp_path_factory.mktemp("mixture")
    built = []
    for name, modules in (("wiki", ("argparse", "collections", "csv", "dataclasses", "datetime", "decimal", "json",
                                    "logging", "pathlib", "random")), ("books", ("queue",))):
        corpus = write_corpus(root / f"{name}.txt", stdlib_documents(modules))
        build_shards([corpus], tiny_tokenizer_dir, root / name, seq_len=TINY_SEQ_LEN, shard_size_mb=0.02, num_proc=1,
                     progress=False)
        built.append(root / name)
    return built[0], built[1]


def mixture_overrides(wiki: Path, books: Path) -> list[str]:
    # runs.overrides sets data.shards_dir first: cleared here, as a mixture names no single directory
    return ["data.shards_dir=", f"data.sources=[{{path: {wiki}, weight: 0.75}}, {{path: {books}, weight: 0.25}}]",
            "data.mixture_block=64"]


def test_mixture_logs_each_source_and_resumes_bitwise_after_kill_9(sources, tmp_path: Path) -> None:
    from pipeline.data.shards import read_manifest

    wiki, books = sources
    extra = [*STEPS, *mixture_overrides(wiki, books)]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    assert run_inprocess("tiny-mlm", Path(""), reference, *extra) == 0
    rows = metric_rows(reference)
    assert sorted(rows) == list(range(1, 25))
    last = rows[24]
    assert last["data/wiki/samples"] + last["data/books/samples"] == last["consumed_samples"] == 24 * 8
    assert last["data/books/samples"] == 24 * 8 * 16 // 64  # 16 of every 64 positions: exact at a block boundary
    assert last["data/books/samples"] > read_manifest(books).total_sequences  # books was re-read (a second pass)
    assert last["data/wiki/tokens"] + last["data/books/tokens"] == last["tokens_seen"]  # no crop in tiny-mlm
    assert all(rows[s]["data/books/tokens"] <= rows[s + 1]["data/books/tokens"] for s in range(1, 24))

    proc = start_subprocess("tiny-mlm", Path(""), killed, *extra)
    saved = kill_after_a_checkpoint(killed, 6, proc)  # SIGKILL: no handler runs, no checkpoint is written
    assert latest(killed) == tag_dir(killed, saved) and max(losses(killed)) > saved  # steps to redo
    assert run_inprocess("tiny-mlm", Path(""), killed, *extra) == 0  # resume="auto"
    assert metric_rows(killed) == rows


def test_a_resume_with_other_weights_is_a_config_change(sources, tmp_path: Path, capsys) -> None:
    from pipeline.train.cli import EXIT_CONFIG_ERROR

    wiki, books = sources
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", Path(""), out, "train.total_steps=3", "train.checkpoint_every=3",
                         *mixture_overrides(wiki, books)) == 0
    changed = ["data.shards_dir=", f"data.sources=[{{path: {wiki}, weight: 0.5}}, {{path: {books}, weight: 0.5}}]",
               "data.mixture_block=64"]
    capsys.readouterr()
    assert run_inprocess("tiny-mlm", Path(""), out, "train.total_steps=6", "train.checkpoint_every=3",
                         *changed) == EXIT_CONFIG_ERROR
    assert "data.sources" in capsys.readouterr().err


def test_extending_a_run_keeps_weights_but_refuses_moved_token_budgets(sources, tmp_path: Path) -> None:
    """`cpt-train --resume RUN train.total_steps=N`: a weighted mixture keeps its interleave (same data
    hash), a token budget's share would move with the run's length: refused, naming why."""
    from pipeline.config.checks import ConfigError
    from pipeline.data.shards import read_manifest
    from pipeline.train.checkpoint.resume_run import load_resumed_config

    wiki, books = sources
    weighted, budgeted = tmp_path / "weighted", tmp_path / "budgeted"
    steps = ["train.total_steps=3", "train.checkpoint_every=3"]
    assert run_inprocess("tiny-mlm", Path(""), weighted, *steps, *mixture_overrides(wiki, books)) == 0
    cfg, _ = load_resumed_config(weighted, ["train.total_steps=6"])
    assert cfg.train.total_steps == 6 and cfg.data.sources[1]["weight"] == 0.25
    budget = read_manifest(books).total_tokens // 2
    assert run_inprocess("tiny-mlm", Path(""), budgeted, *steps, "data.shards_dir=", "data.mixture_block=64",
                         f"data.sources=[{{path: {wiki}, weight: 1}}, {{path: {books}, tokens: {budget}}}]") == 0
    with pytest.raises(ConfigError, match=r"--resume: the data.sources mixture changed since the checkpoint .*a "
                                          r"data.sources\[i\].tokens budget is a share of train.total_steps"):
        load_resumed_config(budgeted, ["train.total_steps=6"])
    cfg, _ = load_resumed_config(budgeted, ["train.total_steps=6", "train.allow_config_change=true"])
    assert cfg.train.total_steps == 6

