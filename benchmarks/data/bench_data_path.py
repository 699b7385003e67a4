"""Data path alone: shard reader + corruption collator (with the objectives' host plans), per
objective and sequence length, in tokens/s — does the host side outrun the GPU?

Each configuration runs the real `PretrainBatches` over shards (synthetic by default,
`benchmarks/data/synthetic_shards.py`: full `[CLS] ... [SEP]` rows, BERT's vocabulary size) and the
collator the training loop builds (`CorruptionCollator(model.views, ..., plans=model.host_plans())`,
the index building that moved out of the step included):

  * `per_worker`: one process collating back to back for `--seconds`: tokens per second of that
    process's CPU time (what one DataLoader worker delivers on a core of its own; CPU time, so that
    other load on a shared machine does not count against it — the wall-time rate is in the JSON);
  * `loader`: the training loop's `DataLoader` with the presets' `data.num_workers` (default 2)
    worker processes, timed after the first batch (worker start-up excluded).

The target (issue 26): the presets' workers deliver >= 4x what BERT-large consumes on one H100 at
50% MFU. Consumption = 0.5 x 989.4 TFLOP/s (H100 SXM dense bf16, `pipeline.train.metrics.PEAK_FLOPS`)
/ training FLOPs per token of BERT-large (`mlm_step_flops`, 15% predicted, 30,522-token vocabulary):
248k tokens/s at L=512 (the issue's "about 225k"), 263k at L=128. `ratio` = delivered / consumed; `workers_for_4x` = how many workers at the
per-worker rate give 4x.

    python benchmarks/data/bench_data_path.py --seq-lens 128,512 --seconds 5 \\
        --out benchmarks/results/fast_path --name data_path_cpu
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

from pipeline.data.config import BatchPlan
from pipeline.data.corruption import CorruptionCollator
from pipeline.data.reader import PretrainBatches, ShardDataset
from pipeline.model.encoder import SIZE_PRESETS, build_encoder_config
from pipeline.model.build import build_pretrain_model
from pipeline.train.metrics import PEAK_FLOPS, mlm_step_flops

OBJECTIVES = {"mlm": {"mlm": 1.0}, "mlm-nce": {"mlm-nce": 1.0}, "taco": {"mlm": 1.0, "taco": 1.0},
              "capt": {"mlm": 1.0, "capt": 1.0}, "cocolm": {"cocolm": 1.0}, "infoword": {"infoword": 1.0}}
H100_BF16 = dict(PEAK_FLOPS)["H100"]["bf16"]


def consumed_tokens_per_s(seq_len: int, mfu: float = 0.5, vocab: int = 30522) -> float:
    """Tokens/s BERT-large trains on at `mfu` of one H100 (bf16): peak x mfu / FLOPs per token."""
    shape = SIZE_PRESETS["large"]
    batch = 1
    flops = mlm_step_flops(batch, seq_len, shape["hidden_size"], shape["ffn_size"], shape["num_layers"],
                           round(0.15 * seq_len), vocab)
    return mfu * H100_BF16 / (flops / seq_len)


def collator_for(objectives: dict[str, float], dataset: ShardDataset, seed: int) -> CorruptionCollator:
    """The collator the training loop would build for these objectives (views and host plans)."""
    config = build_encoder_config("tiny", vocab_size=dataset.vocab_size, max_position=dataset.seq_len)
    model = build_pretrain_model(config, objectives, dataset.special_tokens, {}, seed=seed, kernels="torch")
    return CorruptionCollator(model.views, dataset.special_tokens, dataset.vocab_size, seed, plans=model.host_plans())


def per_worker(dataset: ShardDataset, collator: CorruptionCollator, micro: int, seconds: float) -> dict:
    batches = PretrainBatches(dataset, collator, BatchPlan(micro, 1, 1), 0, seed=0)
    next(batches)  # warm caches (memory maps, numpy)
    count, start, start_cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        next(batches)
        count += 1
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    tokens = count * micro * dataset.seq_len
    # CPU time: what one worker process costs, whatever else shares the machine
    return {"batches": count, "seconds": elapsed, "cpu_seconds": cpu, "tokens_per_s": tokens / cpu,
            "wall_tokens_per_s": tokens / elapsed}


def with_loader(dataset: ShardDataset, collator: CorruptionCollator, micro: int, seconds: float, workers: int) -> dict:
    batches = PretrainBatches(dataset, collator, BatchPlan(micro, 1, 1), 0, seed=0, num_workers=workers)
    for _ in range(2 * workers):  # start-up: workers spawned, first batches in flight
        next(batches)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(batches)
        count += 1
    elapsed = time.perf_counter() - start
    batches._loader_iter = None  # shut the workers down before the next configuration
    return {"batches": count, "seconds": elapsed, "tokens_per_s": count * micro * dataset.seq_len / elapsed}


def markdown(rows: list[dict], meta: dict) -> str:
    out = ["# Data path: reader + collator per objective", "",
           f"Device: {meta['device']}; torch {meta['torch']}, numpy {meta['numpy']}; command: `{meta['command']}`", "",
           "| objective | seq_len | micro_batch | tokens/s per worker | tokens/s, {w} loader workers | consumed (BERT-large, H100, 50% MFU) "
           "| ratio per worker | ratio loader | workers for 4x |".format(w=meta["workers"]),
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['objective']} | {r['seq_len']} | {r['micro_batch']} | {r['per_worker_tokens_per_s']:,.0f} | "
                   f"{r['loader_tokens_per_s']:,.0f} | {r['consumed_tokens_per_s']:,.0f} | {r['ratio_per_worker']:.2f} | "
                   f"{r['ratio_loader']:.2f} | {r['workers_for_4x']} |")
    out += ["", "- ratio = delivered tokens/s / consumed tokens/s; the target is >= 4 with the presets' workers",
            f"- {meta['note']}"]
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objectives", default=",".join(OBJECTIVES))
    parser.add_argument("--seq-lens", default="128,512")
    parser.add_argument("--tokens-per-batch", type=int, default=8192, help="micro-batch = this / seq_len rows")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2, help="the presets' data.num_workers")
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--shards", action="append", default=[], help="a shard directory per sequence length")
    parser.add_argument("--work-dir", default="/tmp/bench_data_path")
    parser.add_argument("--out", default="benchmarks/results/fast_path")
    parser.add_argument("--name", default="data_path")
    args = parser.parse_args(argv)
    from benchmarks.data.synthetic_shards import write_synthetic_shards

    given = {ShardDataset(d, verify=False).seq_len: d for d in args.shards}
    rows = []
    for seq_len in [int(s) for s in args.seq_lens.split(",")]:
        directory = given.get(seq_len)
        if directory is None:
            directory = Path(args.work_dir) / f"shards{seq_len}"
            write_synthetic_shards(directory, args.vocab_size, seq_len, rows=4096)
        dataset = ShardDataset(directory, verify=False)
        micro = max(1, args.tokens_per_batch // seq_len)
        consumed = consumed_tokens_per_s(seq_len, vocab=dataset.vocab_size)
        for name in args.objectives.split(","):
            collator = collator_for(OBJECTIVES[name], dataset, seed=0)
            one = per_worker(dataset, collator, micro, args.seconds)
            loader = with_loader(dataset, collator, micro, args.seconds, args.workers)
            row = {"objective": name, "seq_len": seq_len, "micro_batch": micro,
                   "per_worker_tokens_per_s": one["tokens_per_s"], "loader_tokens_per_s": loader["tokens_per_s"],
                   "consumed_tokens_per_s": consumed, "ratio_per_worker": one["tokens_per_s"] / consumed,
                   "ratio_loader": loader["tokens_per_s"] / consumed,
                   "workers_for_4x": math.ceil(4 * consumed / one["tokens_per_s"])}
            rows.append(row)
            print(f"{name:9s} L={seq_len:4d}: {row['per_worker_tokens_per_s']:>10,.0f} tok/s per worker, "
                  f"{row['loader_tokens_per_s']:>10,.0f} with {args.workers} workers "
                  f"(x{row['ratio_loader']:.2f} of {consumed:,.0f}; {row['workers_for_4x']} workers for 4x)", flush=True)
    meta = {"device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores visible",
            "torch": torch.__version__, "numpy": np.__version__, "workers": args.workers,
            "command": "python benchmarks/data/bench_data_path.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "note": "tokens = micro-batch rows x seq_len (full rows); synthetic shards unless --shards; per worker: "
                    "tokens per CPU-second of the collating process; loader: wall time of the training process "
                    "receiving batches from the workers (on a shared machine this includes waiting for the CPU)"}
    from benchmarks.common.report import atomic_write, write_json

    write_json(Path(args.out) / f"{args.name}.json", {"meta": meta, "rows": rows})
    atomic_write(Path(args.out) / f"{args.name}.md", markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
