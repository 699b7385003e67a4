"""Does a held-out shard set hold the training data's documents or rows? Compared by what it holds,
not by its bytes: the training shards rebuilt with another `--shard-size-mb` (or `--num-proc`, or
merged) have another content hash, the same rows.

Two checks, both before any compute (`pipeline.train.eval_config.check_eval_set`):

* documents (`shared_source`, exact, from the manifests alone): a source file (same sha256) that both
  builds read holds documents of both, unless the two builds are the two sides of one held-out rule
  (`data_prep.holdout`: the validation side of fraction f keeps the documents with
  xxh3_64(text) < f 2^64, the training side of fraction g >= f drops all of them);
* rows (`row_overlap`, sampled): every held-out row (at most `MAX_HELD_ROWS`, evenly spaced) is hashed,
  and `TRAIN_SAMPLE` evenly spaced training rows are looked up among them. The share of training rows
  found, times the training rows, divided by the held-out rows (scaled when those were sampled), estimates
  the share of the held-out set that is training rows; `refuse_share` (half) or more, on at least
  `MIN_HITS` found rows, is refused. A proper held-out set shares at most the rare exact duplicates
  (boilerplate rows), far below half; a set that *is* training data finds every sampled row.
  A leak smaller than the sampling can see (a held-out set of a few rows copied from a large corpus)
  is not promised to be caught.

A row's hash is a random linear form of its token ids modulo 2^64 (fixed multipliers): two different
rows collide with probability about 2^-48, whatever their length.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from pipeline.data.shards import Manifest

MAX_HELD_ROWS = 1 << 20
TRAIN_SAMPLE = 1 << 16
MIN_HITS = 4
REFUSE_SHARE = 0.5
_CHUNK = 4096


def holdout_rule(manifest: Manifest) -> Optional[dict]:
    """The held-out rule a directory was built with (`data_prep.holdout.DocumentSplit.record`), or None."""
    args = manifest.build_args or {}
    rule = (args.get("fingerprint_inputs") or {}).get("holdout") or args.get("holdout")
    return rule if isinstance(rule, dict) else None


def _complementary(held: Optional[dict], train: Optional[dict]) -> bool:
    """Whether the validation side `held` and the training side `train` never keep the same document."""
    try:
        return (held is not None and train is not None and held.get("side") == "validation"
                and train.get("side") == "train" and float(held["fraction"]) <= float(train["fraction"]))
    except (KeyError, TypeError, ValueError):
        return False


def shared_source(held: Manifest, train: Manifest) -> Optional[dict[str, Any]]:
    """A source record (`{path, sha256, ...}`) of `held` whose file `train` was built from too, when the two
    builds are not complementary sides of one held-out rule; None otherwise."""
    if _complementary(holdout_rule(held), holdout_rule(train)):
        return None
    trained = {s.get("sha256") for s in train.sources if s.get("sha256")}
    return next((s for s in held.sources if s.get("sha256") in trained), None)


_MULTIPLIERS = np.random.default_rng(0x726F7773).integers(1, 2**63, size=1 << 16, dtype=np.uint64) * np.uint64(2) \
    + np.uint64(1)  # odd: every token id's bits reach the hash


def row_hashes(dataset: Any, rows: np.ndarray) -> np.ndarray:
    """uint64 hash of each of `rows` of `dataset` (a `ShardDataset`: `take`, `seq_len`)."""
    multipliers = _MULTIPLIERS[: dataset.seq_len]
    out = np.empty(len(rows), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for begin in range(0, len(rows), _CHUNK):
            ids, _ = dataset.take(rows[begin: begin + _CHUNK])
            out[begin: begin + len(ids)] = ((ids.astype(np.uint64) + np.uint64(1)) * multipliers).sum(
                axis=1, dtype=np.uint64)
    return out


def _spread(total: int, count: int) -> np.ndarray:
    """`count` evenly spaced row numbers of `total` (all of them when `count` >= `total`)."""
    if count >= total:
        return np.arange(total, dtype=np.int64)
    return np.unique(np.linspace(0, total - 1, count).astype(np.int64))


@dataclass(frozen=True)
class RowOverlap:
    share: float  # estimated share of the held-out rows that are training rows (capped at 1)
    hits: int  # sampled training rows found among the held-out rows
    sampled: int  # training rows sampled

    def refused(self) -> bool:
        return self.share >= REFUSE_SHARE and self.hits >= MIN_HITS


def row_overlap(held_dir: str | Path, train_dir: str | Path) -> RowOverlap:
    """The rows check of the module doc (the directories are mapped, not verified: their checks are the callers')."""
    from pipeline.data.reader import ShardDataset

    held, train = ShardDataset(held_dir, verify=False), ShardDataset(train_dir, verify=False)
    if len(held) == 0 or len(train) == 0 or held.seq_len != train.seq_len:
        return RowOverlap(0.0, 0, 0)
    held_rows, train_rows = _spread(len(held), MAX_HELD_ROWS), _spread(len(train), TRAIN_SAMPLE)
    found = np.isin(row_hashes(train, train_rows), row_hashes(held, held_rows))
    hits = int(found.sum())
    estimate = hits / len(train_rows) * len(train) * (len(held) / len(held_rows))
    return RowOverlap(min(1.0, estimate / len(held)), hits, len(train_rows))
