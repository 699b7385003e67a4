"""`python -m pipeline.eval.finetune --model DIR --task-dir DIR`: GLUE-style fine-tuning of a converted model.

A plain torch loop around `AutoModelForSequenceClassification` (CPU is fine for small tasks):
AdamW, linear warm-up then linear decay, dynamic padding per batch, one run per seed. The dev
metrics after the last epoch are reported (no checkpoint selection on dev, so the number is not
tuned on the data it is measured on). Output: a table for a person on stdout (`pipeline.eval.finetune_report`:
per metric the mean over seeds with its 95% Student-t interval, the random-init baseline and the gain with
Welch's interval, one verdict line); `--json` prints the JSON record instead and `--output` writes it
(atomically): every seed's metrics and, per metric, the mean, the sample standard deviation and the interval
over seeds (`pipeline.stats`). A metric with no value on its predictions (`pipeline.eval.metrics`: a Matthews correlation
of predictions that are all one class, a correlation of constant scores, a spread of one seed) is
`null`, never a number, and an `undefined` entry beside it says why.

What pretraining bought: `--random-init` fine-tunes, with the same seeds, data and
hyperparameters, a randomly initialised model of the same configuration (`from_config`) as well,
and reports its metrics (`random_init`), the difference of the means (`pretraining_gain`) and its Welch
interval (`pretraining_gain_interval`).
`--train-subset N` trains on N examples drawn once (`--subset-seed`), the same for every seed and
both models. Predictions of every evaluated split (dev, and each `--eval-file`) are written, one
TSV per model, seed and split, to `--predictions DIR` (default: beside `--output`);
`--save-model DIR` keeps the fine-tuned model and tokenizer. Every file is written atomically.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from pipeline.eval.glue import TASK_CHOICES, Split, TaskSpec, load_eval_file, resolve_task, subset_split, task_metrics
from pipeline.eval.finetune_report import render
from pipeline.eval.json_cli import run_json_command
from pipeline.io import write_atomic
from pipeline.stats import difference_ci, mean_ci

PRETRAINED, RANDOM_INIT = "pretrained", "random_init"
CONFIDENCE = 0.95  # of every interval over seeds
#: Tokens per example unless `--max-length` says otherwise (capped by the model's positions).
DEFAULT_MAX_LENGTH = 128


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


def _model(args: argparse.Namespace, spec: TaskSpec, random_init: bool):
    """The model to fine-tune: the converted one, or (`random_init`) a random one of its configuration."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    regression = spec.labels is None
    options = dict(num_labels=1 if regression else len(spec.labels),
                   problem_type="regression" if regression else "single_label_classification")
    if random_init:
        return AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(args.model, **options))
    return AutoModelForSequenceClassification.from_pretrained(args.model, **options)


@torch.no_grad()
def predict(model, features: list[dict], batch_size: int, tokenizer, regression: bool, device: str) -> np.ndarray:
    """Class indices (classification) or scores (regression) for `features`, in order."""
    model.eval()
    outputs = []
    dummy = [0.0] * len(features)
    for batch, _ in _batches(features, dummy, range(len(features)), batch_size, tokenizer, True):
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits.float().cpu()
        outputs.append(logits.squeeze(-1) if regression else logits.argmax(-1))
    return torch.cat(outputs).numpy() if outputs else np.zeros(0)


def run_seed(args: argparse.Namespace, spec: TaskSpec, train: Split, splits: dict[str, Split], seed: int,
             random_init: bool = False) -> tuple[dict, object, dict[str, np.ndarray]]:
    """Fine-tune once with `seed` (from `args.model`, or a random model of its configuration);
    (record with the dev metrics after the last epoch, the model, predictions per split)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    regression = spec.labels is None
    torch.manual_seed(seed)
    hf_logging.set_verbosity_error()  # the "pooler/classifier newly initialised" report is expected
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = _model(args, spec, random_init).to(args.device)
    train_features = _encode(tokenizer, train, args.max_length)

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
    train_seconds = time.perf_counter() - started

    predictions = {name: predict(model, _encode(tokenizer, split, args.max_length), args.batch_size, tokenizer,
                                 regression, args.device) for name, split in splits.items()}
    scored = {name: task_metrics(spec, predictions[name], np.asarray(split.labels))
              for name, split in splits.items() if split.labels is not None}
    tail = losses[-steps_per_epoch:] or [float("nan")]
    dev_metrics, dev_undefined = scored.pop("dev")
    record = {
        "seed": seed,
        "metrics": dev_metrics,
        "final_epoch_train_loss": sum(tail) / len(tail),
        "train_seconds": round(train_seconds, 2),
    }
    if dev_undefined:  # a metric with no value on these predictions: null above, and why here
        record["undefined"] = dev_undefined
    if scored:
        record["eval_file_metrics"] = {name: values for name, (values, _) in scored.items()}
        undefined = {name: why for name, (_, why) in scored.items() if why}
        if undefined:
            record["eval_file_undefined"] = undefined
    return record, (model, tokenizer), predictions


def summarise(runs: list[dict]) -> tuple[dict[str, Optional[float]], dict[str, Optional[float]], dict[str, str]]:
    """(mean, sample standard deviation, why undefined) of every metric over seeds. A mean is undefined
    (None) when the metric is undefined on any seed; a standard deviation also with a single seed (n - 1 = 0)."""
    names = runs[0]["metrics"].keys()
    mean: dict[str, Optional[float]] = {}
    std: dict[str, Optional[float]] = {}
    undefined: dict[str, str] = {}
    for name in names:
        values = [r["metrics"][name] for r in runs]
        missing = [str(r["seed"]) for r in runs if r["metrics"][name] is None]
        if missing:
            mean[name] = std[name] = None
            undefined[name] = f"undefined on seed(s) {', '.join(missing)} (their `undefined` says why)"
            continue
        mean[name] = statistics.fmean(values)
        std[name] = statistics.stdev(values) if len(values) > 1 else None
    if len(runs) == 1:
        undefined["std"] = "one seed: a sample standard deviation needs two"
        undefined["interval"] = "one seed: an interval over seeds needs two"
    return mean, std, undefined


def difference(a: dict[str, Optional[float]], b: dict[str, Optional[float]]) -> dict[str, Optional[float]]:
    """a - b per metric; None where either is undefined."""
    return {k: None if a[k] is None or b.get(k) is None else a[k] - b[k] for k in a}


def _bounds(ci: dict) -> Optional[list[float]]:
    return None if ci["lo"] is None else [ci["lo"], ci["hi"]]


def intervals(runs: list[dict], mean: dict[str, Optional[float]]) -> dict[str, Optional[list[float]]]:
    """Each metric's `CONFIDENCE` Student-t interval of the mean over seeds (`pipeline.stats.mean_ci`:
    mean +- t_{(1+c)/2, n-1} s / sqrt(n)); None where the mean is undefined or with one seed (`summarise`
    already says why). Seeds vary the fine-tuning only: the interval covers that spread, not pretraining's."""
    return {name: None if mean[name] is None else _bounds(mean_ci([r["metrics"][name] for r in runs], CONFIDENCE))
            for name in mean}


def gain_intervals(runs: list[dict], baseline: list[dict],
                   gain: dict[str, Optional[float]]) -> dict[str, Optional[list[float]]]:
    """Welch's `CONFIDENCE` interval of pretrained minus random-init means per metric
    (`pipeline.stats.difference_ci`); None where the gain is undefined or either side has one seed."""
    return {name: None if gain[name] is None else _bounds(difference_ci(
        [r["metrics"][name] for r in runs], [r["metrics"][name] for r in baseline], CONFIDENCE)) for name in gain}


def prediction_tsv(spec: TaskSpec, split: Split, predictions: np.ndarray) -> str:
    """`index<TAB>prediction[<TAB>label]`: label names for classification, scores for regression."""
    def show(value) -> str:
        return f"{float(value):.6g}" if spec.labels is None else spec.labels[int(value)]

    header = ["index", "prediction"] + (["label"] if split.labels is not None else [])
    lines = ["\t".join(header)]
    for i, (row, value) in enumerate(zip(split.ids(), predictions)):
        lines.append("\t".join([row, show(value)] + ([show(split.labels[i])] if split.labels is not None else [])))
    return "\n".join(lines) + "\n"


def save_model(model_and_tokenizer, directory: Path) -> None:
    """`save_pretrained` into a temporary sibling, renamed to `directory` when complete."""
    model, tokenizer = model_and_tokenizer
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if directory.exists():
            directory.rmdir()  # checked empty before training
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _outputs(args: argparse.Namespace) -> tuple[Optional[Path], Optional[Path]]:
    """(predictions dir, save-model dir), checked before any training."""
    predictions = Path(args.predictions) if args.predictions else (
        Path(args.output).with_suffix(".predictions") if args.output else None)
    save = Path(args.save_model) if args.save_model else None
    if save is not None and save.exists() and (not save.is_dir() or any(save.iterdir())):
        raise FileExistsError(f"--save-model {save}: exists and is not an empty directory")
    return predictions, save


def resolve_max_length(requested: Optional[int], model_dir: Path) -> int:
    """`--max-length`: given, it must fit the model's position table; unset, 128 or the model's
    `max_position_embeddings` when that is shorter (a model pretrained on 64-token shards has only
    64 positions, and a longer input would fail deep inside the forward pass)."""
    limit = int(json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 512))
    if requested is None:
        return min(DEFAULT_MAX_LENGTH, limit)
    if requested > limit:
        raise ValueError(f"--max-length {requested}: the model in {model_dir} has max_position_embeddings "
                         f"{limit}; use --max-length {limit} or less")
    return requested


def check_model_dir(model_dir: Path, train: Split) -> None:
    """Before any training: the weights are readable (a truncated `model.safetensors` is named, not
    a safetensors traceback: `warm_start.read_weight_shapes`), the directory's tokenizer is the one it
    was converted with (`tokenizer_checks.converted_tokenizer_problem`) and can represent the task's
    text (`pipeline.tokenizer_checks`: a directory without tokenizer files loads as a 5-token
    placeholder that maps every word to [UNK], and the accuracy would be meaningless)."""
    from transformers import AutoTokenizer

    from pipeline.model.warm_start import read_weight_shapes
    from pipeline.tokenizer_checks import SAMPLE_DOCUMENTS, converted_tokenizer_problem, coverage_problem, unknown_share

    swapped = converted_tokenizer_problem(model_dir, "--model")
    if swapped:
        raise ValueError(f"{swapped}; nothing was trained")
    read_weight_shapes(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as err:  # transformers raises many types for an unusable directory
        raise ValueError(f"--model {model_dir}: no tokenizer loadable ({type(err).__name__}: {err})") from err
    texts = [text for row in train.texts[:SAMPLE_DOCUMENTS] for text in row if text]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    share, tokens = unknown_share(ids, tokenizer.unk_token_id)
    problem = coverage_problem(model_dir, len(tokenizer), share, tokens,
                               f"the first {min(len(train.texts), SAMPLE_DOCUMENTS)} training examples")
    if problem:
        raise ValueError(f"--model {problem}; nothing was trained")


def finetune(args: argparse.Namespace) -> dict:
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {model_dir}: no config.json (convert a checkpoint with pipeline.export.convert first)"
        )
    args.max_length = resolve_max_length(args.max_length, model_dir)
    predictions_dir, save_dir = _outputs(args)
    spec, train, dev = resolve_task(
        args.task_dir, args.task, args.text_cols, args.label_col, args.train_file, args.dev_file
    )
    check_model_dir(model_dir, train)
    n_available = len(train.texts)
    if args.train_subset is not None:
        train = subset_split(train, args.train_subset, args.subset_seed)
    splits = {"dev": dev, **{Path(f).stem: load_eval_file(args.task_dir, f, spec, args.task) for f in args.eval_file}}
    variants = [PRETRAINED] + ([RANDOM_INIT] if args.random_init else [])
    results: dict[str, list[dict]] = {}
    files: list[str] = []
    for variant in variants:
        results[variant] = []
        for seed in args.seeds:
            record, trained, predictions = run_seed(args, spec, train, splits, seed, random_init=variant == RANDOM_INIT)
            results[variant].append(record)
            if predictions_dir is not None:
                for name, split in splits.items():
                    path = predictions_dir / variant / f"seed_{seed}" / f"{name}.tsv"
                    write_atomic(path, prediction_tsv(spec, split, predictions[name]), shared=True, parents=True)
                    files.append(str(path))
            if save_dir is not None and variant == PRETRAINED:
                save_model(trained, save_dir if len(args.seeds) == 1 else save_dir / f"seed_{seed}")
    mean, std, undefined = summarise(results[PRETRAINED])
    out = {
        "model": str(model_dir),
        "task_dir": str(args.task_dir),
        "task": args.task,
        "problem": "regression" if spec.labels is None else "classification",
        "text_cols": list(spec.text_cols),
        "label_col": spec.label_col,
        "labels": list(spec.labels) if spec.labels else None,
        "metric": spec.metrics[0],
        "n_train": len(train.labels),
        "n_train_available": n_available,
        "train_subset": args.train_subset,
        "subset_seed": args.subset_seed if args.train_subset is not None else None,
        "n_dev": len(dev.labels),
        "hyperparameters": {
            k: getattr(args, k)
            for k in ("lr", "epochs", "batch_size", "max_length", "weight_decay", "warmup_ratio", "max_grad_norm")
        },
        "seeds": list(args.seeds),
        "runs": results[PRETRAINED],
        "mean": mean,
        "std": std,
        "confidence": CONFIDENCE,
        "interval": intervals(results[PRETRAINED], mean),
        **({"undefined": undefined} if undefined else {}),
        "prediction_files": files,
        "saved_model": str(save_dir) if save_dir is not None else None,
    }
    if args.random_init:
        r_mean, r_std, r_undefined = summarise(results[RANDOM_INIT])
        out["random_init"] = {"runs": results[RANDOM_INIT], "mean": r_mean, "std": r_std,
                              "interval": intervals(results[RANDOM_INIT], r_mean),
                              **({"undefined": r_undefined} if r_undefined else {})}
        out["pretraining_gain"] = difference(mean, r_mean)
        out["pretraining_gain_interval"] = gain_intervals(results[PRETRAINED], results[RANDOM_INIT],
                                                          out["pretraining_gain"])
    return out


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
    p.add_argument("--max-length", type=int, default=None,
                   help=f"tokens per example (default: {DEFAULT_MAX_LENGTH}, or the model's max_position_embeddings "
                        "when shorter)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    p.add_argument("--output", default=None, help="also write the JSON result to this file")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    p.add_argument("--train-subset", type=int, default=None, metavar="N",
                   help="train on N examples drawn once with --subset-seed (the same for every seed and model)")
    p.add_argument("--subset-seed", type=int, default=0)
    p.add_argument("--eval-file", nargs="+", default=[], metavar="FILE",
                   help="further files of the task dir to predict (e.g. test.tsv); scored when labelled")
    p.add_argument("--predictions", default=None, metavar="DIR",
                   help="prediction TSVs: DIR/<model>/seed_<seed>/<split>.tsv (default: OUTPUT with .predictions "
                        "instead of its suffix, when --output is given)")
    p.add_argument("--save-model", default=None, metavar="DIR",
                   help="save the fine-tuned model and tokenizer (several seeds: DIR/seed_<seed>)")
    p.add_argument("--random-init", action="store_true",
                   help="also fine-tune a randomly initialised model of the same configuration (a baseline)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("lr", "epochs", "batch_size", "max_length", "train_subset"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            print(f"error: --{flag.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    return run_json_command(lambda: finetune(args), args.threads, args.output,
                            (FileNotFoundError, FileExistsError, ValueError), render=None if args.json else render)


if __name__ == "__main__":
    sys.exit(main())
