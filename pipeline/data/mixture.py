"""The run's data as the reader sees it: one shard directory, or a mixture of several (`data.sources`).

`open_run_data(data, run_samples)` is the one entry point that turns a data spec (a `DataConfig`, or
anything with its `shards_dir` / `sources` / `mixture_block` / `verify_shards` / `seq_len` fields:
a training phase's data) into the dataset `pipeline.data.reader.PretrainBatches` streams:

  * `data.shards_dir`: a `ShardDataset`, read in the order of `pipeline.data.reader` (unchanged);
  * `data.sources`: a `MixtureDataset`: the sources' rows concatenated (global row = the source's
    offset + its row), and the stream order of `pipeline.data.sources` (position -> source by the
    block interleave -> that source's pass permutation -> row). `PretrainBatches` asks it for the
    rows of each position (`mixture_rows`), so rank slicing, micro-batching, workers and the O(1)
    resume from `consumed_samples` are the reader's, unchanged.

Per-source counters (`source_metrics`): the samples of source s among the first c consumed are
C_s(c) (`Interleave.counts_before`), its tokens the sum of `length` over those samples: whole passes
count the source's `total_tokens`, the current pass the prefix of its permutation (prefix sums kept
every `_CHUNK` rows, so a query reads at most `_CHUNK` lengths). A pure function of c: exact after
a resume.

Shares changed on resume (`continue_stream`). The interleave is a function of the position from the
stream's first sample, so new shares applied from position 0 would re-place the positions already
read. Instead the stream is cut into segments: a segment starting at position P0 with base counts
b_s (the samples of each source read before it) reads position p >= P0 as source s = the new
interleave's source at p - P0, sample number b_s + (its index there) of s, i.e. every source goes on
in its own pass order from where it stood: no row skipped or read twice, and C_s(c) = b_s +
C'_s(c - P0). A checkpoint records the segment and the counts at its position (`record`,
`RunMeta.mixture`); a resume with the same quotas keeps the segment (bit for bit), one with other
quotas starts a new segment at its position. O(1) state, whatever the number of changes.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np

from pipeline.data.reader import ShardDataset, open_dataset
from pipeline.data.shards import Manifest
from pipeline.data.sources import Interleave, MixturePlan, match_sources, parse_sources, plan_mixture, source_identities, \
    source_seed
from pipeline.seeding import epoch_permutation

log = logging.getLogger(__name__)
_CHUNK = 4096


class SourceExhausted(ValueError):
    """A read past the end of an `on_exhausted: stop` source (the config check refuses such runs first)."""


class MixtureDataset:
    """Several `ShardDataset`s with one tokenizer and seq_len, read in a `MixturePlan`'s order."""

    def __init__(self, datasets: list[ShardDataset], plan: MixturePlan) -> None:
        if len(datasets) != len(plan.sources):
            raise ValueError(f"{len(datasets)} datasets for {len(plan.sources)} sources")
        self.datasets, self.plan = datasets, plan
        first = datasets[0]
        self.directory: Path = first.directory
        self.manifest: Manifest = first.manifest
        self.seq_len, self.special_tokens, self.vocab_size = first.seq_len, first.special_tokens, first.vocab_size
        self._offsets = np.concatenate([[0], np.cumsum([len(d) for d in datasets])]).astype(np.int64)
        self._orders: dict[int, Interleave] = {}
        self._passes: dict[tuple[int, int], np.ndarray] = {}
        self._prefix: dict[tuple[int, int], np.ndarray] = {}
        self._lengths: dict[int, np.ndarray] = {}
        self.start = 0  # the current segment's first position (module doc: shares changed on resume)
        self.base = np.zeros(len(datasets), dtype=np.int64)  # samples of each source read before it

    @property
    def tokenizer_dir(self) -> Path:
        return self.datasets[0].tokenizer_dir

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getstate__(self) -> dict[str, Any]:  # caches are rebuilt in a worker on demand
        return {**self.__dict__, "_orders": {}, "_passes": {}, "_prefix": {}, "_lengths": {}}

    def open(self) -> None:
        for dataset in self.datasets:
            dataset.open()

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Gather global rows (source offset + row) -> (input_ids [B, L], word_starts [B, L])."""
        rows = np.asarray(rows, dtype=np.int64)
        which = np.searchsorted(self._offsets, rows, side="right") - 1
        parts = {int(s): self.datasets[int(s)].take(rows[which == s] - self._offsets[s]) for s in np.unique(which)}
        dtype = next(iter(parts.values()))[0].dtype if parts else np.int64
        ids = np.empty((len(rows), self.seq_len), dtype=dtype)
        starts = np.empty((len(rows), self.seq_len), dtype=np.uint8)
        for s, (part_ids, part_starts) in parts.items():
            ids[which == s], starts[which == s] = part_ids, part_starts
        return ids, starts

    def _order(self, seed: int) -> Interleave:
        if seed not in self._orders:
            self._orders[seed] = Interleave(self.plan, seed)
        return self._orders[seed]

    def _pass(self, seed: int, source: int, number: int) -> np.ndarray:
        """Row order of pass `number` over source `source` (a few kept: a step may span passes)."""
        key = (source, number)
        if key not in self._passes:
            if len(self._passes) >= 2 * len(self.datasets) + 2:
                self._passes.pop(next(iter(self._passes)))
            self._passes[key] = epoch_permutation(source_seed(seed, source), number, len(self.datasets[source]))
        return self._passes[key]

    def mixture_rows(self, seed: int, positions: np.ndarray) -> np.ndarray:
        """Global rows at stream positions (the `PretrainBatches.rows_at` of a mixture)."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) and positions.min() < self.start:
            raise ValueError(f"stream positions before {self.start}, where the current shares begin, are not readable")
        sources, index = self._order(seed).locate(positions - self.start)
        index = index + self.base[sources]
        rows = np.empty(len(index), dtype=np.int64)
        for s in np.unique(sources):
            s = int(s)
            size, selected = len(self.datasets[s]), sources == s
            spec = self.plan.sources[s]
            if spec.on_exhausted == "stop" and index[selected].max() >= size:
                raise SourceExhausted(f"{spec.where} ({spec.path}, on_exhausted: stop): all {size:,} sequences are "
                                      f"used up at stream position {int(positions[selected][index[selected] >= size][0])}")
            numbers, offsets = np.divmod(index[selected], size)
            local = np.empty(len(offsets), dtype=np.int64)
            for number in np.unique(numbers):
                local[numbers == number] = self._pass(seed, s, int(number))[offsets[numbers == number]]
            rows[selected] = local + self._offsets[s]
        return rows

    def _tokens_of_prefix(self, seed: int, source: int, number: int, count: int) -> int:
        """Tokens of the first `count` samples of pass `number` over `source`."""
        if source not in self._lengths:
            self._lengths[source] = self.datasets[source].lengths()
        lengths, order = self._lengths[source], self._pass(seed, source, number)
        key = (source, number)
        if key not in self._prefix:
            if len(self._prefix) >= 2 * len(self.datasets):
                self._prefix.pop(next(iter(self._prefix)))
            self._prefix[key] = np.cumsum(np.add.reduceat(lengths[order], np.arange(0, len(order), _CHUNK)))
        whole = count // _CHUNK
        done = int(self._prefix[key][whole - 1]) if whole else 0
        return done + int(lengths[order[whole * _CHUNK:count]].sum())

    def source_metrics(self, seed: int, consumed: int) -> dict[str, int]:
        """`data/<name>/samples` and `data/<name>/tokens` (non-padding) among the first `consumed` samples."""
        metrics: dict[str, int] = {}
        for s, count in enumerate(self.counts(seed, consumed)):
            name, size = self.plan.sources[s].name, len(self.datasets[s])
            number, rest = divmod(int(count), size)
            metrics[f"data/{name}/samples"] = int(count)
            metrics[f"data/{name}/tokens"] = number * self.plan.tokens[s] + self._tokens_of_prefix(seed, s, number, rest)
        return metrics


    def counts(self, seed: int, consumed: int) -> np.ndarray:
        """Samples of each source among the first `consumed` positions: b_s + C'_s(consumed - P0)."""
        return self.base + self._order(seed).counts_before(max(consumed - self.start, 0))

    def described(self) -> list[dict[str, str]]:
        """`{name, identity, path}` of each source, in order (`pipeline.data.sources.match_sources`)."""
        identities = source_identities([d.manifest.content_hash or "" for d in self.datasets])
        return [{"name": spec.name, "identity": ident if d.manifest.content_hash else "", "path": spec.path}
                for spec, d, ident in zip(self.plan.sources, self.datasets, identities)]

    def record(self, seed: int, consumed: int, phase: str) -> dict[str, Any]:
        """What a checkpoint after `consumed` positions (of phase `phase`) records to continue the
        stream: the segment, the quotas it reads with, every source's count at `consumed` (keyed by
        name), and what each source is (`sources`: the identity a resume matches it by)."""
        names = [spec.name for spec in self.plan.sources]
        return {"phase": phase, "start": int(self.start), "block": int(self.plan.block),
                "base": dict(zip(names, (int(b) for b in self.base))),
                "quotas": dict(zip(names, (int(q) for q in self.plan.quotas))),
                "counts": dict(zip(names, (int(c) for c in self.counts(seed, consumed)))), "consumed": int(consumed),
                "sources": self.described()}

    def continue_stream(self, record: dict[str, Any], phase: str, consumed: int, seed: int,
                        run_samples: Optional[int]) -> Optional[str]:
        """Resume the stream a checkpoint recorded (`record`) at `consumed` positions of phase `phase`:
        its segment when the quotas and block are the same, else a new segment from `consumed` (a
        line for the log); nothing for a record of another phase or position (a phase that starts
        here reads from its first sample). `run_samples`: the stream's planned length, to refuse an
        `on_exhausted: stop` source that the new shares would run out (a `ConfigError`)."""
        from pipeline.config.checks import ConfigError

        if not record or record.get("phase") != phase or record.get("consumed") != consumed:
            return None
        names = [spec.name for spec in self.plan.sources]
        quotas = dict(zip(names, (int(q) for q in self.plan.quotas)))
        # each source keyed by what it reads, not by its name: a renamed source keeps its counts
        before = record.get("sources") or [{"name": n} for n in record.get("counts", {})]
        was = [None if j is None else str(before[j].get("name")) for j in match_sources(before, self.described())]

        def recorded(field: str) -> np.ndarray:
            values = record.get(field) or {}
            return np.asarray([int(values.get(w, 0)) if w is not None else 0 for w in was], dtype=np.int64)

        renamed = [f"{w} -> {n}" for w, n in zip(was, names) if w is not None and w != n]
        if renamed:
            log.info("data mixture: source(s) renamed since the checkpoint (%s); each goes on from its own counts",
                     ", ".join(renamed))
        same_sources = len(before) == len(names) and was == [str(b.get("name")) for b in before]
        if same_sources and recorded("quotas").tolist() == list(quotas.values()) \
                and record.get("block") == self.plan.block:
            self.start = int(record["start"])
            self.base = recorded("base")
            return None
        self.start = consumed
        self.base = recorded("counts")
        if run_samples:
            final = self.counts(seed, run_samples)
            for s, spec in enumerate(self.plan.sources):
                if spec.on_exhausted == "stop" and final[s] > len(self.datasets[s]):
                    raise ConfigError(f"{spec.where} ({spec.path}, on_exhausted: stop): with the new shares from "
                                      f"sample {consumed} on, the run needs {int(final[s]):,} of its "
                                      f"{len(self.datasets[s]):,} sequences; lower its share or shorten the run")
        old = ", ".join(f"{w} {record['quotas'].get(w, 0)}" for w in was if w is not None)
        new = ", ".join(f"{n} {quotas[n]}" for n in names)
        return (f"data mixture: new shares from sample {consumed} of the stream (per {self.plan.block} positions: "
                f"{old} -> {new}); every source goes on from its count there ({dict(zip(names, self.base.tolist()))})")


def open_run_data(data: Any, run_samples: Optional[int] = None, check: bool = True) -> ShardDataset | MixtureDataset:
    """The dataset of a data spec (`DataConfig`-like; see the module doc). `check`: every rank opens
    each directory and, with `data.verify_shards`, checks every shard's bytes (`open_dataset`, a
    `ConfigError` on every rank naming the field); off: mapped lazily, nothing hashed (a read before
    the process group exists). `run_samples`: the run's sample count, for token budgets and the log."""
    if not data.sources:
        if check:
            return open_dataset(data.shards_dir, data.verify_shards)
        return ShardDataset(data.shards_dir, verify=False)
    specs = parse_sources(data.sources, data.mixture_block)
    datasets = [open_dataset(spec.path, data.verify_shards, f"{spec.where}.path") if check
                else ShardDataset(spec.path, verify=False) for spec in specs]
    plan = plan_mixture(specs, [len(d) for d in datasets], [d.manifest.total_tokens for d in datasets],
                        data.mixture_block, run_samples)
    if check:
        for line in plan.describe(run_samples):
            log.info("data mixture: %s", line)
    return MixtureDataset(datasets, plan)

