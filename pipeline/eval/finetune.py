"""`python -m pipeline.eval.finetune --model DIR --task-dir DIR`: GLUE-style fine-tuning of a converted model.

A plain torch loop around `AutoModelForSequenceClassification` (CPU is fine for small tasks):
AdamW, linear warm-up then linear decay, dynamic padding per batch, one run per seed. The dev
metrics after the last epoch are reported (no checkpoint selection on dev, so the number is not
tuned on the data it is measured on). Output: one JSON object on stdout (and in `--output`, written
atomically) with every seed's metrics and, per metric, the mean and the sample standard deviation
over seeds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from pipeline.eval.glue import TASK_CHOICES, Split, TaskSpec, resolve_task, task_metrics


def _encode(tokenizer, split: Split, max_length: int) -> list[dict[str, list[int]]]:
    columns = list(zip(*split.texts))
    enc = tokenizer(*columns, truncation=True, max_length=max_length)
    keys = [k for k in ("input_ids", "token_type_ids", "attention_mask") if k in enc]
    return [{k: enc[k][i] for k in keys} for i in range(len(split.texts))]


def _batches(features: list[dict], labels: list, order: Sequence[int], batch_size: int, tokenizer, regression: bool):
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = tokenizer.pad([features[i] for i in idx], return_tensors="pt")
        dtype = torch.float32 if regression else torch.long
        yield dict(batch), torch.tensor([labels[i] for i in idx], dtype=dtype)


def linear_schedule(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the peak lr over `warmup` steps, then linear decay to 0 at `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def run_seed(args: argparse.Namespace, spec: TaskSpec, train: Split, dev: Split, seed: int) -> dict:
    """Fine-tune from `args.model` once with `seed`; dev metrics after the last epoch."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    regression = spec.labels is None
    torch.manual_seed(seed)
    hf_logging.set_verbosity_error()  # the "pooler/classifier newly initialised" report is expected
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model,
        num_labels=1 if regression else len(spec.labels),
        problem_type="regression" if regression else "single_label_classification",
    ).to(args.device)
    train_features = _encode(tokenizer, train, args.max_length)
    dev_features = _encode(tokenizer, dev, args.max_length)

    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr
    )
    steps_per_epoch = math.ceil(len(train_features) / args.batch_size)
    total = steps_per_epoch * args.epochs
    scheduler = linear_schedule(optimizer, int(args.warmup_ratio * total), total)
    generator = torch.Generator().manual_seed(seed)

    started = time.perf_counter()
    losses: list[float] = []
    for _ in range(args.epochs):
        model.train()
        order = torch.randperm(len(train_features), generator=generator).tolist()
        for batch, labels in _batches(train_features, train.labels, order, args.batch_size, tokenizer, regression):
            batch = {k: v.to(args.device) for k, v in batch.items()}
            loss = model(**batch, labels=labels.to(args.device)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))

    model.eval()
    outputs = []
    with torch.no_grad():
        dev_order = range(len(dev_features))
        for batch, _ in _batches(dev_features, dev.labels, dev_order, args.batch_size, tokenizer, regression):
            logits = model(**{k: v.to(args.device) for k, v in batch.items()}).logits.float().cpu()
            outputs.append(logits.squeeze(-1) if regression else logits.argmax(-1))
    predictions = torch.cat(outputs).numpy()
    metrics = task_metrics(spec, predictions, np.asarray(dev.labels))
    tail = losses[-steps_per_epoch:] or [float("nan")]
    return {
        "seed": seed,
        "metrics": metrics,
        "final_epoch_train_loss": sum(tail) / len(tail),
        "train_seconds": round(time.perf_counter() - started, 2),
    }


def summarise(runs: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
    """Mean and sample standard deviation (0 for a single seed) of every metric over seeds."""
    names = runs[0]["metrics"].keys()
    mean = {n: statistics.fmean(r["metrics"][n] for r in runs) for n in names}
    std = {n: statistics.stdev([r["metrics"][n] for r in runs]) if len(runs) > 1 else 0.0 for n in names}
    return mean, std


def finetune(args: argparse.Namespace) -> dict:
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {model_dir}: no config.json (convert a checkpoint with pipeline.export.convert first)"
        )
    spec, train, dev = resolve_task(
        args.task_dir, args.task, args.text_cols, args.label_col, args.train_file, args.dev_file
    )
    runs = [run_seed(args, spec, train, dev, seed) for seed in args.seeds]
    mean, std = summarise(runs)
    return {
        "model": str(model_dir),
        "task_dir": str(args.task_dir),
        "task": args.task,
        "problem": "regression" if spec.labels is None else "classification",
        "text_cols": list(spec.text_cols),
        "label_col": spec.label_col,
        "labels": list(spec.labels) if spec.labels else None,
        "metric": spec.metrics[0],
        "n_train": len(train.labels),
        "n_dev": len(dev.labels),
        "hyperparameters": {
            k: getattr(args, k)
            for k in ("lr", "epochs", "batch_size", "max_length", "weight_decay", "warmup_ratio", "max_grad_norm")
        },
        "seeds": list(args.seeds),
        "runs": runs,
        "mean": mean,
        "std": std,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.eval.finetune", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="converted Hugging Face model dir (pipeline.export.convert output)")
    p.add_argument("--task-dir", required=True, help="GLUE-format dir with train.tsv and dev.tsv (header row)")
    p.add_argument("--task", default="generic", choices=TASK_CHOICES, help="GLUE task (columns, labels, metric)")
    p.add_argument(
        "--text-cols", nargs="+", default=None, help="one or two text columns (default: from --task / detected)"
    )
    p.add_argument("--label-col", default=None, help="label column (default: from --task / detected)")
    p.add_argument("--train-file", default="train.tsv")
    p.add_argument("--dev-file", default="dev.tsv", help="e.g. dev_matched.tsv for MNLI")
    p.add_argument("--seeds", type=int, nargs="+", default=[1], help="one fine-tuning run per seed")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    p.add_argument("--output", default=None, help="also write the JSON result to this file")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("lr", "epochs", "batch_size", "max_length"):
        if getattr(args, flag) <= 0:
            print(f"error: --{flag.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    previous_threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)  # small models on a shared CPU: more threads can be far slower
    try:
        result = finetune(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(previous_threads)
    text = json.dumps(result, indent=2)
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        tmp.write_text(text + "\n")
        os.replace(tmp, out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
