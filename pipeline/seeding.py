"""Seeding: every random number of a run is drawn from the run seed through one named stream.

This module is the one home of that rule, and the reason a resumed run repeats the uninterrupted
one bit for bit without saving any generator state: each stream is a pure function of the run
seed and of *where* in the run a number is used, never of how the run got there.

| stream                 | used by                                   | keyed by                                   |
| ---------------------- | ----------------------------------------- | ------------------------------------------ |
| `init`                 | model construction (`seed_init`)          | seed                                       |
| `data_order`           | reader (`epoch_permutation`)              | (seed, epoch)                              |
| corruption streams     | collator (`hash_uniform`, `span_rng`)     | (seed, stream, global sample index, column)|
| `sampling`             | objectives (`sampling_generator`)         | (seed, first global sample index of the micro-batch) |
| `dropout`              | torch's global generators (`reseed_dropout`) | (seed, optimizer step, rank)            |

Consequences, each relied on elsewhere:
  * the rank count never enters data order, corruption or objective sampling (they are keyed by
    global sample positions), so 1 rank and N ranks draw the same numbers for the same samples;
  * the same sample is corrupted differently in every epoch (its global position differs) but
    identically after a resume;
  * dropout is per rank (each rank's activations differ) and reseeded before every step, so a
    step's dropout masks depend on nothing that happened before it.

The corruption streams use a counter-based hash (splitmix64) instead of a stateful generator, so
the collator's vectorised views cost a few numpy passes over [B, L] and any single draw can be
recomputed on its own (`hash_uniform_at`). InfoWord's span sampling is sequential by nature and
uses one `numpy` generator per sample (`span_rng`).
"""
from __future__ import annotations

import enum
import hashlib
import random

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


class CorruptionStream(enum.IntEnum):
    """One stream per independent random decision of the collator (changing one never shifts another)."""

    SELECT = 1  # which positions BERT masking selects
    ACTION = 2  # [MASK] / random token / unchanged at a selected position
    RANDOM_TOKEN = 3  # which random token replaces a position
    WORD = 4  # whole-word masking: the order words are taken in
    SPAN = 5  # InfoWord span lengths and starts
    CROP = 6  # COCO-LM crop offset
    SHUFFLE = 7  # CAPT window shuffle
    SPAN_ACTION = 8  # InfoWord span: [MASK] / random tokens / unchanged, one draw per span (SpanBERT)
    SPAN_RANDOM_TOKEN = 9  # which random token replaces a position of a randomly replaced span


def _hash_to_int63(text: str) -> int:
    """A 63-bit integer from a blake2b hash of `text` (nearby seeds give unrelated values)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# --------------------------------------------------------------------------------------------
# init and data order
# --------------------------------------------------------------------------------------------
def seed_init(seed: int) -> None:
    """Seed torch before building the model: identical initial weights on every rank."""
    torch.manual_seed(seed)


def epoch_permutation(seed: int, epoch: int, size: int) -> np.ndarray:
    """The order of dataset rows in `epoch`: a function of (seed, epoch) only."""
    dtype = np.int32 if size < 2**31 else np.int64
    return np.random.default_rng([seed, epoch]).permutation(size).astype(dtype, copy=False)


# --------------------------------------------------------------------------------------------
# corruption: counter-based uniforms
# --------------------------------------------------------------------------------------------
def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrap-around arithmetic is intended)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def _row_keys(seed: int, sample_index: np.ndarray, stream: int) -> np.ndarray:
    """Per-sample uint64 starting points of the (seed, stream) random sequence."""
    with np.errstate(over="ignore"):
        base = _mix(np.array([(seed & _MASK64)], dtype=np.uint64) ^ (np.uint64(stream) * _GOLDEN))
        return _mix(base ^ np.asarray(sample_index, dtype=np.int64).astype(np.uint64))


def _to_unit(bits: np.ndarray) -> np.ndarray:
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def hash_uniform(seed: int, sample_index: np.ndarray, stream: int, width: int) -> np.ndarray:
    """Uniform [0, 1) floats, shape [B, width]: a pure function of (seed, sample_index, stream, column)."""
    with np.errstate(over="ignore"):
        cols = (np.arange(1, width + 1, dtype=np.uint64) * _GOLDEN)[None, :]
        return _to_unit(_mix(_row_keys(seed, sample_index, stream)[:, None] + cols))


def hash_uniform_at(seed: int, sample_index: np.ndarray, stream: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """`hash_uniform(...)[rows, cols]` without computing the rest of the grid."""
    with np.errstate(over="ignore"):
        offsets = (cols.astype(np.uint64) + np.uint64(1)) * _GOLDEN
        return _to_unit(_mix(_row_keys(seed, sample_index, stream)[rows] + offsets))


def span_rng(seed: int, sample_index: int) -> np.random.Generator:
    """The generator of one sample's InfoWord spans (sequential sampling, one generator per sample)."""
    return np.random.default_rng([seed & _MASK64, int(CorruptionStream.SPAN), int(sample_index)])


# --------------------------------------------------------------------------------------------
# objective sampling and dropout
# --------------------------------------------------------------------------------------------
def sampling_seed(seed: int, first_sample_index: int) -> int:
    """Seed of one micro-batch's objective-sampling generator.

    `first_sample_index` is the global stream position of the micro-batch's first sample, unique to
    one micro-batch of one rank; the rank itself is left out, so sampling does not depend on the
    rank count. Computed on the host from the batch before it moves to the device (no sync)."""
    return _hash_to_int63(f"{seed}:{first_sample_index}")


def sampling_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A `torch.Generator` on `device` seeded with `seed` (from `sampling_seed`)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def reseed_dropout(seed: int, step: int, rank: int) -> None:
    """Seed torch (CPU + CUDA), numpy and `random` from (seed, step, rank) before optimizer step
    `step`: its dropout masks are then a pure function of these, so no RNG state is checkpointed."""
    value = _hash_to_int63(f"dropout:{seed}:{step}:{rank}")
    torch.manual_seed(value)
    np.random.seed(value % 2**32)
    random.seed(value)
