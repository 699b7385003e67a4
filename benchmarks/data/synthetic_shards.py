"""Synthetic shards for throughput measurements where no tokenized corpus is at hand (e.g. a bare GPU node).

Throughput does not depend on *which* token ids a batch holds, only on its shape: vocabulary size
(the MLM head), sequence length, padding, and how many word starts there are (whole-word and
InfoWord's n-gram span masking count words). So the rows written here are full-length
`[CLS] ids... [SEP]` sequences (no padding, like `packing=full` shards of a large corpus) with ids
drawn uniformly from the non-special range and word starts with probability `word_start_prob`
(0.75 ~ 1.3 WordPiece tokens per English word). They are written with the real shard writer and
manifest (`pipeline.data.shards`), so the training path reads them exactly as it reads real data.

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
    write_atomic,
    write_shard,
)

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
    if vocab_size <= len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size {vocab_size}: must exceed the {len(SPECIAL_TOKENS)} special tokens")
    if seq_len < 8 or rows <= 0:
        raise ValueError(f"seq_len {seq_len} (>= 8) and rows {rows} (> 0) required")
    build_args = {"synthetic": True, "vocab_size": vocab_size, "seq_len": seq_len, "rows": rows,
                  "word_start_prob": word_start_prob, "seed": seed, "rows_per_shard": rows_per_shard}
    out = Path(out)
    if (out / MANIFEST_FILE).is_file():
        existing = read_manifest(out)
        if existing.build_args == build_args:
            return existing
        shutil.rmtree(out)  # a synthetic directory with other parameters: only ever ours to replace
    out.mkdir(parents=True, exist_ok=True)
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
    manifest = Manifest(
        format_version=FORMAT_VERSION, seq_len=seq_len, vocab_size=vocab_size, special_tokens=dict(SPECIAL_TOKENS),
        tokenizer_hash="synthetic", shards=infos, total_sequences=rows, total_tokens=rows * seq_len,
        sources=[{"path": "synthetic", "bytes": 0, "sha256": "", "documents": rows}], build_args=build_args,
        id_dtype=dtype.name, packing="full", stats={"documents": rows, "padding_tokens": 0})
    write_atomic(out / MANIFEST_FILE, manifest.to_json())
    return manifest
