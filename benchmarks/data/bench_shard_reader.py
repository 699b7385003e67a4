"""Shard reader speed, Arrow IPC *file* framing (shards before the change) vs *stream* framing (now),
measured side by side in one run on the same rows.

    python -m benchmarks.data.bench_shard_reader                  # 8 shards x 16,384 rows x 128 tokens
    python -m benchmarks.data.bench_shard_reader --shards 16 --rows 32768 --out benchmarks/results

Both directories hold identical rows (uint16 ids, random); the file-framed one is written with
`pyarrow.ipc.new_file` as the previous writer did, the stream-framed one with today's
`pipeline.data.shards.write_shard`. For each, best of `--trials` rounds in which the two framings
alternate (after one untimed warm-up round, so the page cache holds both and the comparison is of
the reader, not the disk; alternating makes load from other processes hit both alike):

1. open: `ShardDataset(dir).open()` without hashing (`verify=False`: the hash check reads every
   byte and does not depend on the framing), i.e. memory-map every shard, read its schema and
   expose zero-copy numpy views;
2. random rows: `ShardDataset.take` of `--batch` rows drawn uniformly over the whole directory,
   `--batches` times (what `PretrainBatches` does per micro-batch): rows/s;
3. single rows: `ShardDataset[i]` for `--singles` random i: rows/s.

Ratio = stream / file speed (>= 1: no loss); a second stream-framed copy is measured as a control,
and its ratio to the first is the noise floor of that comparison on this machine. Output: `<out>/shard_reader.{json,md}`.
"""
from __future__ import annotations

import argparse
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


def interleaved_best(trials: int, fns: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Best time of each function over `trials` rounds, the functions alternating within each round
    (so load from other processes on a shared machine hits both framings alike); one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for trial in range(trials + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if trial:  # round 0 warms the page cache and imports
                times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16384, help="rows per shard")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--singles", type=int, default=20000)
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_shard_reader_"))
    try:
        fns = {}
        for framing, writer in FRAMINGS:
            directory = work / framing.split()[0]
            build(directory, writer, args.shards, args.rows, args.seq_len, seed=0)
            fns.update({(framing, kind): fn for kind, fn in workloads(directory, args).items()})
        best = interleaved_best(args.trials, fns)
        results = {framing: {"open_s": best[(framing, "open")],
                             "take_rows_per_s": args.batch * args.batches / best[(framing, "take")],
                             "single_rows_per_s": args.singles / best[(framing, "single")]}
                   for framing, _ in FRAMINGS}
        before, after = results["file (before)"], results["stream (now)"]
        rows = [{"framing": name, **{k: round(v, 5 if k == "open_s" else 0) for k, v in r.items()}}
                for name, r in results.items()]
        control = results["stream-copy (control)"]
        rows.append({"framing": "ratio control/stream (noise)", "open_s": round(after["open_s"] / control["open_s"], 3),
                     "take_rows_per_s": round(control["take_rows_per_s"] / after["take_rows_per_s"], 3),
                     "single_rows_per_s": round(control["single_rows_per_s"] / after["single_rows_per_s"], 3)})
        rows.append({"framing": "ratio stream/file (speed)", "open_s": round(before["open_s"] / after["open_s"], 3),
                     "take_rows_per_s": round(after["take_rows_per_s"] / before["take_rows_per_s"], 3),
                     "single_rows_per_s": round(after["single_rows_per_s"] / before["single_rows_per_s"], 3)})
        notes = [f"{args.shards} shards x {args.rows} rows x {args.seq_len} uint16 tokens; take: {args.batches} "
                 f"batches of {args.batch} uniform random rows; singles: {args.singles} random rows; best of "
                 f"{args.trials} rounds alternating the framings, after a warm-up round (page cache warm for both)",
                 "ratio stream/file > 1: the stream framing is faster; compare it with the control ratio (two "
                 "identical stream-framed directories), the noise of this machine"]
        paths = write_report("shard_reader", rows, args.out, "Shard reader: Arrow IPC file vs stream framing",
                             notes=notes)
        print(paths["md"].read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
