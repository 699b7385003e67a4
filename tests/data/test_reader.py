"""pipeline.data.reader: zero-copy shards, rank-independent global order, epochs, O(1) exact resume."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.data.corruption import CorruptionCollator
from pipeline.data.config import BatchPlan
from pipeline.data.reader import PretrainBatches, ShardDataset
from pipeline.seeding import epoch_permutation
from pipeline.data.shards import read_manifest
from tests.fixtures_data import make_batch


def _reader(shards_dir: Path, micro: int, accum: int, rank: int, world: int, consumed: int = 0, seed: int = 3, workers: int = 0) -> PretrainBatches:
    dataset = ShardDataset(shards_dir)
    collator = CorruptionCollator(("masked",), dataset.special_tokens, dataset.vocab_size, seed)
    return PretrainBatches(dataset, collator, BatchPlan(micro, accum, world), rank, seed, consumed_samples=consumed,
                           num_workers=workers)


def _global_stream(shards_dir: Path, world: int, steps: int, consumed: int = 0, global_batch: int = 16, micro: int = 4) -> dict[str, torch.Tensor]:
    """Run every rank for `steps` steps; concatenate micro-batches in (step, micro-step, rank) order."""
    accum = global_batch // (micro * world)
    readers = [_reader(shards_dir, micro, accum, r, world, consumed) for r in range(world)]
    parts = []
    for _ in range(steps):
        for _ in range(accum):
            parts.extend(next(reader) for reader in readers)
    for reader in readers:
        assert reader.consumed_samples == consumed + steps * global_batch
    return {k: torch.cat([p[k] for p in parts]) for k in ("sample_index", "input_ids", "masked_ids", "mlm_labels")}


def test_dataset_is_memory_mapped_and_matches_manifest(tiny_shards_dir: Path) -> None:
    ds = ShardDataset(tiny_shards_dir)
    manifest = read_manifest(tiny_shards_dir)
    assert len(ds) == manifest.total_sequences
    allocated = pa.total_allocated_bytes()
    first = ds._open()[0]
    assert pa.total_allocated_bytes() == allocated  # opening every shard copies nothing into memory
    assert not first.input_ids.flags.owndata and first.input_ids.dtype == np.uint16  # a view into the mapped file
    row = ds[len(ds) - 1]
    assert row["input_ids"].shape == row["word_starts"].shape == (manifest.seq_len,)
    assert row["input_ids"][0] == manifest.special_tokens["cls"]
    ids, starts = ds.take(np.array([len(ds) - 1, 0, 200]))
    np.testing.assert_array_equal(ids[0], row["input_ids"])
    np.testing.assert_array_equal(ids[2], ds[200]["input_ids"])
    np.testing.assert_array_equal(starts[1], ds[0]["word_starts"])
    with pytest.raises(IndexError):
        ds[len(ds)]


@pytest.mark.parametrize("world", [2, 4])
def test_global_order_is_identical_for_1_2_4_ranks(tiny_shards_dir: Path, world: int) -> None:
    single = _global_stream(tiny_shards_dir, 1, steps=3)
    multi = _global_stream(tiny_shards_dir, world, steps=3)
    assert single["sample_index"].tolist() == list(range(48))
    for key, value in single.items():
        torch.testing.assert_close(multi[key], value, rtol=0, atol=0, msg=key)


def test_one_epoch_visits_every_sequence_once_and_epochs_differ(tiny_shards_dir: Path) -> None:
    reader = _reader(tiny_shards_dir, 7, 2, 0, 1)
    n = len(reader.dataset)
    first = reader.rows_at(np.arange(n))
    second = reader.rows_at(np.arange(n, 2 * n))
    assert sorted(first.tolist()) == list(range(n)) == sorted(second.tolist())
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(first, epoch_permutation(3, 0, n))
    # A step straddling the epoch boundary reads the tail of epoch 0, then the head of epoch 1.
    straddle = reader.rows_at(np.arange(n - 3, n + 3))
    np.testing.assert_array_equal(straddle, np.concatenate([first[-3:], second[:3]]))
    # Walking the stream through the iterator covers the epoch exactly (no skip, no repeat).
    seen = []
    while reader.consumed_samples < n - n % 14:
        seen += reader.rows_at(next(reader)["sample_index"].numpy()).tolist()
    assert len(seen) == len(set(seen)) == n - n % 14


@pytest.mark.parametrize("steps_before", [0, 1, 3, -2, -1])
def test_resume_at_consumed_samples_continues_the_exact_stream(tiny_shards_dir: Path, steps_before: int) -> None:
    # Negative: counted back from the last whole step of epoch 0, so the resumed steps cross into epoch 1.
    last_step = len(ShardDataset(tiny_shards_dir)) // 16
    consumed = 16 * (steps_before if steps_before >= 0 else last_step + 1 + steps_before)
    reference = _global_stream(tiny_shards_dir, 2, steps=2, consumed=consumed)
    long_run = _global_stream(tiny_shards_dir, 2, steps=consumed // 16 + 2)
    for key in reference:
        torch.testing.assert_close(long_run[key][consumed:], reference[key], rtol=0, atol=0)
    # Resuming on a different world size from the saved state gives the same continuation.
    state = _reader(tiny_shards_dir, 4, 2, 0, 2, consumed).state_dict()
    assert state["consumed_samples"] == consumed
    resumed = _reader(tiny_shards_dir, 4, 4, 0, 1)
    resumed.load_state_dict(state)
    batches = [next(resumed) for _ in range(8)]
    torch.testing.assert_close(torch.cat([b["masked_ids"] for b in batches]), reference["masked_ids"], rtol=0, atol=0)


def test_state_dict_counts_completed_steps_only_and_checks_compatibility(tiny_shards_dir: Path) -> None:
    reader = _reader(tiny_shards_dir, 2, 3, 1, 2)
    assert reader.global_batch_size == 12
    next(reader), next(reader)
    assert reader.state_dict()["consumed_samples"] == 0  # mid-step: the step is redone on resume
    next(reader)
    assert reader.state_dict()["consumed_samples"] == 12
    with pytest.raises(ValueError, match="seed 99"):
        reader.load_state_dict({"consumed_samples": 0, "seed": 99, "dataset_size": len(reader.dataset)})
    with pytest.raises(ValueError, match="dataset of 5 sequences"):
        reader.load_state_dict({"consumed_samples": 0, "seed": 3, "dataset_size": 5})
    with pytest.raises(ValueError, match="rank 2 outside"):
        _reader(tiny_shards_dir, 2, 1, 2, 2)


def test_worker_processes_produce_the_same_batches(tiny_shards_dir: Path) -> None:
    plain = _reader(tiny_shards_dir, 4, 2, 1, 2, consumed=32)
    workers = _reader(tiny_shards_dir, 4, 2, 1, 2, consumed=32, workers=1)
    for _ in range(5):
        a, b = next(plain), next(workers)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    assert plain.consumed_samples == workers.consumed_samples == 32 + 2 * 16


def test_make_batch_helper_has_the_batch_contract(tiny_shards_dir: Path) -> None:
    batch = make_batch(tiny_shards_dir, ("masked", "span_masked", "crop", "shuffled"), batch_size=3, first_sample=5)
    assert batch["sample_index"].tolist() == [5, 6, 7]
    for key in ("input_ids", "masked_ids", "mlm_labels", "span_masked_ids", "span_labels", "span_index", "shuffled_ids"):
        assert batch[key].dtype == torch.int64 and batch[key].shape == (3, 64), key
    crop_width = int(batch["crop_seqlens"].max())  # as wide as the longest crop
    assert batch["crop_ids"].dtype == torch.int64 and batch["crop_ids"].shape == (3, crop_width) and crop_width < 64
    for key in ("mlm_positions", "span_positions", "seqlens", "crop_seqlens"):
        assert batch[key].dtype == torch.int64 and batch[key].dim() == 1, key
    assert batch["seqlens"].tolist() == batch["attention_mask"].sum(1).tolist()
    for key in ("special_mask", "word_starts"):
        assert batch[key].dtype == torch.bool
    assert batch["attention_mask"].dtype == batch["crop_attention_mask"].dtype == torch.int64


@pytest.mark.gpu
def test_batches_are_pinned_for_asynchronous_copies(tiny_shards_dir: Path) -> None:
    for workers in (0, 1):
        reader = _reader(tiny_shards_dir, 4, 1, 0, 1, workers=workers)
        reader.pin_memory = True
        batch = next(reader)
        assert all(v.is_pinned() for v in batch.values()), workers
