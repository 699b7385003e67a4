"""Per-objective step cost relative to MLM on each encoder family, on a shared CPU: `python -m benchmarks.throughput.arch_cpu_ratios`.

Why a separate harness from `bench_throughput.py`: on a CPU shared with other jobs, wall-clock step
times measured in separate processes minutes apart move with the machine's load. Here every
(family, objective) model is built in one process (`build_pretrain_model`, the training model, with
plain `torch.optim.AdamW` instead of the DeepSpeed engine) and the steps are *interleaved*: step k of
every model runs before step k + 1 of any, so load drifts hit all rows alike. Each step (forward +
backward + optimizer step on one micro-batch, one intra-op thread) is timed twice:

* `cpu_ms`: `time.thread_time()` — CPU time of this thread, which other processes do not inflate
  (the primary measure on a loaded machine);
* `wall_ms`: `time.perf_counter()`.

Reported per row: the medians over the measured steps and `cpu_vs_mlm` = median CPU time / the same
family's MLM median CPU time (`wall_vs_mlm` likewise). Batches: synthetic shards
(`benchmarks/synthetic_shards.py`; speed does not depend on token values) through the real collator
with each objective's views, the same micro-batch for every model of a step. Objective options: the
tiny presets' (`tiny-<objective>`).

    python -m benchmarks.throughput.arch_cpu_ratios --out benchmarks/results/modernbert_cpu
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks.common.report import write_report
from benchmarks.data.synthetic_shards import write_synthetic_shards

#: family -> (model.arch, model.size): the two shapes compared (6 layers, hidden 256, 4 heads each).
FAMILIES = {"modernbert": ("modernbert", "small"), "bert": ("bert", "capt-small")}
OBJECTIVES = ("mlm", "mlm-nce", "taco", "capt", "cocolm", "infoword")


def build_rows(args: argparse.Namespace):
    """(label, family, objective, model, optimizer, collator views) for every measured configuration."""
    from pipeline.train.run_config import load_config
    from pipeline.pretrain.build import build_pretrain_model

    shards = write_synthetic_shards(Path(args.data), args.vocab_size, args.seq_len, rows=args.micro_batch * 64)
    models = []
    for family in args.families:
        arch, size = FAMILIES[family]
        for objective in args.objectives:
            cfg = load_config(f"tiny-{objective}", [f"model.arch={arch}", f"model.size={size}",
                                                    f"data.seq_len={args.seq_len}"])
            encoder = cfg.model.encoder_config(shards.vocab_size, shards.seq_len, shards.special_tokens)
            model = build_pretrain_model(encoder, cfg.objectives, shards.special_tokens, cfg.objective_options,
                                         seed=0, kernels="torch", attention=cfg.model.attention)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            models.append((f"{family}/{objective}", family, objective, cfg.objectives, model, optimizer))
    return shards, models


def batches(shards_dir: str, views: tuple[str, ...], micro_batch: int, count: int):
    from pipeline.data.config import BatchPlan
    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.reader import PretrainBatches, ShardDataset

    dataset = ShardDataset(shards_dir)
    collator = CorruptionCollator(views, dataset.special_tokens, dataset.vocab_size, 0)
    reader = PretrainBatches(dataset, collator, BatchPlan(micro_batch, 1, 1), 0, 0)
    return [reader.micro_batch(i * micro_batch, 0) for i in range(count)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.throughput.arch_cpu_ratios", description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="modernbert,bert", help="comma-separated: modernbert, bert")
    p.add_argument("--objectives", default=",".join(OBJECTIVES))
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--steps", type=int, default=8, help="measured steps per configuration (interleaved)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    p.add_argument("--data", default="/tmp/arch_cpu_ratios_data", help="synthetic shard directory (not committed)")
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="arch_cpu_ratios")
    args = p.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    args.objectives = [o for o in args.objectives.split(",") if o]
    if "mlm" not in args.objectives or any(f not in FAMILIES for f in args.families):
        p.error(f"--objectives must include mlm; --families from {sorted(FAMILIES)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one intra-op thread while measuring; the caller's count is put back after
    try:
        return _measure(args)
    finally:
        torch.set_num_threads(threads)


def _measure(args: argparse.Namespace) -> int:
    """Interleaved steps of every (family, objective) row, then the report (see `main`)."""
    torch.manual_seed(0)
    shards, models = build_rows(args)
    views = tuple(sorted(set().union(*(m[4].views for m in models))))
    data = batches(args.data, views, args.micro_batch, args.warmup + args.steps)
    cpu: dict[str, list[float]] = {m[0]: [] for m in models}
    wall: dict[str, list[float]] = {m[0]: [] for m in models}
    for step, batch in enumerate(data):
        for label, _family, _objective, _weights, model, optimizer in models:
            c0, w0 = time.thread_time(), time.perf_counter()
            loss, _ = model(batch, sampling_seed=step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            c1, w1 = time.thread_time(), time.perf_counter()
            if step >= args.warmup:
                cpu[label].append(1e3 * (c1 - c0))
                wall[label].append(1e3 * (w1 - w0))
    rows = []
    for label, family, objective, weights, model, _ in models:
        base = f"{family}/mlm"
        rows.append({
            "family": family, "size": FAMILIES[family][1], "objective": objective,
            "objectives": "+".join(weights), "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
            "cpu_ms": round(statistics.median(cpu[label]), 1), "wall_ms": round(statistics.median(wall[label]), 1),
            "cpu_vs_mlm": round(statistics.median(cpu[label]) / statistics.median(cpu[base]), 3),
            "wall_vs_mlm": round(statistics.median(wall[label]) / statistics.median(wall[base]), 3),
        })
    notes = [
        f"seq_len {args.seq_len}, micro-batch {args.micro_batch}, fp32, one intra-op thread, vocabulary "
        f"{args.vocab_size} (synthetic shards), {args.warmup} warm-up + {args.steps} measured steps per row, "
        "steps interleaved across rows; medians",
        "a step = forward + backward + AdamW step of the training model (`build_pretrain_model`, torch loss ops), "
        "no DeepSpeed engine",
        "cpu_ms: thread CPU time (not inflated by other processes on a shared machine); wall_ms: elapsed time",
        "shapes: modernbert small = 6 layers / 256 / 4 heads / GeGLU 384, window 64 (global layers 0 and 3); "
        "bert capt-small = 6 layers / 256 / 4 heads / FFN 1024",
        "objective options: the tiny presets' (TACO 8 negatives, CAPT queue 64, COCO-LM 1-layer generator, "
        "InfoWord and BERT-NCE 16 negatives per masked token)",
    ]
    paths = write_report(args.name, rows, args.out, "Step cost of each objective relative to MLM, per encoder family (CPU)",
                         bar=("objective", "cpu_vs_mlm"), notes=notes)
    for row in rows:
        print(f"{row['family']:>10} {row['objective']:>9}: cpu {row['cpu_ms']:8.1f} ms ({row['cpu_vs_mlm']:.2f}x MLM), "
              f"wall {row['wall_ms']:8.1f} ms ({row['wall_vs_mlm']:.2f}x)")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
