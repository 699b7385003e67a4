"""Does the demo's default recipe collapse? `python -m benchmarks.health.demo_health --heldout TEXT --out DIR`.

For each objective this runs the demo exactly as a user does (`demo.run`, i.e. `bash
scripts/demo.sh --objective X`: default corpus, `DEMO_OVERRIDES`, `DEFAULT_STEPS`), then measures
the converted model on held-out text the demo never trained on (shards built with the demo's own
tokenizer; `benchmarks.quality.ttq_eval.heldout_metrics`):

* mean token cosine of the last hidden states (eval mode; collapsed above `COLLAPSE_COSINE`),
* held-out masked-LM accuracy against the unigram plateau at the same masked positions (the
  demo corpus's most frequent token), and the same two numbers on the demo corpus itself (text it
  trained on, fresh masks: the plateau in the corpus's own domain; `corpus_*`),

beside the training-time health metrics of the run's last logged step (`health/token_cosine`,
`*/positive_cosine`), the number of logged steps flagged `health/collapsed`, and the learning signals
not learned over the last 20% of the logged steps (`train_signals_at_chance`: each term against its
chance level, the unigram plateau or entropy; `pipeline.monitor.signals`). `--seeds` repeats
each objective with other demo seeds (a recipe at the edge of collapse shows it on some seeds
only). Writes `<out>/<name>.{json,md}` (default `demo_health`) with the device, versions and
command; the demo outputs stay in `<work>/seed_<seed>/<objective>` (a finished one is reused).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.throughput.bench_throughput import parse_list  # noqa: E402


def measure(objective: str, seed: int, args: argparse.Namespace, work: Path) -> dict:
    """One demo run and its health numbers (cached in `<work>/seed_<seed>/<objective>.health.json`)."""
    from benchmarks.quality.ttq_eval import cached, heldout_metrics, top_token_of
    from benchmarks.quality.ttq_report import signals_at_chance
    from data_prep.build_shards import build_shards
    from demo.run import main as demo_main
    from pipeline.monitor.signals import final_signals
    from pipeline.train.metrics import read_jsonl

    out = work / f"seed_{seed}" / objective

    def run() -> dict:
        argv = ["--objective", objective, "--out", str(out), "--seed", str(seed), *shlex.split(args.demo_args)]
        if args.steps:
            argv += ["--steps", str(args.steps)]
        if demo_main(argv) != 0:
            raise RuntimeError(f"demo --objective {objective} failed (see {out})")
        summary = json.loads((out / "demo.json").read_text())
        heldout = out / "heldout-shards"
        seq_len = json.loads((out / "shards" / "manifest.json").read_text())["seq_len"]
        build_shards([args.heldout], out / "tokenizer", heldout, seq_len=seq_len, num_proc=1, progress=False)
        metrics = heldout_metrics(Path(summary["paths"]["hf_model"]), heldout, top_token_of(out / "shards"),
                                  args.eval_sequences)
        records = read_jsonl(Path(summary["paths"]["metrics"]))
        last = records[-1]
        signals = final_signals(records)
        return {"objective": objective, "steps": last["step"], "pretrain_seconds": summary["stage_seconds"]["pretrain"],
                "demo_seconds": summary["total_seconds"], "heldout_token_cosine": metrics["token_cosine"],
                "collapsed": metrics["collapsed"], "heldout_mlm_acc": metrics["mlm_acc"],
                "unigram_acc": metrics["unigram_acc"], "acc_minus_unigram": metrics["mlm_acc"] - metrics["unigram_acc"],
                "heldout_mlm_loss": metrics["mlm_loss"], "train_token_cosine": last.get("health/token_cosine"),
                "train_collapsed_logged_steps": sum(1 for r in records if r.get("health/collapsed")),
                "logged_steps": len(records),
                "train_signals_learned": f"{sum(x.learned for x in signals)}/{len(signals)}",
                "train_signals_at_chance": signals_at_chance({"signals": [x.to_dict() for x in signals]}),
                **{f"train_{k.replace('/', '_')}": v for k, v in last.items() if k.endswith("positive_cosine")},
                "fill_mask_top": [item["predictions"][0]["token"] for item in summary["fill_mask"]]}

    def in_domain() -> dict:  # the demo corpus itself (seen text, fresh masks): the plateau in its own domain
        summary = json.loads((out / "demo.json").read_text())
        m = heldout_metrics(Path(summary["paths"]["hf_model"]), out / "shards", top_token_of(out / "shards"),
                            args.eval_sequences, seed=1)
        return {"corpus_token_cosine": m["token_cosine"], "corpus_mlm_acc": m["mlm_acc"],
                "corpus_unigram_acc": m["unigram_acc"]}

    row = cached(out.parent / f"{objective}.health.json", run)
    return {"objective": objective, "seed": seed, **row, **cached(out.parent / f"{objective}.corpus.json", in_domain)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from benchmarks.common.report import write_report
    from demo.run import DEFAULT_STEPS, DEMO_OVERRIDES, demo_objectives
    from pipeline.monitor.health import COLLAPSE_COSINE

    p = argparse.ArgumentParser(prog="python -m benchmarks.health.demo_health", description=__doc__.split("\n\n")[0])
    p.add_argument("--heldout", required=True, help="held-out text (e.g. WikiText-2 test)")
    p.add_argument("--objectives", default="all", help="comma-separated, or all (default: every objective the "
                   "demo offers)")
    p.add_argument("--steps", type=int, default=0, help=f"demo steps (default: the demo's own, {DEFAULT_STEPS})")
    p.add_argument("--seeds", default="1234", help="the demo's --seed, one run per seed (comma-separated; "
                   "default: the demo's own, 1234)")
    p.add_argument("--eval-sequences", type=int, default=512)
    p.add_argument("--demo-args", default="", help='further demo.run arguments (e.g. "--corpus DIR"; default: none)')
    p.add_argument("--work", required=True, help="demo outputs (one directory per objective; finished ones are reused)")
    p.add_argument("--out", default="benchmarks/results", help="report directory")
    p.add_argument("--name", default="demo_health", help="report file stem (default: demo_health)")
    args = p.parse_args(argv)
    if not Path(args.heldout).is_file():
        print(f"error: --heldout {args.heldout}: not a file", file=sys.stderr)
        return 2
    objectives = demo_objectives() if args.objectives == "all" else parse_list(args.objectives)
    try:
        seeds = [int(s) for s in parse_list(args.seeds)]
    except ValueError:
        print(f"error: --seeds {args.seeds!r}: comma-separated integers", file=sys.stderr)
        return 2
    unknown = sorted(set(objectives) - set(demo_objectives()))
    if unknown:
        print(f"error: --objectives {unknown}: the demo offers {demo_objectives()}", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        rows = [measure(o, seed, args, work) for seed in seeds for o in objectives]
    except (RuntimeError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    notes = [f"demo recipe: tiny-<objective> + {' '.join(DEMO_OVERRIDES)}, {args.steps or DEFAULT_STEPS} steps, "
             f"seeds {seeds}, {('demo arguments ' + args.demo_args) if args.demo_args else 'default corpus'}",
             f"held-out: {args.heldout} with each demo's tokenizer; {args.eval_sequences} sequences; collapsed = "
             f"mean token cosine > {COLLAPSE_COSINE}; unigram_acc = always answering the demo corpus's most "
             "frequent token at the same masked positions",
             f"collapsed runs: {[(r['objective'], r['seed']) for r in rows if r['collapsed']] or 'none'}"]
    paths = write_report(args.name, rows, args.out, "Demo recipe health", notes=notes,
                         extra={"wall_seconds": round(time.perf_counter() - started, 1)})
    print("\n".join(notes))
    print(f"wrote {paths['json']} and {paths['md']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
