"""`python -m demo.run [--objective taco] [--out DIR] [--corpus PATH ...]`: the whole pipeline, small.

The front door: on a fresh machine with no network and two CPU cores it runs, in a few minutes,

    real text -> tokenizer -> shards -> pretraining (DeepSpeed, chosen objective) -> Hugging Face
    -> fill-mask with `transformers.pipeline`

and prints where every artefact went and the equivalent command of every stage, so the next step
(a bigger corpus, a paper preset, a GPU) is a matter of changing arguments.

The default corpus is this Python installation's own documentation (`demo.corpus`):
real English prose that needs no download. `--corpus` uses the user's files or folders instead.
One document in ten is held out by the shards stage (`build_shards(holdout_fraction=0.1)`, by document,
`data_prep.holdout`) into `shards/validation`, the run's `eval.shards_dir`: validation during training
(`pipeline.train.validation`) measures the held-out masked-LM accuracy every `--steps // 5` steps, and
the outcome stage reports its last record; a default corpus too small for one evaluation batch of
held-out rows is an error before any training.
The model is the `tiny-<objective>` preset widened to hidden 128 / 4 layers, trained for 1000
steps of 32 sequences of 128 tokens on an 8k WordPiece vocabulary (about 4 minutes on two idle
cores); enough for the fill-mask output to start depending on the context, not a useful model.

Re-running is safe: the demo only ever deletes what it wrote itself, and refuses a non-empty
`--out` directory that it did not create (its marker, `demo.json`, is written first).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from pipeline.io import write_atomic

#: Written last into `--out`; its presence says "this directory is the demo's, safe to clear".
SUMMARY_FILE = "demo.json"
STAGE_ENTRIES = ("corpus.txt", "tokenizer", "shards", "runs", "hf", "heldout", "outcome.json")  # heldout: older demos'
STAGE_COUNT = 7
#: Lines of the training log shown although DeepSpeed tags them [INFO]/[WARNING]: its op builds.
BUILD_LINE = re.compile(r"(?i)building extension|loading extension|built successfully|ninja|compil")
DEFAULT_PROMPTS = (
    "The [MASK] is installed with pip.",
    "Returns True if the string is [MASK].",
    "If the file does not exist, an [MASK] is raised.",
)
#: ~4 minutes on two idle CPU cores (0.22 s/step). Measured on the default corpus with TACO at the earlier
#: lr 2e-3: at 300 steps the model predicts only frequent tokens ("the", "."); from ~1000 steps the
#: predictions start to depend on the context ("true", "none" for "Returns True if the string is
#: [MASK]."); at 3000 steps (11 min) they are good ("module, library, package" for "The [MASK] is
#: installed with pip."). At today's lr 1e-3 MLM's top predictions after 1000 steps are still frequent
#: tokens ("the", "."); longer runs were not measured at 1e-3.
DEFAULT_STEPS = 1000
#: Share of the documents held out into the validation shard set (`data_prep.holdout`, by document).
HOLDOUT_FRACTION = 0.1
#: Micro-batches of 32 held-out sequences per evaluation (`eval.batches`): 256 rows, as many as the earlier
#: post-conversion measurement used.
EVAL_BATCHES = 8
#: Evaluations per run (`eval.every` = steps // this; plus the last step).
EVALUATIONS = 5
#: Model and run overrides applied on top of the `tiny-<objective>` preset (see module docstring).
DEMO_OVERRIDES = (
    "model.num_layers=4", "model.hidden_size=128", "model.num_heads=4", "model.ffn_size=512",
    "model.dropout=0.0", "model.attention_dropout=0.0",  # a few hundred steps: regularisation only slows learning
    # Output biases start at the corpus's log unigram frequencies: with zero biases the quickest early
    # loss drop is to turn every token's state toward the frequency distribution (issue 15 saw MLM collapse
    # that way).
    "model.mlm_bias_init=unigram",
    "data.global_batch_size=32", "data.micro_batch_size=32",
    # 1e-3, not 2e-3: at 2e-3 CAPT collapsed by step 225 even with the unigram bias start (every token's
    # state the same vector, for good); at 1e-3 it did not, and MLM stays healthy
    # (benchmarks/results/demo_health.md, demo_health_lr2e-3.md).
    "optim.lr=1e-3", "train.log_every=25", "train.keep_last=1", "train.progress_bar=false",
    "train.deterministic=false",
)


def demo_objectives() -> list[str]:
    """Objectives with a `tiny-<objective>` preset (what the demo can run)."""
    from pipeline.config.loader import available_presets

    return sorted(p[len("tiny-"):] for p in available_presets() if p.startswith("tiny-"))


def prepare_out_dir(out: Path) -> None:
    """Create `out`, or clear the demo's own entries from a previous demo run; refuse anything else."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not (out / SUMMARY_FILE).is_file():
            raise FileExistsError(f"--out {out}: not empty and not a previous demo output (no {SUMMARY_FILE}); "
                                  "choose another --out")
        for name in (*STAGE_ENTRIES, SUMMARY_FILE):
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    write_summary(out, {"status": "running"})  # the marker first: a crashed run's output is still ours


def write_summary(out: Path, summary: dict) -> None:
    write_atomic(out / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")


def command_line(module: str, *args: object) -> str:
    """The shell command equivalent to a stage (printed, so the user can re-run or scale it)."""
    return shlex.join(["python", "-m", module, *map(str, args)])


class Stages:
    """Prints each stage's banner, equivalent command and wall time; collects them for `demo.json`, which
    says at every stage's start which stage is running, and after a failure which one failed and why."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.commands: dict[str, str] = {}
        self._start = 0.0
        self._name = "setup"
        self.out: Optional[Path] = None  # set once `demo.json` is ours (`prepare_out_dir`)
        self.record: dict = {}  # what demo.json says besides the stages (objective, corpus, ...)

    def progress(self, status: str, **extra: object) -> None:
        if self.out is not None:
            write_summary(self.out, {"status": status, "stage": self._name, **self.record,
                                     "stage_seconds": self.times, "commands": self.commands, **extra})

    def begin(self, name: str, title: str, command: Optional[str] = None) -> None:
        self._name, self._start = name, time.perf_counter()
        print(f"\n== [{len(self.times) + 1}/{STAGE_COUNT}] {title}", flush=True)
        if command:
            self.commands[name] = command
            print(f"   $ {command}", flush=True)
        self.progress("running")

    def end(self, detail: str = "") -> None:
        self.times[self._name] = round(time.perf_counter() - self._start, 1)
        print(f"   done in {self.times[self._name]:.1f}s{': ' + detail if detail else ''}", flush=True)

    def fail(self, error: BaseException) -> None:
        """`demo.json` says the demo failed, at which stage and with what error (`demo.outcome` reads it)."""
        self.progress("failed", error=f"{type(error).__name__}: {error}")


def shown_live(line: str) -> bool:
    """Whether a line of the training log is echoed to the console: DeepSpeed's [INFO] / [WARNING] CPU
    chatter goes to the log only, except its op-build lines (`BUILD_LINE`), which end the start's one
    long silence."""
    return ("[WARNING]" not in line and "[INFO]" not in line) or BUILD_LINE.search(line) is not None


def run_training(preset: str, overrides: Sequence[str], log_path: Path) -> None:
    """`python -m pipeline.train` in a child process (its own DeepSpeed/distributed state), output shown
    live and kept in `log_path`; a non-zero exit stops the demo with the log's tail."""
    cmd = [sys.executable, "-m", "pipeline.train", "--config", preset, *overrides]
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if shown_live(line):
                sys.stdout.write("   | " + line)
                sys.stdout.flush()
        code = proc.wait()
    if code != 0:
        raise RuntimeError(f"pipeline.train exited with {code}; full log: {log_path}")


def startup_note() -> str:
    """What the quiet start of the training process does. The demo trains in one process, which needs none of
    DeepSpeed's C++ ops (`pipeline.distributed.cpu_comm_op`: the shared-memory all-reduce is for several CPU
    ranks), so nothing is compiled."""
    return ("starting: imports, config and data checks, the DeepSpeed engine (one process: no C++ op to compile), "
            "then step 1")


def build_demo_shards(corpus: Path, tok_dir: Path, shards: Path, args: argparse.Namespace,
                      num_proc: int) -> tuple:
    """The training shards and, one document in `1 / HOLDOUT_FRACTION` held out (`data_prep.holdout`), the
    validation set `shards/validation`: (training manifest, held-out record or None). A held-out set under one
    evaluation batch (32 sequences) is an error for the default corpus; a user's small corpus is then
    rebuilt whole and trained on without validation."""
    from data_prep.build_shards import build_shards
    from data_prep.holdout import DEFAULT_SUBDIR, EmptySide
    from pipeline.data.shards import read_manifest

    options = dict(seq_len=args.seq_len, num_proc=num_proc, progress=False)
    held_dir = shards / DEFAULT_SUBDIR
    try:
        manifest = build_shards([str(corpus)], tok_dir, shards, holdout_fraction=HOLDOUT_FRACTION, **options)
        held_sequences = read_manifest(held_dir).total_sequences
    except EmptySide as err:  # no document held out at all (a corpus of a few documents): as a held-out set too small
        if err.side != "validation":
            raise
        manifest, held_sequences = None, 0
    if held_sequences >= 32:
        held = read_manifest(held_dir)
        return manifest, {"path": str(held_dir), "sequences": held.total_sequences, "tokens": held.total_tokens,
                          "documents": int(held.stats.get("documents", 0))}
    if not args.corpus:
        raise ValueError(f"the corpus of this Python installation's documentation (--max-corpus-mb "
                         f"{args.max_corpus_mb:g}) is too small to train on and hold out one document in "
                         f"{round(1 / HOLDOUT_FRACTION)} with at least one evaluation batch (32 sequences; "
                         f"{held_sequences} held out); give the demo more text with --corpus PATH (files or "
                         "folders)" + ("" if args.max_corpus_mb >= 4 else " or raise --max-corpus-mb"))
    shutil.rmtree(shards, ignore_errors=True)
    return build_shards([str(corpus)], tok_dir, shards, **options), None


def fill_mask(model_dir: Path, prompts: Sequence[str], top_k: int = 5) -> list[dict]:
    """Top-k predictions of the converted model for each prompt (`[MASK]` = the tokenizer's mask token)."""
    from transformers import pipeline
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    unmasker = pipeline("fill-mask", model=str(model_dir), tokenizer=str(model_dir), device=-1)
    mask = unmasker.tokenizer.mask_token
    results = []
    for prompt in prompts:
        text = prompt.replace("[MASK]", mask)
        predictions = unmasker(text, top_k=top_k)
        results.append({"prompt": prompt, "predictions": [
            {"token": p["token_str"].strip(), "score": round(float(p["score"]), 4)} for p in predictions]})
    return results


def run_demo(args: argparse.Namespace, stages: Optional[Stages] = None) -> dict:
    from data_prep.train_tokenizer import train_tokenizer
    from pipeline.export.convert import convert
    from demo.corpus import build_demo_corpus
    from pipeline.train.metrics import read_jsonl
    from pipeline.train.validation import is_validation_record

    objectives = demo_objectives()
    if args.objective not in objectives:
        raise ValueError(f"--objective {args.objective!r}: choose one of {objectives}")
    for prompt in args.prompt:
        if "[MASK]" not in prompt:
            raise ValueError(f"--prompt {prompt!r}: must contain [MASK]")
    out = Path(args.out).resolve()
    prepare_out_dir(out)
    corpus, tok_dir, shards = out / "corpus.txt", out / "tokenizer", out / "shards"
    run_dir, hf_dir = out / "runs" / args.objective, out / "hf" / args.objective
    stages = stages if stages is not None else Stages()
    stages.out, stages.record = out, {"objective": args.objective, "seq_len": args.seq_len}
    started = time.perf_counter()

    source = " ".join(map(str, args.corpus)) or "this Python installation's documentation"
    stages.begin("corpus", f"corpus: real text from {source}",
                 command_line("demo.corpus", corpus, *(["--corpus", *args.corpus] if args.corpus else []),
                              "--max-mb", args.max_corpus_mb))
    stats = build_demo_corpus(corpus, args.corpus, int(args.max_corpus_mb * 1e6))
    stages.record["corpus"] = {**stats.as_json(), "heldout": None}
    stages.end(stats.summary())

    stages.begin("tokenizer", f"tokenizer: WordPiece, {args.vocab_size} entries",
                 command_line("data_prep.train_tokenizer", "--input", corpus, "--out", tok_dir,
                              "--vocab-size", args.vocab_size))
    train_tokenizer([str(corpus)], tok_dir, vocab_size=args.vocab_size, progress=False)
    stages.end(str(tok_dir))

    num_proc = min(2, os.cpu_count() or 1)
    stages.begin("shards", f"shards: {args.seq_len}-token sequences, one document in "
                 f"{round(1 / HOLDOUT_FRACTION)} held out into a validation set",
                 command_line("data_prep.build_shards", "--input", corpus, "--tokenizer", tok_dir,
                              "--seq-len", args.seq_len, "--out", shards, "--num-proc", num_proc,
                              "--holdout-fraction", HOLDOUT_FRACTION))
    manifest, held = build_demo_shards(corpus, tok_dir, shards, args, num_proc)
    stages.record["corpus"]["heldout"] = held
    stages.end(f"{manifest.total_sequences:,} sequences, {manifest.total_tokens:,} tokens in {shards}" +
               (f"; held out {held['sequences']:,} sequences ({held['documents']} documents) in {held['path']}"
                if held else "; nothing held out (corpus too small for one evaluation batch: all of it trained on)"))

    preset = f"tiny-{args.objective}"
    overrides = [f"data.shards_dir={shards}", f"train.output_dir={run_dir}", *DEMO_OVERRIDES,
                 f"train.total_steps={args.steps}", f"train.checkpoint_every={args.steps}",
                 f"optim.warmup_steps={max(1, args.steps // 10)}", f"train.seed={args.seed}"]
    if held:  # validation during training: the outcome's held-out numbers (pipeline.train.validation)
        overrides += [f"eval.shards_dir={held['path']}", f"eval.every={max(1, args.steps // EVALUATIONS)}",
                      f"eval.batches={EVAL_BATCHES}"]
    stages.record["training"] = {"preset": preset, "overrides": overrides, "run_dir": str(run_dir)}
    stages.begin("pretrain", f"pretraining: {args.objective}, {args.steps} steps (DeepSpeed, CPU)",
                 command_line("pipeline.train", "--config", preset, *overrides))
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"   {startup_note()}", flush=True)
    run_training(preset, overrides, run_dir / "train.log")
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if not is_validation_record(r)]
    last, val = (steps[-1] if steps else {}), next((r for r in reversed(records) if is_validation_record(r)), {})
    stages.end((f"final loss {last.get('loss', float('nan')):.3f}, MLM accuracy "
                f"{last.get('mlm/accuracy', last.get('electra/gen_accuracy', float('nan'))):.3f}" if last else "") +
               (f"; held-out (val/) loss {val.get('val/loss', float('nan')):.3f}" if val else ""))

    # ELECTRA's main model is a discriminator; its masked LM is the generator, written beside it
    generator = args.objective == "electra"
    stages.begin("convert", "conversion to Hugging Face", command_line("pipeline.export.convert", run_dir, hf_dir,
                                                                       *(["--with-generator"] if generator else [])))
    convert(run_dir, hf_dir, overwrite=True, with_generator=generator)
    stages.end(str(hf_dir))

    stages.begin("fill_mask", "fill-mask with transformers.pipeline('fill-mask') on the converted model"
                 + (" (ELECTRA: its generator)" if generator else ""))
    predictions = fill_mask(hf_dir / "generator" if generator else hf_dir, args.prompt or DEFAULT_PROMPTS)
    stages.end()
    for item in predictions:
        print(f"   {item['prompt']}")
        print("      -> " + ", ".join(f"{p['token']} ({p['score']:.3f})" for p in item["predictions"]))

    stages.begin("outcome", "outcome: the checkpoint against a random-init model on held-out text (docs/demo.md)",
                 shlex.join(["python", "-m", "demo.outcome", str(out)]))
    outcome = None
    if not held:
        stages.end(f"skipped: --corpus too small to hold out one evaluation batch ({stats.documents} documents, "
                   f"{stats.bytes / 1e6:.2f} MB; all of it trained on)")
    else:
        from demo.outcome import outcome as measure_outcome, report_lines, write_outcome

        outcome = measure_outcome(out, hf_dir, run_dir, preset, overrides)
        write_outcome(out, outcome)
        stages.end()
        print("\n".join("   " + line for line in report_lines(outcome)))

    summary = {
        "status": "done",
        "objective": args.objective,
        "total_seconds": round(time.perf_counter() - started, 1),
        "stage_seconds": stages.times,
        "commands": stages.commands,
        "paths": {"corpus": str(corpus), "tokenizer": str(tok_dir), "shards": str(shards), "run": str(run_dir),
                  "metrics": str(run_dir / "metrics.jsonl"), "tensorboard": str(run_dir / "tb"),
                  "checkpoints": str(run_dir / "checkpoints"), "train_log": str(run_dir / "train.log"),
                  "hf_model": str(hf_dir)},
        "seq_len": args.seq_len,
        "corpus": stages.record["corpus"],
        "final_metrics": {k: v for k, v in last.items() if k in ("step", "loss", "mlm/loss", "mlm/accuracy",
                                                                 "electra/gen_accuracy", "tokens_seen", "tokens_per_s")},
        "final_validation": val,
        "training": stages.record["training"],
        "fill_mask": predictions,
        "outcome": outcome,
        "epochs": round(args.steps * 32 / max(1, manifest.total_sequences), 2),
    }
    write_summary(out, summary)
    return summary


def print_summary(summary: dict) -> None:
    paths = summary["paths"]
    print(f"\nDemo finished in {summary['total_seconds']:.0f}s. Where everything went:")
    for label, key in (("corpus", "corpus"), ("tokenizer", "tokenizer"), ("shards + manifest", "shards"),
                       ("training run", "run"), ("  metrics", "metrics"), ("  TensorBoard", "tensorboard"),
                       ("  checkpoints", "checkpoints"), ("  training log", "train_log"),
                       ("Hugging Face model", "hf_model")):
        print(f"  {label:<20} {paths[key]}")
    print(f"  {'summary':<20} {Path(paths['run']).parent.parent / SUMMARY_FILE}")
    corpus, held = summary["corpus"], summary["corpus"].get("heldout")
    trained = corpus["documents"] - (held["documents"] if held else 0)
    print(f"\nTrained on {trained} of the corpus's {corpus['documents']} documents "
          f"({corpus['bytes'] / 1e6:.2f} MB); " +
          (f"held out {held['documents']} documents ({held['sequences']:,} sequences) in {held['path']}, "
           "validated during training (val/* in metrics.jsonl) and reported in outcome.json"
           if held else "nothing held out (corpus too small to split)"))
    print("\nLoad it anywhere:\n  from transformers import pipeline\n"
          f"  pipeline('fill-mask', model='{paths['hf_model']}')('...[MASK]...')")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m demo.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--objective", default="taco", help="objective to pretrain with (any with a tiny-<objective> preset)")
    p.add_argument("--out", default="demo_output", help="output directory (re-runs clear only the demo's own files)")
    p.add_argument("--corpus", nargs="+", default=[], metavar="PATH",
                   help="text files or folders to train on instead of the installed documentation")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="pretraining steps (32 sequences of --seq-len each)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-corpus-mb", type=float, default=4.0, help="cap on the corpus size")
    p.add_argument("--prompt", action="append", default=[], help="a fill-mask prompt with [MASK] (repeatable)")
    p.add_argument("--seed", type=int, default=1234)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("steps", "vocab_size", "seq_len", "max_corpus_mb"):
        if getattr(args, flag) <= 0:
            print(f"error: --{flag.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")  # nothing is ever fetched from a hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    stages = Stages()
    try:
        summary = run_demo(args, stages)
    except BaseException as err:  # noqa: BLE001 - recorded in demo.json whatever it is, then handled or re-raised
        stages.fail(err)
        if not isinstance(err, (ValueError, FileNotFoundError, FileExistsError, RuntimeError)):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
