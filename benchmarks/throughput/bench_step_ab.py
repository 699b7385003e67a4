"""CPU step time of every objective, this tree against an older one, side by side from one run.

`--before DIR` is an extracted copy of the older code (e.g. `git archive <commit> | tar -x -C DIR`).
Each (tree, objective) measurement is a fresh process with `PYTHONPATH` set to that tree, running
forward + backward + an AdamW step of the `PretrainModel` (the objectives' code, no DeepSpeed) on
real collated micro-batches (the collator of that tree, with its host plans when it has them) of
synthetic shards; step time = the process's CPU time per step (`time.process_time`, one thread:
`OMP_NUM_THREADS=1`), median over `--steps` after `--warmup` — CPU time rather than wall time
because the machine is shared (other processes inflate wall time, not this process's CPU
time; the wall medians are kept in the JSON). Trees alternate
(before, after, before, after, ...) for `--rounds` rounds, so drift of a shared machine hits both
alike; the table gives the median over rounds and `after / before`. The newer tree steps as the
training loop runs most steps: `record_metrics=False` (no metrics-only work; logged steps, 1 in
`train.log_every`, add it back).

    python benchmarks/throughput/bench_step_ab.py --before /tmp/fp_before --size capt-small \\
        --seq-len 128 --micro-batch 8 --out benchmarks/results/fast_path --name step_time_cpu_small
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

OBJECTIVES = {"mlm": {"mlm": 1.0}, "mlm-nce": {"mlm-nce": 1.0}, "taco": {"mlm": 1.0, "taco": 1.0},
              "capt": {"mlm": 1.0, "capt": 1.0}, "cocolm": {"cocolm": 1.0}, "infoword": {"infoword": 1.0}}


def worker(args: argparse.Namespace) -> None:
    """Runs inside the tree under test (its `pipeline` comes first on sys.path): prints one JSON line."""
    import numpy as np
    import torch

    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.reader import ShardDataset
    from pipeline.model.encoder import build_encoder_config
    from pipeline.pretrain.build import build_pretrain_model
    from pipeline.objectives.base import StepProgress

    torch.manual_seed(0)
    dataset = ShardDataset(args.shards, verify=False)
    config = build_encoder_config(args.size, vocab_size=dataset.vocab_size, max_position=dataset.seq_len)
    model = build_pretrain_model(config, OBJECTIVES[args.objective], dataset.special_tokens, {}, seed=0, kernels="torch")
    kwargs = {"plans": model.host_plans()} if hasattr(model, "host_plans") else {}
    collator = CorruptionCollator(model.views, dataset.special_tokens, dataset.vocab_size, 0, **kwargs)
    fields = inspect.signature(StepProgress).parameters
    progress = StepProgress(1, 100, 1, **({"record_metrics": False} if "record_metrics" in fields else {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(0)
    times = []
    for step in range(args.warmup + args.steps):
        rows = np.sort(rng.choice(len(dataset), args.micro_batch, replace=False))
        ids, starts = dataset.take(rows)
        batch = collator.collate(ids, starts, rows)
        begin, begin_cpu = time.perf_counter(), time.process_time()
        loss, _ = model(batch, progress, sampling_seed=step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append((time.process_time() - begin_cpu, time.perf_counter() - begin))
    print(json.dumps({"step_time_s": statistics.median(t[0] for t in times),
                      "wall_s": statistics.median(t[1] for t in times), "loss": float(loss)}))


def measure(tree: str, objective: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--objective", objective, "--shards",
               args.shards, "--size", args.size, "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
    out = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{tree} {objective}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--objective", default="mlm")
    parser.add_argument("--objectives", default=",".join(OBJECTIVES))
    parser.add_argument("--before", help="directory of the older tree")
    parser.add_argument("--after", default=str(Path(__file__).resolve().parents[2]))
    parser.add_argument("--shards", default="/tmp/bench_data_path/shards128")
    parser.add_argument("--seq-len", type=int, default=128, help="synthetic shards' length when --shards is absent")
    parser.add_argument("--size", default="capt-small")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/fast_path")
    parser.add_argument("--name", default="step_time_cpu_small")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not args.before:
        parser.error("--before DIR is required")
    if not Path(args.shards, "manifest.json").is_file():
        sys.path.insert(0, args.after)
        from benchmarks.data.synthetic_shards import write_synthetic_shards

        write_synthetic_shards(args.shards, 30522, args.seq_len, rows=4096)
    rows = []
    for objective in args.objectives.split(","):
        runs: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.rounds):
            for label in ("before", "after"):
                runs[label].append(measure(getattr(args, label), objective, args)["step_time_s"])
        before, after = statistics.median(runs["before"]), statistics.median(runs["after"])
        rows.append({"objective": objective, "before_s": before, "after_s": after, "after_over_before": after / before,
                     "before_runs": runs["before"], "after_runs": runs["after"]})
        print(f"{objective:9s} before {before:.4f} s  after {after:.4f} s  ratio {after / before:.3f}", flush=True)
    import torch

    meta = {"device": f"cpu ({os.cpu_count()} cores visible, shared), {platform.processor() or platform.machine()}",
            "torch": torch.__version__, "size": args.size, "micro_batch": args.micro_batch, "shards": args.shards,
            "command": "python benchmarks/throughput/bench_step_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# CPU step time per objective: before / after the fast-path changes", "",
             f"Device: {meta['device']}; torch {meta['torch']}; model size {args.size}, micro-batch {args.micro_batch}; "
             f"command: `{meta['command']}`", "",
             "| objective | before (CPU s / step) | after (CPU s / step) | after / before |", "|---|---|---|---|"]
    lines += [f"| {r['objective']} | {r['before_s']:.4f} | {r['after_s']:.4f} | {r['after_over_before']:.3f} |" for r in rows]
    lines += ["", f"- forward + backward + AdamW step of `PretrainModel` (no DeepSpeed), CPU time per step (one thread), median of {args.steps} steps after "
              f"{args.warmup} warm-up, median over {args.rounds} alternating rounds per tree",
              "- after: `record_metrics=False` (the training loop's non-logged steps)"]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
