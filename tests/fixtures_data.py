"""Tiny real-text data for every test directory (re-exported by `tests/conftest.py`).

The corpus is English prose from the docstrings of Python standard-library modules (always
available offline, deterministic for a given Python version). The tokenizer and shards are built
with the real `data_prep` code, so every test that uses them also exercises the data path.

Fixtures (session-scoped): `tiny_corpus_file`, `tiny_tokenizer_dir` (WordPiece, 800 entries, ids renumbered
in a fixed order by `canonical_wordpiece_ids`, so every session tests on the same ids),
`tiny_shards_dir` (seq_len 64, several shards). Helper: `make_batch(shards_dir, views, ...)`.
"""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import torch

TINY_VOCAB_SIZE = 800
TINY_SEQ_LEN = 64
TINY_SHARD_MB = 0.02  # ~160 rows per shard: several shards, so resume and multi-shard reads are exercised
_DOC_MODULES = (
    "argparse", "bisect", "collections", "csv", "dataclasses", "datetime", "decimal", "difflib", "fractions",
    "functools", "heapq", "json", "logging", "pathlib", "queue", "random", "shutil", "statistics", "string",
    "tempfile", "textwrap", "threading", "zipfile",
)


def stdlib_documents(modules: tuple[str, ...] = _DOC_MODULES) -> list[str]:
    """One document per module: its docstring followed by its public members' docstrings."""
    documents = []
    for name in modules:
        module = importlib.import_module(name)
        parts = [inspect.getdoc(module) or ""]
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            doc = inspect.getdoc(getattr(module, attr, None))
            if doc and getattr(getattr(module, attr, None), "__module__", name) == name:
                parts.append(doc)
        text = "\n".join(p.replace("\n\n", "\n") for p in parts if p.strip())
        documents.append(text)
    return documents


def write_corpus(path: Path, documents: list[str]) -> Path:
    """A .txt corpus, documents separated by blank lines (the builder's default)."""
    path.write_text("\n\n".join(d.strip() for d in documents) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "stdlib_docs.txt", stdlib_documents())


def canonical_wordpiece_ids(tokenizer_dir: Path) -> Path:
    """Renumber a trained WordPiece vocabulary in a fixed order: the special tokens keep their ids, the others
    follow sorted by (length without `##`, continuation or not, text). `tokenizers`' WordPiece trainer numbers
    the `##` tokens in hash-map order (huggingface/tokenizers#1794, docs/data.md), so the same corpus gives the
    same tokens under other ids in every session, and with them other test data; WordPiece looks tokens up by
    text, so the renumbering changes no tokenization. Refuses a vocabulary whose special tokens are not 0..n-1."""
    import json

    path = tokenizer_dir / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    vocab: dict[str, int] = spec["model"]["vocab"]
    specials = sorted((t["id"], t["content"]) for t in spec["added_tokens"])
    assert [i for i, _ in specials] == list(range(len(specials))), f"{path}: special tokens at ids {specials}"
    fixed = {content for _, content in specials}
    rest = sorted((t for t in vocab if t not in fixed),
                  key=lambda t: (len(t.removeprefix("##")), t.startswith("##"), t))
    spec["model"]["vocab"] = {**{c: i for i, c in specials}, **{t: len(specials) + i for i, t in enumerate(rest)}}
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return tokenizer_dir


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, tiny_corpus_file: Path) -> Path:
    from data_prep.train_tokenizer import train_tokenizer

    trained = train_tokenizer([tiny_corpus_file], tmp_path_factory.mktemp("tokenizer"), vocab_size=TINY_VOCAB_SIZE,
                              progress=False)
    return canonical_wordpiece_ids(trained)


@pytest.fixture(scope="session")
def tiny_shards_dir(tmp_path_factory: pytest.TempPathFactory, tiny_corpus_file: Path, tiny_tokenizer_dir: Path) -> Path:
    from data_prep.build_shards import build_shards

    out = tmp_path_factory.mktemp("shards") / "tiny"
    build_shards([tiny_corpus_file], tiny_tokenizer_dir, out, seq_len=TINY_SEQ_LEN, shard_size_mb=TINY_SHARD_MB, num_proc=1, progress=False)
    return out


def make_batch(
    shards_dir: Path,
    views: tuple[str, ...] | list[str] = ("masked",),
    batch_size: int = 8,
    seed: int = 0,
    first_sample: int = 0,
    **collator_options,
) -> dict[str, torch.Tensor]:
    """A collated batch of `batch_size` consecutive stream samples with the requested views."""
    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.config import BatchPlan
    from pipeline.data.reader import PretrainBatches, ShardDataset

    dataset = ShardDataset(shards_dir)
    collator = CorruptionCollator(views, dataset.special_tokens, dataset.vocab_size, seed, **collator_options)
    reader = PretrainBatches(dataset, collator, BatchPlan(batch_size, 1, 1), 0, seed)
    return reader.micro_batch(first_sample, 0)
