"""Synthetic shards for throughput measurements where no tokenized corpus is at hand (e.g. a bare GPU node).

Throughput does not depend on *which* token ids a batch holds, only on its shape: vocabulary size
(the MLM head), sequence length, padding, and how many word starts there are (whole-word and
InfoWord's n-gram span masking count words). So the rows written here are full-length
`[CLS] ids... [SEP]` sequences (no padding, like `packing=full` shards of a large corpus) with ids
drawn uniformly from the non-special range and word starts with probability `word_start_prob`
(0.75 ~ 1.3 WordPiece tokens per English word). They are written with the real shard writer and
manifest (`pipeline.data.shards`), so the training path reads them exactly as it reads real data.

`write_packed_shards` writes the other layout a corpus gives: documents of random (log-normal)
length packed by the project's own packer (`data_prep.packing.Packer`, `doc` mode: each document
starts a row, its last piece is padded), so rows end padded where documents end and the encoder
runs unpadded (varlen) attention on them; the manifest counts the padding (`stats.padding_tokens`).

They are for speed only: nothing learned from them means anything, and the manifest says so
(`sources: [{"path": "synthetic", ...}]`, `tokenizer_hash: "synthetic"`, no `tokenizer/`).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from pipeline.data.shards import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    Manifest,
    id_dtype_for,
    read_manifest,
    shard_name,
    write_shard,
)
from pipeline.io import write_atomic

#: Special-token ids of the synthetic vocabulary (BERT WordPiece order, as data_prep writes them).
SPECIAL_TOKENS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def write_synthetic_shards(
    out: str | os.PathLike,
    vocab_size: int,
    seq_len: int,
    rows: int = 4096,
    word_start_prob: float = 0.75,
    seed: int = 0,
    rows_per_shard: int = 2048,
) -> Manifest:
    """Write (or reuse, when an identical build exists) a synthetic shard directory; returns its manifest."""
    _check(vocab_size, seq_len, rows)
    build_args = {"synthetic": True, "vocab_size": vocab_size, "seq_len": seq_len, "rows": rows,
                  "word_start_prob": word_start_prob, "seed": seed, "rows_per_shard": rows_per_shard}
    out = Path(out)
    existing = _reusable(out, build_args)
    if existing is not None:
        return existing
    rng = np.random.default_rng(seed)
    dtype = id_dtype_for(vocab_size)
    infos = []
    for index, start in enumerate(range(0, rows, rows_per_shard)):
        n = min(rows_per_shard, rows - start)
        ids = rng.integers(len(SPECIAL_TOKENS), vocab_size, size=(n, seq_len)).astype(dtype)
        ids[:, 0], ids[:, -1] = SPECIAL_TOKENS["cls"], SPECIAL_TOKENS["sep"]
        starts = (rng.random((n, seq_len)) < word_start_prob).astype(np.uint8)
        starts[:, 0] = starts[:, -1] = 0  # special tokens are not words
        starts[:, 1] = 1
        infos.append(write_shard(out / shard_name(index), ids, starts, np.full(n, seq_len, dtype=np.int32)))
    return _write_manifest(out, seq_len, vocab_size, infos, rows, rows, build_args, "full", padding=0)


def write_packed_shards(
    out: str | os.PathLike,
    vocab_size: int,
    seq_len: int,
    rows: int = 4096,
    median: float = 0.5,
    sigma: float = 1.0,
    word_start_prob: float = 0.75,
    seed: int = 0,
    rows_per_shard: int = 2048,
) -> Manifest:
    """Documents of log-normal length (median `median` x seq_len tokens, shape `sigma`, at least 1)
    packed in `doc` mode into `rows` rows (`data_prep.packing.Packer`), written with the real shard
    writer; reused when an identical build exists. Returns the manifest (`stats.padding_tokens`)."""
    from data_prep.packing import Packer

    _check(vocab_size, seq_len, rows)
    if not (median > 0 and sigma >= 0):
        raise ValueError(f"median {median} (> 0) and sigma {sigma} (>= 0) required")
    build_args = {"synthetic": True, "packing": "doc", "vocab_size": vocab_size, "seq_len": seq_len, "rows": rows,
                  "median": median, "sigma": sigma, "word_start_prob": word_start_prob, "seed": seed,
                  "rows_per_shard": rows_per_shard}
    out = Path(out)
    existing = _reusable(out, build_args)
    if existing is not None:
        return existing
    rng = np.random.default_rng(seed)
    dtype = id_dtype_for(vocab_size)
    packer = Packer(seq_len, SPECIAL_TOKENS["cls"], SPECIAL_TOKENS["sep"], SPECIAL_TOKENS["pad"], mode="doc")
    ids, starts, lengths, documents = [], [], [], 0
    while len(ids) < rows:
        n = max(1, int(rng.lognormal(np.log(median * seq_len), sigma)))
        doc_starts = (rng.random(n) < word_start_prob).astype(np.uint8)
        doc_starts[0] = 1
        packer.add_document(rng.integers(len(SPECIAL_TOKENS), vocab_size, size=n), doc_starts)
        documents += 1
        for row_ids, row_starts, length in packer.ready():
            ids.append(row_ids)
            starts.append(row_starts)
            lengths.append(length)
    ids_a, starts_a = np.stack(ids[:rows]).astype(dtype), np.stack(starts[:rows])
    lengths_a = np.asarray(lengths[:rows], dtype=np.int32)
    infos = [write_shard(out / shard_name(index), ids_a[start:start + rows_per_shard],
                         starts_a[start:start + rows_per_shard], lengths_a[start:start + rows_per_shard])
             for index, start in enumerate(range(0, rows, rows_per_shard))]
    return _write_manifest(out, seq_len, vocab_size, infos, rows, documents, build_args, "doc",
                           padding=int(rows * seq_len - lengths_a.sum()))


def _check(vocab_size: int, seq_len: int, rows: int) -> None:
    if vocab_size <= len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size {vocab_size}: must exceed the {len(SPECIAL_TOKENS)} special tokens")
    if seq_len < 8 or rows <= 0:
        raise ValueError(f"seq_len {seq_len} (>= 8) and rows {rows} (> 0) required")


def _reusable(out: Path, build_args: dict) -> Manifest | None:
    """The manifest of an identical earlier build in `out`; else None, with `out` emptied and made."""
    if (out / MANIFEST_FILE).is_file():
        existing = read_manifest(out)
        if existing.build_args == build_args:
            return existing
        shutil.rmtree(out)  # a synthetic directory with other parameters: only ever ours to replace
    out.mkdir(parents=True, exist_ok=True)
    return None


def _write_manifest(out: Path, seq_len: int, vocab_size: int, infos: list, rows: int, documents: int,
                    build_args: dict, packing: str, padding: int) -> Manifest:
    manifest = Manifest(
        format_version=FORMAT_VERSION, seq_len=seq_len, vocab_size=vocab_size, special_tokens=dict(SPECIAL_TOKENS),
        tokenizer_hash="synthetic", shards=infos, total_sequences=rows, total_tokens=rows * seq_len,
        sources=[{"path": "synthetic", "bytes": 0, "sha256": "", "documents": documents}], build_args=build_args,
        id_dtype=id_dtype_for(vocab_size).name, packing=packing,
        stats={"documents": documents, "padding_tokens": padding})
    write_atomic(out / MANIFEST_FILE, manifest.to_json())
    return manifest
