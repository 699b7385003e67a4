"""Streaming reader: memory-mapped shards -> deterministic global order -> rank slice -> collator.

`ShardDataset` maps every shard of a directory written by `data_prep.build_shards` (zero-copy numpy
views; nothing is loaded into memory until rows are gathered).

`PretrainBatches` turns it into an infinite stream of micro-batches. The *global* sample stream is
position p -> dataset row `perm(seed, p // N)[p % N]`, one fresh permutation per epoch. Training
step t covers positions [c, c + G) with c = consumed samples and G = micro * accum * world; the
micro-step m of rank r reads positions c + (m * world + r) * micro ... + micro. Hence
  * every rank gets exactly `micro` samples per micro-step (no rank runs out first);
  * concatenating all ranks' micro-batches in (m, r) order gives the same stream for any world size;
  * the reader's whole state is `consumed_samples`: resuming is O(1) (no replay), also with a
    different number of ranks, as long as G divides the resume point the same way.
Each batch carries `sample_index` (the global positions); the collator keys its corruption by it
(`pipeline.seeding`), so masks differ across epochs but are identical after a resume. The split
G = micro x accum x world is a `pipeline.data.config.BatchPlan`.

With `num_workers > 0` the micro-batches are collated in DataLoader worker processes, `prefetch`
of them ahead per worker, while the training process runs the step; `pin_memory` (a GPU run) puts
them in page-locked memory so the copy to the device is asynchronous. Micro-batch k is a pure
function of (consumed samples, k), so workers change nothing in the stream.
"""
from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np
import torch

from pipeline.seeding import epoch_permutation
from pipeline.data.config import BatchPlan
from pipeline.data.shards import (
    TOKENIZER_SUBDIR,
    Manifest,
    ShardArrays,
    ShardError,
    iter_shard_paths,
    open_shard,
    read_manifest,
)

log = logging.getLogger(__name__)


class ShardDataset:
    """Random access to the packed sequences of a shard directory (memory-mapped).

    With `verify` (default), each shard's size, hash and row count are checked against the
    manifest when the shards are first opened in this process (`pipeline.data.shards.open_shard`);
    copies made after that (DataLoader workers) do not hash again."""

    def __init__(self, directory: str | os.PathLike, verify: bool = True) -> None:
        self.directory = Path(directory)
        self.verify = verify
        self.manifest: Manifest = read_manifest(self.directory)
        self.seq_len = self.manifest.seq_len
        self.special_tokens = dict(self.manifest.special_tokens)
        self.vocab_size = self.manifest.vocab_size
        rows = [info.rows for info in self.manifest.shards]
        self._offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self._shards: list[ShardArrays] | None = None

    @property
    def tokenizer_dir(self) -> Path:
        return self.directory / TOKENIZER_SUBDIR

    def open(self) -> None:
        """Map (and, with `verify`, check) every shard now rather than at the first read."""
        self._open()

    def _open(self) -> list[ShardArrays]:
        if self._shards is None:
            shards = []
            for info, path in iter_shard_paths(self.directory, self.manifest):
                if not path.is_file():
                    raise FileNotFoundError(f"{path}: listed in the manifest but missing")
                shards.append(open_shard(path, self.seq_len, self.manifest.id_dtype, info, check_hash=self.verify))
            self._shards = shards
            self.verify = False  # verified once in this process; copies for workers need not hash again
        return self._shards

    def __getstate__(self) -> dict[str, Any]:  # memory maps are re-opened in the receiving process
        return {**self.__dict__, "_shards": None}

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} sequences")
        index %= len(self)
        shard_index = int(np.searchsorted(self._offsets, index, side="right")) - 1
        shard = self._open()[shard_index]
        row = index - int(self._offsets[shard_index])
        return {"input_ids": shard.input_ids[row], "word_starts": shard.word_starts[row]}

    def lengths(self) -> np.ndarray:
        """Tokens before the padding of every row (the shards' `length` column), int64 [rows]."""
        return np.concatenate([shard.length for shard in self._open()] or [np.zeros(0, np.int32)]).astype(np.int64)

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Gather `rows` -> (input_ids [B, L] in the shard dtype, word_starts [B, L] uint8)."""
        rows = np.asarray(rows, dtype=np.int64)
        shards = self._open()
        ids = np.empty((len(rows), self.seq_len), dtype=shards[0].input_ids.dtype if shards else np.int64)
        starts = np.empty((len(rows), self.seq_len), dtype=np.uint8)
        which = np.searchsorted(self._offsets, rows, side="right") - 1
        for shard_index in np.unique(which):
            selected = np.flatnonzero(which == shard_index)
            local = rows[selected] - self._offsets[shard_index]
            ids[selected] = shards[shard_index].input_ids[local]
            starts[selected] = shards[shard_index].word_starts[local]
        return ids, starts


class ArrayCollator(Protocol):
    def collate(self, input_ids: np.ndarray, word_starts: np.ndarray, sample_index: np.ndarray) -> dict[str, torch.Tensor]: ...


class _MicroBatchSource(torch.utils.data.Dataset):
    """Micro-batch number k (counted from `start`) -> batch; lets a DataLoader prefetch in workers."""

    def __init__(self, owner: "PretrainBatches", start: int) -> None:
        self.owner, self.start = owner, start

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        step, micro_step = divmod(k, self.owner.grad_accum)
        return self.owner.micro_batch(self.start + step * self.owner.global_batch_size, micro_step)

    def __len__(self) -> int:  # pragma: no cover - the stream is infinite; DataLoader never needs it
        raise TypeError("the micro-batch stream is infinite")


class PretrainBatches:
    """Infinite iterator of this rank's micro-batches; state = `consumed_samples` (see module doc).

    Iterating yields micro-step 0..grad_accum-1 of the current step, then `consumed_samples`
    grows by `global_batch_size`. `state_dict()` therefore always names a step boundary: save it
    after the optimizer step and a resumed run continues with the next step's samples.
    """

    def __init__(
        self,
        dataset: ShardDataset,
        collator: ArrayCollator,
        plan: BatchPlan,
        rank: int,
        seed: int,
        consumed_samples: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch: int = 4,
    ) -> None:
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} outside [0, {plan.world_size})")
        if len(dataset) == 0:
            raise ValueError(f"{dataset.directory}: the dataset has no sequences")
        self.dataset, self.collator = dataset, collator
        self.plan = plan
        self.micro_batch_size, self.grad_accum, self.world_size = plan.micro_batch_size, plan.grad_accum, plan.world_size
        self.rank, self.seed = rank, seed
        self.num_workers, self.pin_memory, self.prefetch = num_workers, pin_memory, prefetch
        self.consumed_samples = int(consumed_samples)
        self._micro_step = 0
        self._permutations: dict[int, np.ndarray] = {}
        self._loader_iter: Iterator[dict[str, torch.Tensor]] | None = None

    @property
    def global_batch_size(self) -> int:
        return self.plan.global_batch_size

    def positions(self, consumed: int, micro_step: int) -> np.ndarray:
        """Global stream positions of this rank's `micro_step` in the step that starts at `consumed`."""
        first = consumed + (micro_step * self.world_size + self.rank) * self.micro_batch_size
        return np.arange(first, first + self.micro_batch_size, dtype=np.int64)

    def rows_at(self, positions: np.ndarray) -> np.ndarray:
        """Dataset rows at global stream positions (a mixture, `pipeline.data.mixture.MixtureDataset`,
        has its own order: `data.sources`' interleave)."""
        if hasattr(self.dataset, "mixture_rows"):
            return self.dataset.mixture_rows(self.seed, positions)
        size = len(self.dataset)
        epochs, offsets = np.divmod(positions, size)
        rows = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs):
            selected = epochs == epoch
            rows[selected] = self._permutation(int(epoch))[offsets[selected]]
        return rows

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a step spans at most two epochs
                self._permutations.pop(min(self._permutations))
            self._permutations[epoch] = epoch_permutation(self.seed, epoch, len(self.dataset))
        return self._permutations[epoch]

    def micro_batch(self, consumed: int, micro_step: int) -> dict[str, torch.Tensor]:
        """The collated micro-batch for (`consumed`, `micro_step`) on this rank (pure function)."""
        positions = self.positions(consumed, micro_step)
        input_ids, word_starts = self.dataset.take(self.rows_at(positions))
        return self.collator.collate(input_ids, word_starts, positions)

    def __iter__(self) -> "PretrainBatches":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.num_workers > 0:
            if self._loader_iter is None:
                loader = torch.utils.data.DataLoader(
                    _MicroBatchSource(self, self.consumed_samples),
                    batch_size=None,
                    sampler=itertools.count(self._micro_step),
                    num_workers=self.num_workers,
                    persistent_workers=False,
                    pin_memory=self.pin_memory,
                    prefetch_factor=self.prefetch,
                )
                self._loader_iter = iter(loader)
            batch = next(self._loader_iter)
        else:
            batch = self.micro_batch(self.consumed_samples, self._micro_step)
            if self.pin_memory:
                batch = {k: v.pin_memory() for k, v in batch.items()}
        self._micro_step += 1
        if self._micro_step == self.grad_accum:
            self._micro_step = 0
            self.consumed_samples += self.global_batch_size
        return batch

    def source_metrics(self) -> dict[str, int]:
        """Per-source counters of a mixture at `consumed_samples` (`data/<name>/samples`, `.../tokens`:
        all ranks' samples, a pure function of the count, so exact after a resume); {} for one directory."""
        if not hasattr(self.dataset, "source_metrics"):
            return {}
        return self.dataset.source_metrics(self.seed, self.consumed_samples)

    def state_dict(self) -> dict[str, int]:
        """`consumed_samples` at the last completed step (plus what must match on resume)."""
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("dataset_size", len(self.dataset)) != len(self.dataset):
            raise ValueError(f"reader state is for a dataset of {state['dataset_size']} sequences; this one has {len(self.dataset)}")
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"reader state has seed {state['seed']}, this reader {self.seed}: the sample order would differ")
        self.consumed_samples = int(state["consumed_samples"])
        self._micro_step = 0
        self._loader_iter = None


def open_dataset(directory: str | os.PathLike, verify: bool, where: str = "data.shards_dir") -> ShardDataset:
    """The training run's dataset, opened on every rank once the process group is up, each shard's
    bytes checked against its manifest hash unless `verify` is off (`data.verify_shards`). A damaged
    shard found by any rank is a `ConfigError` on every rank, before any compute; `where` names the
    directory's field (a mixture's `data.sources[i].path`)."""
    from pipeline.config.checks import ConfigError
    from pipeline.distributed import first_problem

    dataset = ShardDataset(directory, verify=verify)
    if verify and not all(info.xxh3_64 for info in dataset.manifest.shards):
        log.warning("%s: manifest format %d has no xxh3 shard hashes; checking each shard's sha256 instead (slower; "
                    "rebuild with this version, or data.verify_shards=false if you verify separately)",
                    directory, dataset.manifest.format_version)
    problem = ""
    try:
        dataset.open()
    except (ShardError, FileNotFoundError) as err:
        problem = f"{where}={directory}: {err}"
    problem = first_problem(problem)
    if problem:
        raise ConfigError(f"{problem}; nothing was computed. Check the directory with `python -m data_prep.verify "
                          f"{directory}` and rebuild the damaged shards (data.verify_shards=false skips this check)")
    return dataset
