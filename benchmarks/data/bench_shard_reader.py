"""Shard reader speed, Arrow IPC *file* framing (shards before the change) vs *stream* framing (now),
measured side by side in one run on the same rows.

    python -m benchmarks.data.bench_shard_reader                  # 8 shards x 16,384 rows x 128 tokens
    python -m benchmarks.data.bench_shard_reader --shards 16 --rows 32768 --out benchmarks/results

Both directories hold identical rows (uint16 ids, random); the file-framed one is written with
`pyarrow.ipc.new_file` as the previous writer did, the stream-framed one with today's
`pipeline.data.shards.write_shard`. The measures run in `--trials` rounds after one untimed warm-up
round (so the page cache holds every directory and the comparison is of the reader, not the disk);
in each round every framing runs each measure once, in an order rotated from round to round, so
load from other processes on a shared machine hits every framing alike and none always runs first:

1. open: `ShardDataset(dir).open()` without hashing (`verify=False`: the hash check reads every
   byte and does not depend on the framing), i.e. memory-map every shard, read its schema and
   expose zero-copy numpy views;
2. random rows: `ShardDataset.take` of `--batch` rows drawn uniformly over the whole directory,
   `--batches` times (what `PretrainBatches` does per micro-batch; copies the rows): rows/s;
3. single rows: `ShardDataset[i]` for `--singles` random i: rows/s. It returns views into the
   memory map, so it times the lookup (shard search, view creation) and reads no token bytes.

Speeds are medians over the rounds. Ratios are paired: stream / file speed within each round (>= 1:
no loss), reported as the median over the rounds with its 10th-90th percentile range; a second
stream-framed copy is measured as a control, and its paired ratio to the first shows the noise of
such a comparison on this machine. Output: `<out>/shard_reader.{json,md}`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pyarrow as pa

from benchmarks.common.report import write_report
from pipeline.data.reader import ShardDataset
from pipeline.data.shards import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    Manifest,
    ShardInfo,
    shard_name,
    shard_schema,
    sha256_file,
    write_atomic,
    write_shard,
    xxh3_file,
)


def write_file_framed(path: Path, input_ids: np.ndarray, word_starts: np.ndarray, lengths: np.ndarray) -> ShardInfo:
    """One shard as the writer before the stream framing wrote it (Arrow IPC file format)."""
    rows, seq_len = input_ids.shape
    schema = shard_schema(seq_len, input_ids.dtype)
    batch = pa.record_batch([
        pa.FixedSizeListArray.from_arrays(pa.array(input_ids.reshape(-1)), seq_len),
        pa.FixedSizeListArray.from_arrays(pa.array(word_starts.reshape(-1)), seq_len),
        pa.array(lengths),
    ], schema=schema)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)
    return ShardInfo(name=path.name, rows=rows, sha256=sha256_file(path), bytes=path.stat().st_size,
                     xxh3_64=xxh3_file(path))


#: (label, writer); the control is a second stream-framed copy: its ratio to the first shows how much
#: two identical directories differ on this machine (the noise floor of the file/stream ratio).
FRAMINGS = (("file (before)", write_file_framed), ("stream (now)", write_shard),
            ("stream-copy (control)", write_shard))


def build(directory: Path, writer: Callable[..., ShardInfo], shards: int, rows: int, seq_len: int, seed: int) -> None:
    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)  # the same seed for both framings: identical rows
    infos = []
    for index in range(shards):
        ids = rng.integers(5, 30000, size=(rows, seq_len), dtype=np.uint16)
        starts = rng.integers(0, 2, size=(rows, seq_len), dtype=np.uint8)
        lengths = np.full(rows, seq_len, dtype=np.int32)
        infos.append(writer(directory / shard_name(index), ids, starts, lengths))
    manifest = Manifest(format_version=FORMAT_VERSION, seq_len=seq_len, vocab_size=30000, id_dtype="uint16",
                        special_tokens={"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}, tokenizer_hash="",
                        shards=infos, total_sequences=shards * rows, total_tokens=shards * rows * seq_len,
                        sources=[], build_args={"synthetic": True})
    write_atomic(directory / MANIFEST_FILE, manifest.to_json())


def interleaved_times(trials: int, framings: Sequence[str], kinds: Sequence[str],
                      fns: dict[tuple[str, str], Callable[[], None]]) -> dict[tuple[str, str], list[float]]:
    """Every round's time of each (framing, kind), after one untimed warm-up round (page cache, imports).
    Within a round each kind runs under every framing back to back, the framings' order rotated by one
    each round: a framing that always ran first (or always after the same one) would carry that
    position's share of the machine's load changes into the comparison."""
    times: dict[tuple[str, str], list[float]] = {key: [] for key in fns}
    for trial in range(trials + 1):
        order = [framings[(trial + i) % len(framings)] for i in range(len(framings))]
        for kind in kinds:
            for framing in order:
                start = time.perf_counter()
                fns[(framing, kind)]()
                if trial:
                    times[(framing, kind)].append(time.perf_counter() - start)
    return times


def speed_ratios(times_a: list[float], times_b: list[float]) -> np.ndarray:
    """Per round, the speed of b relative to a: time(a) / time(b), each round's two times paired."""
    return np.asarray(times_a) / np.asarray(times_b)


def workloads(directory: Path, args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    rng = np.random.default_rng(1)  # the same rows for both framings
    dataset = ShardDataset(directory, verify=False)
    dataset.open()
    total = len(dataset)
    batches = [rng.integers(0, total, size=args.batch) for _ in range(args.batches)]
    singles = rng.integers(0, total, size=args.singles)

    def open_all() -> None:
        ShardDataset(directory, verify=False).open()

    def take() -> None:
        for rows in batches:
            dataset.take(rows)

    def single() -> None:
        for i in singles:
            dataset[int(i)]

    return {"open": open_all, "take": take, "single": single}


KINDS = ("open", "take", "single")
MEASURES = {"open": "open_s", "take": "take_rows_per_s", "single": "single_rows_per_s"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16384, help="rows per shard")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--singles", type=int, default=10000)
    parser.add_argument("--trials", type=int, default=41, help="timed rounds")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_shard_reader_"))
    try:
        fns = {}
        for framing, writer in FRAMINGS:
            directory = work / framing.split()[0]
            build(directory, writer, args.shards, args.rows, args.seq_len, seed=0)
            fns.update({(framing, kind): fn for kind, fn in workloads(directory, args).items()})
        names = [framing for framing, _ in FRAMINGS]
        times = interleaved_times(args.trials, names, KINDS, fns)
        work_per_round = {"open": None, "take": args.batch * args.batches, "single": args.singles}

        def value(seconds: float, kind: str) -> float:  # open stays a time; the reads become rows/s
            return seconds if kind == "open" else work_per_round[kind] / seconds

        rows = [{"framing": name, **{MEASURES[kind]: round(value(float(np.median(times[(name, kind)])), kind),
                                                           5 if kind == "open" else 0) for kind in KINDS}}
                for name in names]
        file, stream, control = names
        ratios = {"stream/file (speed)": {kind: speed_ratios(times[(file, kind)], times[(stream, kind)])
                                          for kind in KINDS},
                  "control/stream (noise)": {kind: speed_ratios(times[(stream, kind)], times[(control, kind)])
                                             for kind in KINDS}}
        for label, by_kind in ratios.items():
            for statistic, q in (("median", 50), ("p10", 10), ("p90", 90)):
                rows.append({"framing": f"ratio {label}, {statistic}",
                             **{MEASURES[kind]: round(float(np.percentile(r, q)), 3) for kind, r in by_kind.items()}})
        notes = [f"{args.shards} shards x {args.rows} rows x {args.seq_len} uint16 tokens; take: {args.batches} "
                 f"batches of {args.batch} uniform random rows; singles: {args.singles} random rows (views: no token "
                 f"bytes read); {args.trials} rounds after a warm-up round (page cache warm for every directory), "
                 "the framings' order rotated each round; speeds: medians over the rounds; "
                 f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
                 "ratios are paired per round (the same round's times) and summarised by their median and 10th / 90th "
                 "percentiles; stream/file > 1: the stream framing is faster; compare its spread with the control's "
                 "(two identical stream-framed directories), the noise of this machine"]
        extra = {"round_times_s": {f"{framing} / {kind}": t for (framing, kind), t in times.items()}}
        paths = write_report("shard_reader", rows, args.out, "Shard reader: Arrow IPC file vs stream framing",
                             notes=notes, extra=extra)
        print(paths["md"].read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
