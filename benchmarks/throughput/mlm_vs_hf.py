"""Does our MLM train like `transformers.BertForMaskedLM`? `python -m benchmarks.throughput.mlm_vs_hf [--steps 250] [--seeds 1234,1,2]`.

For every seed, two arms start from the same initial weights and see the same micro-batches:

* **ours**: the real command, `python -m pipeline.train --config tiny-mlm` with the demo recipe
  (`demo.run.DEMO_OVERRIDES`) but BERT's default zero output biases (`model.mlm_bias_init=zero`),
  DeepSpeed ZeRO-1, every step logged;
* **hf**: `BertForMaskedLM` (SDPA attention) in a plain torch loop, with the pipeline's learning-rate
  schedule, AdamW groups / betas / eps / weight decay, clipping and per-step seeding
  (`benchmarks.throughput.mlm_vs_hf_arms`).

Reported per seed: the first step where |loss_ours - loss_hf| exceeds 1e-5 / 1e-4 / 1e-3 / 1e-2, its
maximum over steps 1-10 / 1-50 / all, the step-1 gradient-norm difference, and for each arm's final
model the held-out numbers of `benchmarks.quality.ttq_eval.heldout_metrics` (mean token cosine of the last
hidden states, `pipeline.monitor.health`; masked accuracy against the unigram plateau at the same
positions). The pretraining data: a WordPiece tokenizer and shards built from `--text` with
`data_prep`; the held-out shards from `--heldout` with the same tokenizer.

Writes `<out>/mlm_vs_hf.json` (rows, per-step curves of both arms, device, library versions, the exact
command), `<out>/mlm_vs_hf.md` and `<out>/mlm_vs_hf.png` (loss curves of both arms and |diff| per seed).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.throughput.mlm_vs_hf_arms import (  # noqa: E402
    THRESHOLDS,
    WINDOWS,
    agree,
    compare,
    recipe_overrides,
    run_pipeline,
    train_hf,
)

NAME = "mlm_vs_hf"
DATA = Path("/work/shared/data/wikitext-2")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.throughput.mlm_vs_hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--text", default=str(DATA / "valid.txt"), help="pretraining text (tokenizer and shards)")
    p.add_argument("--heldout", default=str(DATA / "test.txt"), help="held-out text for the final metrics")
    p.add_argument("--seeds", default="1234,1,2", help="comma-separated train.seed values")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra pipeline.train override for both arms (repeatable; applied last)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-sequences", type=int, default=512, help="held-out sequences for the masked accuracy")
    p.add_argument("--work", default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "mlm_vs_hf"),
                   help="tokenizer, shards, runs and converted models (a finished tokenizer / shards are reused)")
    p.add_argument("--out", default="benchmarks/results", help="report directory")
    return p


def build_data(text: Path, heldout: Path, work: Path, vocab_size: int, seq_len: int) -> tuple[Path, Path]:
    """(training shards, held-out shards) with one tokenizer trained on `text` (`data_prep`), built once."""
    from data_prep.build_shards import build_shards
    from data_prep.train_tokenizer import train_tokenizer

    tok = work / "tokenizer"
    if not (tok / "tokenizer.json").is_file():
        train_tokenizer([str(text)], tok, vocab_size=vocab_size, progress=False)
    shards = {"train": (work / "shards-train", text), "heldout": (work / "shards-heldout", heldout)}
    for out, source in shards.values():
        if not (out / "manifest.json").is_file():
            build_shards([str(source)], tok, out, seq_len=seq_len, num_proc=1, progress=False)
    return shards["train"][0], shards["heldout"][0]


def run_seed(seed: int, args: argparse.Namespace, train_shards: Path, heldout_shards: Path, top_token: int) -> dict:
    """Both arms for one seed: their curves, the comparison and each final model's held-out metrics."""
    from benchmarks.quality.ttq_eval import heldout_metrics

    work = Path(args.work) / f"seed{seed}"
    overrides = recipe_overrides(train_shards, seed, args.steps, work / "run", args.set)
    print(f"seed {seed}: pipeline.train ...", flush=True)
    ours = run_pipeline(overrides, work / "run", convert_to=work / "hf-ours")
    print(f"seed {seed}: pipeline.train {ours['seconds']:.0f}s; BertForMaskedLM ...", flush=True)
    hf = train_hf(overrides, save_to=work / "hf-hf")
    print(f"seed {seed}: BertForMaskedLM {hf['seconds']:.0f}s; held-out metrics ...", flush=True)
    summary = compare(ours["records"], hf["records"])
    metrics = {arm: heldout_metrics(work / f"hf-{arm}", heldout_shards, top_token, args.eval_sequences)
               for arm in ("ours", "hf")}
    row = {"seed": seed, "steps": args.steps, "agree": agree(summary),
           "loss_ours_final": ours["records"][-1]["loss"], "loss_hf_final": hf["records"][-1]["loss"], **summary}
    for arm, m in metrics.items():
        row.update({f"{arm}_token_cosine": m["token_cosine"], f"{arm}_collapsed": m["collapsed"],
                    f"{arm}_mlm_acc": m["mlm_acc"], f"{arm}_mlm_loss": m["mlm_loss"]})
    row.update(unigram_acc=metrics["ours"]["unigram_acc"], masked_tokens=metrics["ours"]["masked_tokens"],
               seconds_ours=round(ours["seconds"], 1), seconds_hf=round(hf["seconds"], 1))
    curves = {arm: [[r["step"], r["loss"], r["grad_norm"]] for r in res["records"]]
              for arm, res in (("ours", ours), ("hf", hf))}
    print(f"seed {seed}: max |loss diff| {summary['max_diff_all']:.2e}; token cosine ours "
          f"{row['ours_token_cosine']:.3f} hf {row['hf_token_cosine']:.3f}; masked acc ours {row['ours_mlm_acc']:.3f} "
          f"hf {row['hf_mlm_acc']:.3f} (unigram {row['unigram_acc']:.3f})", flush=True)
    return {"row": row, "curves": curves, "pipeline_command": ours["command"]}


def plot(curves: dict, path: Path) -> None:
    """Per seed: both arms' loss curves (top) and |loss_ours - loss_hf| on a log axis (bottom); PNG, atomic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common.report import _save_figure

    fig, axes = plt.subplots(2, len(curves), figsize=(4.5 * len(curves), 6), squeeze=False)
    for col, (seed, arms) in enumerate(curves.items()):
        top, bottom = axes[0][col], axes[1][col]
        for arm, label, style in (("ours", "ours (pipeline.train, DeepSpeed)", "-"),
                                  ("hf", "BertForMaskedLM (plain torch)", "--")):
            top.plot([p[0] for p in arms[arm]], [p[1] for p in arms[arm]], style, label=label, linewidth=1)
        hf = {p[0]: p[1] for p in arms["hf"]}
        steps = [p[0] for p in arms["ours"] if p[0] in hf]
        diffs = [max(abs(p[1] - hf[p[0]]), 1e-9) for p in arms["ours"] if p[0] in hf]
        bottom.semilogy(steps, diffs, color="black", linewidth=1)
        top.set_title(f"seed {seed}")
        top.set_ylabel("training loss")
        bottom.set_ylabel("|loss diff| (floor 1e-9)")
        bottom.set_xlabel("step")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        top.legend(fontsize=7)
    _save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from benchmarks.common.report import write_report

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    for flag in ("text", "heldout"):
        if not Path(getattr(args, flag)).is_file():
            print(f"error: --{flag} {getattr(args, flag)}: not a file", file=sys.stderr)
            return 2
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds:
        print(f"error: --seeds {args.seeds!r}: give comma-separated integers", file=sys.stderr)
        return 2
    if args.steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    from benchmarks.quality.ttq_eval import top_token_of

    started = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    train_shards, heldout_shards = build_data(Path(args.text), Path(args.heldout), work, args.vocab_size, args.seq_len)
    top_token = top_token_of(train_shards)
    try:
        results = {seed: run_seed(seed, args, train_shards, heldout_shards, top_token) for seed in seeds}
    except (RuntimeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = [r["row"] for r in results.values()]
    notes = [f"recipe: tiny-mlm + demo.run.DEMO_OVERRIDES with model.mlm_bias_init=zero"
             f"{' + ' + ' '.join(args.set) if args.set else ''}, {args.steps} steps; both arms start from "
             "pipeline.train.loop.build_run_model's weights and read the same micro-batches",
             f"first_step_diff_gt_t: first step with |loss_ours - loss_hf| > t (t in {list(THRESHOLDS)}; empty: "
             f"never); max_diff_steps_1_w: max over steps 1..w (w in {list(WINDOWS)}); agree: max over steps 1-10 "
             "<= 1e-4",
             f"held-out: {args.heldout} ({args.eval_sequences} sequences, fixed masks); token_cosine > 0.9 = "
             "collapsed; unigram_acc = always answering the training text's most frequent token"]
    out = Path(args.out)
    paths = write_report(NAME, rows, out, "Our MLM (pipeline.train) vs transformers.BertForMaskedLM", notes=notes,
                         extra={"exact_command": shlex.join(["python", "-m", "benchmarks.throughput.mlm_vs_hf", *argv]),
                                "pipeline_commands": {str(s): r["pipeline_command"] for s, r in results.items()},
                                "curves": {str(s): r["curves"] for s, r in results.items()},
                                "wall_seconds": round(time.perf_counter() - started, 1)})
    plot({s: r["curves"] for s, r in results.items()}, out / f"{NAME}.png")
    print(f"wrote {paths['json']}, {paths['md']} and {out / (NAME + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
