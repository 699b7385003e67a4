"""Data-path throughput, measured side by side in one run.

    python -m benchmarks.data.bench_prep                       # wikitext-2 (valid+test) x 4, 2 processes
    python -m benchmarks.data.bench_prep --repeat 8 --num-proc 8 --out benchmarks/results

1. Preprocessing: `data_prep.build_shards` against the Hugging Face `run_mlm` recipe (a "text"
   dataset, `datasets.map(tokenize, batched=True, num_proc=N)` then `datasets.map(group_texts)`
   into blocks of `seq_len`), on the same corpus file, tokenizer and number of processes. Both
   timings are wall-clock from raw text to the final on-disk result (our shards + manifest; the
   recipe's Arrow cache), each with a fresh output/cache directory, best of `--trials`, after an
   untimed warm-up (imports). Throughput = corpus tokens / second (the same token count for both).
   Target: ratio >= 3. CPU seconds (process + worker processes) are reported too: on a shared
   machine they show the work done, independent of what else is running.
2. Reader: `PretrainBatches` over the shards just built (memory-mapped, shuffled global order)
   with the corruption collator, single process, micro-batch `--batch` at `seq_len`; samples/s
   against the ~1,000 sequences/s a 24-layer model consumes on one H100 at length 512.
   Target: >= 20x for BERT masking. The other views are reported for information.

The corpus is `/work/shared/data/wikitext-2/{valid,test}.txt` concatenated `--repeat` times
into a temporary directory (never into the repo); the script exits cleanly when it is absent.
Output: `<out>/prep_throughput.{json,md,png}` and `<out>/prep_reader.{json,md,png}`.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from itertools import chain
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_CORPUS = Path("/work/shared/data/wikitext-2")
H100_24_LAYER_SEQ_PER_S = 1000.0
PREP_TARGET, READER_TARGET = 3.0, 20.0


def make_corpus(corpus_dir: Path, repeat: int, work: Path) -> Path:
    """valid.txt + test.txt, `repeat` times, as one .txt file (paragraphs separated by blank lines)."""
    parts = [(corpus_dir / name).read_bytes() for name in ("valid.txt", "test.txt") if (corpus_dir / name).is_file()]
    path = work / "corpus.txt"
    with open(path, "wb") as fh:
        for _ in range(repeat):
            for part in parts:
                fh.write(part)
                fh.write(b"\n\n")
    return path


def cpu_seconds() -> float:
    """CPU time of this process plus its reaped children (pool workers are reaped when a pool closes)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_ours(corpus: Path, tokenizer: Path, out: Path, seq_len: int, num_proc: int) -> tuple[float, float, Any]:
    """(wall seconds, CPU seconds, manifest) of one `build_shards` run."""
    from data_prep.build_shards import build_shards

    start, cpu = time.perf_counter(), cpu_seconds()
    manifest = build_shards([corpus], tokenizer, out, seq_len=seq_len, num_proc=num_proc, progress=False)
    return time.perf_counter() - start, cpu_seconds() - cpu, manifest


def run_hf_recipe(corpus: Path, tokenizer: Path, cache: Path, seq_len: int, num_proc: int) -> tuple[float, float, int]:
    """The `run_mlm` shape: text dataset -> batched tokenize map -> group_texts map (written by us)."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    start, cpu = time.perf_counter(), cpu_seconds()
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    raw = datasets.load_dataset("text", data_files={"train": str(corpus)}, cache_dir=str(cache))["train"]

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        return tok(batch["text"], return_special_tokens_mask=True)

    tokenized = raw.map(tokenize, batched=True, num_proc=num_proc, remove_columns=["text"])

    def group_texts(batch: dict[str, list]) -> dict[str, list]:
        joined = {key: list(chain(*values)) for key, values in batch.items()}
        usable = len(joined["input_ids"]) // seq_len * seq_len
        return {key: [values[i : i + seq_len] for i in range(0, usable, seq_len)] for key, values in joined.items()}

    grouped = tokenized.map(group_texts, batched=True, num_proc=num_proc)
    return time.perf_counter() - start, cpu_seconds() - cpu, len(grouped)


def bench_prep(corpus: Path, tokenizer: Path, work: Path, seq_len: int, num_proc: int, trials: int) -> tuple[list[dict], dict, Path]:
    # Warm-up on a small slice: library imports and first-call costs are paid here, by neither timing.
    sample = work / "warmup.txt"
    with open(corpus, "rb") as fh:
        sample.write_bytes(fh.read(200_000))
    run_ours(sample, tokenizer, work / "warmup_shards", seq_len, num_proc)
    run_hf_recipe(sample, tokenizer, work / "warmup_cache", seq_len, num_proc)
    ours_runs, hf_runs = [], []
    manifest = None
    for trial in range(trials):  # interleaved, so background load hits both alike
        out = work / f"shards_{trial}"
        *timing, manifest = run_ours(corpus, tokenizer, out, seq_len, num_proc)
        ours_runs.append(timing)
        cache = work / f"hf_cache_{trial}"
        *timing, blocks = run_hf_recipe(corpus, tokenizer, cache, seq_len, num_proc)
        hf_runs.append(timing)
        shutil.rmtree(cache, ignore_errors=True)
        if trial < trials - 1:
            shutil.rmtree(out, ignore_errors=True)
    tokens = manifest.stats["text_tokens"]
    (ours, ours_cpu), (hf, hf_cpu) = (min(r[0] for r in ours_runs), min(r[1] for r in ours_runs)), (min(r[0] for r in hf_runs), min(r[1] for r in hf_runs))
    rows = [
        {"pipeline": f"build_shards (ours, {num_proc} proc)", "seconds": ours, "cpu_seconds": ours_cpu, "tokens_per_s": tokens / ours, "tokens_per_cpu_s": tokens / ours_cpu, "sequences": manifest.total_sequences},
        {"pipeline": f"run_mlm recipe ({num_proc} proc)", "seconds": hf, "cpu_seconds": hf_cpu, "tokens_per_s": tokens / hf, "tokens_per_cpu_s": tokens / hf_cpu, "sequences": blocks},
    ]
    summary = {"prep_ratio": hf / ours, "prep_cpu_ratio": hf_cpu / ours_cpu, "corpus_tokens": tokens, "trials_ours_wall_cpu_s": ours_runs, "trials_hf_wall_cpu_s": hf_runs}
    return rows, summary, work / f"shards_{trials - 1}"


def bench_reader(shards: Path, batch: int, seconds: float, seed: int = 0) -> list[dict]:
    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.config import BatchPlan
    from pipeline.data.reader import PretrainBatches, ShardDataset

    dataset = ShardDataset(shards)
    rows = []
    for views in (("masked",), ("wwm_masked",), ("crop",), ("shuffled",), ("span_masked",), ("masked", "crop", "shuffled")):
        collator = CorruptionCollator(views, dataset.special_tokens, dataset.vocab_size, seed)
        reader = PretrainBatches(dataset, collator, BatchPlan(batch, 1, 1), 0, seed)
        next(reader)
        samples, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            next(reader)
            samples += batch
        rate = samples / (time.perf_counter() - start)
        rows.append({"views": "+".join(views), "samples_per_s": rate, "x_h100_24_layer": rate / H100_24_LAYER_SEQ_PER_S})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data.bench_prep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="directory with valid.txt / test.txt")
    parser.add_argument("--repeat", type=int, default=4, help="concatenate the corpus this many times")
    parser.add_argument("--num-proc", type=int, default=os.cpu_count() or 1, help="processes for both pipelines")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--trials", type=int, default=2, help="runs of each pipeline; the best is reported")
    parser.add_argument("--batch", type=int, default=64, help="reader micro-batch size")
    parser.add_argument("--reader-seconds", type=float, default=5.0, help="time per reader measurement")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args(argv)
    if not (args.corpus / "valid.txt").is_file():
        print(f"skipping: benchmark corpus {args.corpus}/valid.txt not found")
        return 0
    from benchmarks.common.report import write_report
    from data_prep.train_tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench_prep_") as tmp:
        work = Path(tmp)
        corpus = make_corpus(args.corpus, args.repeat, work)
        tokenizer = train_tokenizer([corpus], work / "tokenizer", vocab_size=args.vocab_size, progress=False)
        prep_rows, prep, shards = bench_prep(corpus, tokenizer, work, args.seq_len, args.num_proc, args.trials)
        reader_rows = bench_reader(shards, args.batch, args.reader_seconds)
    masked = reader_rows[0]["x_h100_24_layer"]
    corpus_note = f"corpus: wikitext-2 valid+test x{args.repeat} ({prep['corpus_tokens']:,} tokens), WordPiece {args.vocab_size}, seq_len {args.seq_len}"
    prep_notes = [
        corpus_note,
        f"ratio build_shards / run_mlm recipe: {prep['prep_ratio']:.2f}x (target >= {PREP_TARGET}x): {'PASS' if prep['prep_ratio'] >= PREP_TARGET else 'FAIL'}",
        f"CPU-time ratio (tokens per CPU-second, robust to other load on the machine): {prep['prep_cpu_ratio']:.2f}x",
        "the corpus is repeated: later copies find their words in build_shards' per-process word memo (--repeat 1 shows a corpus without repeats)",
        f"wall-clock and CPU seconds, best of {args.trials} interleaved trials; ours {prep['trials_ours_wall_cpu_s']}, recipe {prep['trials_hf_wall_cpu_s']}",
    ]
    reader_notes = [
        corpus_note,
        f"single process, micro-batch {args.batch}; reference: ~{H100_24_LAYER_SEQ_PER_S:.0f} seq/s consumed by a 24-layer model on one H100 at length 512",
        f"BERT masking: {masked:.1f}x the H100 consumption (target >= {READER_TARGET}x): {'PASS' if masked >= READER_TARGET else 'FAIL'}",
    ]
    write_report("prep_throughput", prep_rows, args.out, "Shard building vs the run_mlm recipe (tokens/s)", bar=("pipeline", "tokens_per_s"), notes=prep_notes, extra={"summary": prep})
    write_report("prep_reader", reader_rows, args.out, "Reader + corruption collator throughput (samples/s)", bar=("views", "samples_per_s"), notes=reader_notes, extra={"summary": {"masked_x_h100": masked}})
    for line in prep_notes[1:3] + reader_notes[2:]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
