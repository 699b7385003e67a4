"""Fixtures of the evaluation tests: a converted tiny model, an STS file of the test's own making, and a
second tokenizer (600 entries against the model's 800) to swap into a converted directory."""
from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest

from tests.fixtures_data import stdlib_documents
from tests.train.runs import run_inprocess

#: Files `cpt-convert` writes for the tokenizer (replaced together when a test swaps the tokenizer).
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@pytest.fixture(scope="session")
def sts_model(tmp_path_factory, tiny_shards_dir) -> Path:
    """A tiny TACO model (3 steps) converted with cpt-convert (mean pooling)."""
    from pipeline.export.convert import convert

    base = tmp_path_factory.mktemp("sts_model")
    assert run_inprocess("tiny-taco", tiny_shards_dir, base / "run", "train.total_steps=3",
                         "train.checkpoint_every=3") == 0
    return convert(base / "run", base / "hf")


@pytest.fixture(scope="session")
def other_tokenizer_dir(tmp_path_factory, tiny_corpus_file) -> Path:
    """A WordPiece tokenizer of the same corpus with 600 entries (the model's has 800)."""
    from data_prep.train_tokenizer import train_tokenizer

    return train_tokenizer([tiny_corpus_file], tmp_path_factory.mktemp("tokenizer600"), vocab_size=600,
                           progress=False)


def swap_tokenizer(model_dir: Path, tokenizer_dir: Path, into: Path) -> Path:
    """A copy of `model_dir` whose tokenizer files are those of `tokenizer_dir`."""
    shutil.copytree(model_dir, into)
    for name in TOKENIZER_NAMES:
        (into / name).unlink(missing_ok=True)
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, into / name)
    return into


def sentences(seed: int = 0, n: int = 400) -> list[str]:
    """Plain sentences of the tiny corpus's prose (what the tiny tokenizer was trained on)."""
    text = " ".join(stdlib_documents())
    found = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text)
             if 6 <= len(s.split()) <= 20 and "\n" not in s and "\t" not in s]
    return random.Random(seed).sample(found, n)


def write_sts(directory: Path, n_pairs: int = 60, seed: int = 0) -> Path:
    """`dev.tsv` and `test.tsv` in SentEval's STS-B layout: pairs of a sentence and a copy with some words
    dropped (score falls with the share dropped) or an unrelated sentence (score near 0), 3-decimal scores."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    pool = sentences(seed, 4 * n_pairs)
    for split in ("dev", "test"):
        lines = []
        for i in range(n_pairs):
            first = pool.pop()
            words = first.split()
            if rng.random() < 0.25:
                second, score = pool.pop(), rng.choice([0.0, 0.2, 0.4])
            else:
                keep = rng.uniform(0.3, 1.0)
                kept = [w for w in words if rng.random() < keep] or words[:1]
                drop = rng.randrange(len(words))  # never the sentence itself: equal embeddings tie (cosine 1)
                second = " ".join(kept if len(kept) < len(words) else words[:drop] + words[drop + 1:])
                score = round(5 * keep, 3)
            lines.append("\t".join(["main-captions", "test", "2012test", f"{i:04d}", f"{score:.3f}", first, second]))
        (directory / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return directory
