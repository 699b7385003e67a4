"""Trained tiny checkpoints shared by the conversion tests (built once per session, on demand).

Each run trains 3 steps with `pipeline.train` on the tiny shards, then restores the checkpoint
into a fresh DeepSpeed engine and records that training model's own outputs on a probe batch
(`train_worker.py`). Two-rank runs are the expensive part, so each ZeRO stage gets one, and the
objectives are spread over them (every registered objective trains under two ranks):

    zero1, 2 ranks: mlm + taco + infoword      zero2, 2 ranks: mlm + capt + mlm-nce
    zero3, 2 ranks: cocolm (generator, copy and SCL heads)
    zero3, 1 rank: mlm-nce alone (the MLM head trained only with sampled negatives: conversion
                   corrects its bias by log q, a persistent buffer consolidated from ZeRO-3)
    no ZeRO (stage 0), 1 rank: mlm (single process, weights read from the one model file; this
                               run also feeds the error, HF-usage and fine-tuning tests)
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("train_worker.py")


@dataclass(frozen=True)
class RunSpec:
    preset: str
    zero_stage: int
    ranks: int
    objectives: str = ""  # a YAML mapping overriding the preset's objectives

    @property
    def overrides(self) -> list[str]:
        engine = ["deepspeed.config=zero1", "deepspeed.extra={zero_optimization: {stage: 0}}"] if self.zero_stage == 0 \
            else [f"deepspeed.config=zero{self.zero_stage}"]
        extra = [f"objectives={self.objectives}"] if self.objectives else []
        return [*engine, "train.total_steps=3", "train.tensorboard=false", *extra]


RUNS: dict[str, RunSpec] = {
    "zero1-2ranks-mlm-taco-infoword": RunSpec("tiny-taco", 1, 2, "{mlm: 1.0, taco: 1.0, infoword: 1.0}"),
    "zero2-2ranks-mlm-capt-mlmnce": RunSpec("tiny-capt", 2, 2, "{mlm: 1.0, capt: 1.0, mlm-nce: 1.0}"),
    "zero3-2ranks-cocolm": RunSpec("tiny-cocolm", 3, 2),
    "zero3-1rank-mlmnce": RunSpec("tiny-mlm-nce", 3, 1),
    "zero0-1rank-mlm": RunSpec("tiny-mlm", 0, 1),
}


@dataclass
class TrainedRun:
    name: str
    spec: RunSpec
    output_dir: Path
    reference: dict

    @property
    def checkpoints(self) -> Path:
        return self.output_dir / "checkpoints"

    @property
    def tag_dir(self) -> Path:
        return Path(self.reference["tag_dir"])


def _train(name: str, spec: RunSpec, shards_dir: Path, base: Path) -> TrainedRun:
    output_dir = base / name
    reference_file = base / f"{name}.reference.pt"
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec.ranks}"]
        if spec.ranks > 1
        else [sys.executable]
    )
    cmd = [*launcher, str(WORKER), str(reference_file), spec.preset, f"data.shards_dir={shards_dir}",
           f"train.output_dir={output_dir}", *spec.overrides]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(
            f"training run {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return TrainedRun(name, spec, output_dir, torch.load(reference_file, weights_only=False))


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory: pytest.TempPathFactory, tiny_shards_dir: Path):
    """`trained_runs(name) -> TrainedRun`, training each named run at most once per session."""
    base = tmp_path_factory.mktemp("convert_runs")
    cache: dict[str, TrainedRun] = {}

    def get(name: str) -> TrainedRun:
        if name not in cache:
            cache[name] = _train(name, RUNS[name], tiny_shards_dir, base)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory, trained_runs):
    """`converted(name) -> Path`: the run's latest checkpoint converted once (COCO-LM with its generator)."""
    from pipeline.export.convert import convert

    base = tmp_path_factory.mktemp("converted")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            run = trained_runs(name)
            cache[name] = convert(run.checkpoints, base / name, with_generator="cocolm" in name)
        return cache[name]

    return get


@pytest.fixture()
def checkpoint_copy(tmp_path: Path, trained_runs):
    """A private copy of a run's checkpoints dir (tests may corrupt it)."""

    def copy(name: str) -> Path:
        src = trained_runs(name).checkpoints
        dst = tmp_path / "checkpoints"
        shutil.copytree(src, dst)
        return dst

    return copy


# ---- warm start: a tiny Hugging Face BERT directory and shards built with its tokenizer ----------

TINY_BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                 max_position_embeddings=64, hidden_act="gelu", type_vocab_size=2)


def save_tiny_bert(directory: Path, tokenizer_dir: Path, seed: int = 7, model_cls: str = "BertForMaskedLM",
                   **config) -> Path:
    """A random tiny BERT (`model_cls`) saved with `save_pretrained`, plus the tokenizer of `tokenizer_dir`.

    Every tensor is perturbed away from its initial value (LayerNorm 1/0, zero biases), so a test
    that compares weights cannot pass because both sides happen to start at the same constant."""
    import transformers
    from transformers import AutoTokenizer, BertConfig

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    bert_config = BertConfig(**{**TINY_BERT, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                                **config})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(bert_config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A tiny `BertForMaskedLM` directory (config.json, model.safetensors, tokenizer) to warm-start from."""
    return save_tiny_bert(tmp_path_factory.mktemp("hf") / "tiny-bert", tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def bert_shards(tmp_path_factory: pytest.TempPathFactory, tiny_corpus_file: Path, bert_dir: Path) -> Path:
    """Shards built with the base model's own tokenizer (`build_shards --tokenizer bert_dir`)."""
    from data_prep.build_shards import build_shards

    from tests.fixtures_data import TINY_SEQ_LEN, TINY_SHARD_MB

    out = tmp_path_factory.mktemp("bert_shards") / "shards"
    build_shards([tiny_corpus_file], bert_dir, out, seq_len=TINY_SEQ_LEN, shard_size_mb=TINY_SHARD_MB, num_proc=1,
                 progress=False)
    return out
