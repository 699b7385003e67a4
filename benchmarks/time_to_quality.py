"""Time to quality: MLM and each objective on the same shards and budget, evaluated at fixed intervals.

Every run trains with the real command (`python -m pipeline.train --config tiny-<objective>`, the
same model size, batch, learning-rate schedule, seed and number of steps: the same token budget)
and keeps a checkpoint every `--eval-every` steps. Each checkpoint is converted to Hugging Face
(`pipeline.export.convert`) and evaluated on
  * held-out masked-LM loss and accuracy: `BertForMaskedLM` on held-out shards, masked by the
    pipeline's own collator with a fixed seed, so every checkpoint sees the same masks;
  * a GLUE-format downstream task through `pipeline.eval.finetune` (`--task-dir`, or by default the
    word-order task that `benchmarks/probe_task.py` builds from the held-out text).
The report gives, per run and metric, the first evaluated step and the device-hours (training
step time only, summed from `metrics.jsonl`, times the world size) at which the run reaches the
target - by default the MLM baseline's final value (`benchmarks/quality_targets.py`) - plus curves.

    python benchmarks/time_to_quality.py --text ../shared/data/wikitext-2/valid.txt \\
        --heldout ../shared/data/wikitext-2/test.txt --objectives taco --steps 600 --eval-every 100 \\
        --out benchmarks/results/time_to_quality_cpu

Caveats written into every report: COCO-LM's main model never sees [MASK] inputs and InfoWord
trains a sampled softmax, so held-out MLM numbers favour MLM-style heads; the downstream task is
the fair comparison. One seed per run unless `--seeds` gives more (then curves are per seed).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_throughput import last_error_line, parse_list  # noqa: E402
from benchmarks.quality_targets import EvalPoint, curve_series, summarize_targets  # noqa: E402
from benchmarks.report import line_chart, write_report  # noqa: E402

#: metric -> higher is better (the downstream metric is added at run time).
MLM_METRICS = {"heldout_mlm_acc": True, "heldout_mlm_loss": False}


def heldout_mlm(model_dir: Path, shards_dir: Path, max_sequences: int, batch_size: int = 32, seed: int = 0) -> dict:
    """Masked-LM loss and accuracy of a converted model on held-out shards (fixed masks: seed + row index)."""
    import torch
    from transformers import BertForMaskedLM

    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.reader import ShardDataset

    dataset = ShardDataset(shards_dir)
    collator = CorruptionCollator({"masked"}, dataset.special_tokens, dataset.vocab_size, seed)
    model = BertForMaskedLM.from_pretrained(str(model_dir)).eval()
    total_loss, correct, count = 0.0, 0, 0
    n = min(len(dataset), max_sequences)
    with torch.no_grad():
        for start in range(0, n, batch_size):
            rows = np.arange(start, min(n, start + batch_size))
            ids, starts = dataset.take(rows)
            batch = collator.collate(ids, starts, rows)
            logits = model(input_ids=batch["masked_ids"], attention_mask=batch["attention_mask"]).logits.float()
            labels = batch["mlm_labels"]
            selected = labels != -100
            target = labels[selected]
            scores = logits[selected]
            total_loss += float(torch.nn.functional.cross_entropy(scores, target, reduction="sum"))
            correct += int((scores.argmax(-1) == target).sum())
            count += int(selected.sum())
    if count == 0:
        raise ValueError(f"{shards_dir}: no masked positions in the first {n} held-out sequences")
    return {"heldout_mlm_loss": total_loss / count, "heldout_mlm_acc": correct / count, "heldout_masked_tokens": count}


def downstream(model_dir: Path, task_dir: Path, args: argparse.Namespace) -> tuple[str, float]:
    """(metric name, mean dev score over `--finetune-seeds`) of `pipeline.eval.finetune` on the task."""
    from pipeline.eval.finetune import build_parser, finetune

    ft_args = build_parser().parse_args([
        "--model", str(model_dir), "--task-dir", str(task_dir), "--seeds", *map(str, args.finetune_seeds),
        "--lr", str(args.finetune_lr), "--epochs", str(args.finetune_epochs), "--batch-size", "32",
        "--max-length", str(min(args.seq_len, 128)), "--device", "cpu" if not _cuda() else "cuda"])
    result = finetune(ft_args)
    return f"downstream_{result['metric']}", float(result["mean"][result["metric"]])


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cumulative_hours(records: Sequence[dict], world_size: int) -> dict[int, float]:
    """step -> device-hours of training steps up to it (each logged step's time x world size).

    Needs `train.log_every=1` (every step logged), which `train_run` sets.
    """
    hours, total = {}, 0.0
    for r in sorted(records, key=lambda r: r["step"]):
        total += r["step_time_s"] * world_size / 3600.0
        hours[r["step"]] = total
    return hours


def prepare_data(args: argparse.Namespace, work: Path) -> tuple[Path, Path, Path]:
    """(train shards, held-out shards, task dir): built from `--text`/`--heldout` unless given."""
    from data_prep.build_shards import build_shards
    from data_prep.train_tokenizer import train_tokenizer

    from benchmarks.probe_task import word_order_task

    if args.shards:
        train_dir, heldout_dir = Path(args.shards), Path(args.heldout_shards)
    else:
        tok = work / "tokenizer"
        if not (tok / "tokenizer.json").is_file():
            train_tokenizer(args.text, tok, vocab_size=args.vocab_size, progress=False)
        train_dir, heldout_dir = work / "shards-train", work / "shards-heldout"
        build_shards(args.text, tok, train_dir, seq_len=args.seq_len, num_proc=1, progress=False)
        build_shards([args.heldout], tok, heldout_dir, seq_len=args.seq_len, num_proc=1, progress=False)
    if args.task_dir:
        task_dir = Path(args.task_dir)
    else:
        task_dir = work / "probe-task"
        args.probe = word_order_task(args.heldout, task_dir, args.probe_train, args.probe_dev,
                                     window=args.probe_window, seed=args.seed)
    return train_dir, heldout_dir, task_dir


def train_run(objective: str, shards: Path, run_dir: Path, args: argparse.Namespace) -> list[dict]:
    """Train one objective with checkpoints every `--eval-every` steps; returns its metrics records."""
    from pipeline.train.metrics import read_jsonl

    keep = args.steps // args.eval_every + 1
    overrides = [f"model.size={args.size}", f"data.shards_dir={shards}", f"data.micro_batch_size={args.micro_batch}",
                 f"data.global_batch_size={args.micro_batch * args.world_size}", f"train.total_steps={args.steps}",
                 f"train.checkpoint_every={args.eval_every}", f"train.keep_last={keep}", "train.log_every=1",
                 "train.resume=never", "train.tensorboard=false", "train.progress_bar=false",
                 f"train.seed={args.seed}", f"train.output_dir={run_dir}", *args.set]
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    cmd = [*launcher, "-m", "pipeline.train", "--config", f"tiny-{objective}", *overrides]
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "train.log"
    print(f"[{objective}] $ {shlex.join(cmd)}", flush=True)
    with open(log_path, "w", encoding="utf-8") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{objective}: pipeline.train exit {code}: "
                           f"{last_error_line(log_path.read_text(errors='replace'))} (log: {log_path})")
    return read_jsonl(run_dir / "metrics.jsonl")


def evaluate_run(objective: str, run_dir: Path, heldout: Path, task_dir: Path, records: list[dict],
                 args: argparse.Namespace) -> list[EvalPoint]:
    """Convert and evaluate every kept checkpoint of one run."""
    from pipeline.train.checkpoint import list_tags
    from pipeline.export.convert import convert

    hours = cumulative_hours(records, args.world_size)
    points = []
    for step, tag in list_tags(run_dir / "checkpoints"):
        started = time.perf_counter()
        hf_dir = convert(tag, run_dir / "hf" / tag.name, overwrite=True)
        values = heldout_mlm(hf_dir, heldout, args.eval_sequences, seed=args.seed)
        name, score = downstream(hf_dir, task_dir, args)
        values[name] = score
        points.append(EvalPoint(step=step, device_hours=hours[step], values=values))
        print(f"[{objective}] step {step}: held-out MLM acc {values['heldout_mlm_acc']:.4f} loss "
              f"{values['heldout_mlm_loss']:.3f}, {name} {score:.4f} ({time.perf_counter() - started:.0f}s)", flush=True)
    return points


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="time_to_quality.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", nargs="+", help="pretraining text (tokenizer + shards are built from it)")
    p.add_argument("--heldout", help="held-out text: held-out MLM shards and the default downstream task")
    p.add_argument("--shards", help="prebuilt training shards (instead of --text)")
    p.add_argument("--heldout-shards", help="prebuilt held-out shards, same tokenizer (with --shards)")
    p.add_argument("--task-dir", help="GLUE-format task dir (default: word-order task from --heldout)")
    p.add_argument("--objectives", default="taco", help="objectives compared with the MLM baseline")
    p.add_argument("--size", default="tiny", help="model size preset")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra pipeline.train override")
    p.add_argument("--steps", type=int, default=600, help="training steps of every run (the budget)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--world-size", type=int, default=1, help="ranks the launcher starts")
    p.add_argument("--launcher", default="", help='command replacing "python" (e.g. "torchrun --nproc_per_node 8")')
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seed", type=int, default=1234, help="pretraining seed (data order, masks, init)")
    p.add_argument("--eval-sequences", type=int, default=512, help="held-out sequences for the MLM metrics")
    p.add_argument("--probe-train", type=int, default=2000)
    p.add_argument("--probe-dev", type=int, default=500)
    p.add_argument("--probe-window", type=int, default=0, help="words permuted in the probe (0: whole sentence)")
    p.add_argument("--finetune-seeds", type=int, nargs="+", default=[1])
    p.add_argument("--finetune-lr", type=float, default=5e-4)
    p.add_argument("--finetune-epochs", type=int, default=3)
    p.add_argument("--target", action="append", default=[], metavar="METRIC=VALUE",
                   help="explicit target (default: the MLM run's final value of each metric)")
    p.add_argument("--out", required=True)
    p.add_argument("--work-dir", default="", help="tokenizer, shards, runs, checkpoints (default: <out>/work)")
    return p


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.shards and not args.heldout_shards:
        parser.error("--shards needs --heldout-shards (same tokenizer)")
    if not args.shards and not args.text:
        parser.error("give --text (and --heldout) or --shards and --heldout-shards")
    if not args.heldout and not (args.heldout_shards and args.task_dir):
        parser.error("--heldout is required unless both --heldout-shards and --task-dir are given")
    for path in [*(args.text or []), *filter(None, [args.heldout, args.shards, args.heldout_shards, args.task_dir])]:
        if not Path(path).exists():
            parser.error(f"{path}: does not exist")
    if args.steps < 1 or args.eval_every < 1 or args.eval_every > args.steps:
        parser.error("need 1 <= --eval-every <= --steps")
    try:
        args.objectives = parse_list(args.objectives)
        args.targets = {k: float(v) for k, v in (t.split("=", 1) for t in args.target)}
    except ValueError as err:
        parser.error(f"--objectives / --target: {err}")
    from pipeline.config.loader import available_presets

    bad = [o for o in args.objectives if f"tiny-{o}" not in available_presets()]
    if bad:
        parser.error(f"--objectives {bad}: no tiny-<objective> preset")
    args.probe = None
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    curves: dict[str, list[EvalPoint]] = {}
    try:
        train_dir, heldout_dir, task_dir = prepare_data(args, work)
        for objective in dict.fromkeys(["mlm", *args.objectives]):
            run_dir = work / "runs" / objective
            records = train_run(objective, train_dir, run_dir, args)
            curves[objective] = evaluate_run(objective, run_dir, heldout_dir, task_dir, records, args)
    except (RuntimeError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    metrics = dict(MLM_METRICS)
    metrics.update({k: True for p in curves["mlm"] for k in p.values if k.startswith("downstream_")})
    summary = []
    for metric, higher in metrics.items():
        summary += summarize_targets(curves, metric, higher, baseline="mlm", target=args.targets.get(metric))
    curve_rows = [{"run": name, "step": p.step, "device_hours": p.device_hours,
                   **{k: v for k, v in p.values.items() if k in metrics}} for name, c in curves.items() for p in c]
    budget = (f"{args.steps} steps x {args.micro_batch * args.world_size} sequences x {args.seq_len} tokens per run "
              f"(model {args.size} {' '.join(args.set)}), evaluated every {args.eval_every} steps")
    notes = [f"budget: {budget}", f"seeds: pretraining {args.seed}, fine-tuning {args.finetune_seeds}",
             "target = the MLM run's final value unless given; steps = first evaluated step meeting it",
             "device_hours = summed training step time x world size (no start-up, evaluation or checkpoint time)",
             "held-out MLM favours MLM-style heads (COCO-LM's main model never sees [MASK]; InfoWord's MLM is "
             "a sampled softmax); the downstream task is the fair comparison",
             f"downstream: {'word-order task from ' + str(args.heldout) if not args.task_dir else args.task_dir}"]
    extra = {"budget": budget, "seeds": {"pretrain": args.seed, "finetune": args.finetune_seeds},
             "probe_task": args.probe, "curves": curve_rows, "wall_seconds": round(time.perf_counter() - started, 1),
             "args": {k: v for k, v in vars(args).items() if k != "probe"}}
    paths = write_report("time_to_quality", summary, out, "Time to quality against MLM", notes=notes, extra=extra)
    write_report("time_to_quality_curves", curve_rows, out, "Evaluation curves", notes=notes[:2])
    for metric in metrics:
        target = next(r["target"] for r in summary if r["metric"] == metric)
        for x in ("step", "device_hours"):
            line_chart(curve_series(curves, metric, x=x), out / f"time_to_quality_{metric}_vs_{x}.png",
                       f"{metric} against {x.replace('_', '-')}", x.replace("_", "-"), metric,
                       hline=(target, "target"))
    print(json.dumps(summary, indent=1, default=str))
    print(f"wrote {paths['json']} and {paths['md']} ({time.perf_counter() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
