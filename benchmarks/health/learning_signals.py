"""Does every objective learn at the time-to-quality study's size? Issue 29's proof (item 3).

    OMP_NUM_THREADS=1 python -m benchmarks.health.learning_signals \\
        --text /work/shared/data/wikitext-2/valid.txt --heldout /work/shared/data/wikitext-2/test.txt \\
        --objectives mlm,taco,capt,cocolm,infoword,mlm-nce --seeds 1 2 3 --work-dir /tmp/learning_signals

Each objective x seed trains exactly as a selected run of the study does (the study's pieces, not
copies: `benchmarks.quality.ttq_data` builds the tokenizer and shards, `time_to_quality.cpu_study`
describes the study, `benchmarks.study.local.evaluate_run` runs the real `python -m pipeline.train
--config tiny-<objective>` with the study's overrides, every step logged, converts the final checkpoint
and `benchmarks.study.units.eval_point` evaluates it on the held-out report half): the study's shape by default (`STUDY_SET`: 2 layers x 128, 2 heads, FFN 512, no
dropout, unigram output-bias start; `STUDY_STEPS` = 2,400 steps x 32 x 64 tokens, vocabulary 4,096
from WikiText-2 valid, warm-up 6%) at the learning rate the study selected for the objective
(`--lrs-from`, its `time_to_quality.json`; `--lr` overrides it for every objective). The study's
first size, 300 steps, is too short for its own MLM baseline to pass its health check; at 1,200
every objective but COCO-LM meets every criterion; 2,400 is the first budget at which all do
(`benchmarks/results/learning_signals_8x/`).

The learning signals of every logged step (`pipeline.eval.signals`) are then judged by the
criteria of `benchmarks.health.signal_criteria` (every contrastive term <= 0.85x its chance at the
end and still falling; COCO-LM RTD AUC >= 0.85 and corrective LM below the unigram entropy;
held-out token cosine < 0.9; held-out masked accuracy above the plateau), met or missed per seed.
Outputs under `--out` (default `benchmarks/results/learning_signals/`):
`learning_signals_<objective>.json` (final and per-logged-step signals, criteria per seed, the
held-out numbers, wall time), `learning_signals_<objective>.png` (each signal / its reference,
per seed, smoothed over `SMOOTH_STEPS` logged steps), and `learning_signals.{json,md}` (one row
per run, the verdict per objective in the notes).

Resumable: a finished run (`train.json` in its directory under `--work-dir`) and a finished
evaluation are skipped; an interrupted training resumes from its last checkpoint. Settings that
define the results are recorded in `<work-dir>/study.json`, and a work directory made with others
is refused.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.common.stop_signal import sigterm_stops

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.runs import parse_list  # noqa: E402

ALL_OBJECTIVES = ("mlm", "taco", "capt", "cocolm", "infoword", "mlm-nce")
#: The time-to-quality study's steps per run (its budget; benchmarks/README.md, the study at 2,400 steps).
STUDY_STEPS = 2400
#: The time-to-quality study's model overrides (benchmarks/results/README.md, the study's command).
STUDY_SET = ("model.num_layers=2", "model.hidden_size=128", "model.num_heads=2", "model.ffn_size=512",
             "model.dropout=0.0", "model.attention_dropout=0.0", "model.mlm_bias_init=unigram")
STUDY_RESULT = Path(__file__).resolve().parents[1] / "results" / "time_to_quality_study_cpu" / "time_to_quality.json"
#: Settings that define the results (a work directory made with other values is refused).
DEFINING = ("text", "heldout", "size", "set", "steps", "eval_every", "micro_batch", "world_size", "seq_len",
            "vocab_size", "warmup_ratio", "eval_sequences")
#: Logged steps averaged per point of the PNG curves (one step is one micro-batch sample of each term).
SMOOTH_STEPS = 10


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.health.learning_signals", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", nargs="+", required=True, help="pretraining text (the study: WikiText-2 valid)")
    p.add_argument("--heldout", required=True, help="held-out text (the study: WikiText-2 test)")
    p.add_argument("--objectives", default=",".join(ALL_OBJECTIVES), help="comma-separated tiny-<objective> presets")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="pretraining seeds")
    p.add_argument("--steps", type=int, default=STUDY_STEPS)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--size", default="tiny", help="model size preset")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help=f"pipeline.train override for every run; replaces the study's ({' '.join(STUDY_SET)})")
    p.add_argument("--lrs-from", default=str(STUDY_RESULT), help="time_to_quality.json whose selected learning "
                   "rate per objective is used")
    p.add_argument("--lr", type=float, help="one learning rate for every objective instead")
    p.add_argument("--warmup-ratio", type=float, default=0.06)
    p.add_argument("--eval-every", type=int, default=0, help="checkpoints converted and evaluated (default: the "
                   "final one only)")
    p.add_argument("--eval-sequences", type=int, default=256, help="held-out sequences for the final evaluation")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--launcher", default="", help='command replacing "python" (e.g. "torchrun --nproc_per_node 8")')
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--curve-every", type=int, default=1, help="keep every Nth logged step of the curves in the "
                   "JSON files (their size; the criteria and the PNG read every logged step)")
    p.add_argument("--out", default="benchmarks/results/learning_signals", help="report directory")
    p.add_argument("--work-dir", default="", help="tokenizer, shards, runs (default: <out>/work)")
    return p


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for path in [*args.text, args.heldout]:
        if not Path(path).is_file():
            parser.error(f"{path}: not a file")
    args.objectives = parse_list(args.objectives)
    args.set = list(STUDY_SET) if args.set is None else args.set
    args.eval_every = args.eval_every or args.steps
    if args.steps < 1 or not 1 <= args.eval_every <= args.steps or len(set(args.seeds)) != len(args.seeds):
        parser.error("need --steps >= 1, 1 <= --eval-every <= --steps and distinct --seeds")
    if args.curve_every < 1:
        parser.error(f"--curve-every must be >= 1, got {args.curve_every}")
    from pipeline.config.loader import available_presets

    bad = [o for o in args.objectives if f"tiny-{o}" not in available_presets()]
    if bad:
        parser.error(f"--objectives {bad}: no tiny-<objective> preset")
    try:
        args.lrs = {o: learning_rate(o, args) for o in args.objectives}
    except ValueError as err:
        parser.error(str(err))
    return args


def learning_rate(objective: str, args) -> float:
    """`--lr`, else the study's selected learning rate for `objective` (`--lrs-from`)."""
    if args.lr is not None:
        return args.lr
    path = Path(args.lrs_from)
    if not path.is_file():
        raise ValueError(f"--lrs-from {path}: not a file (or give --lr)")
    selection = json.loads(path.read_text()).get("selection", {})
    lr = (selection.get(objective) or {}).get("lr")
    if lr is None:
        raise ValueError(f"{path}: no selected learning rate for {objective!r} (give --lr)")
    return float(lr)


def token_head(objective: str) -> bool:
    """Does the objective's tiny preset train a token-prediction head (the shared MLM head)?"""
    from pipeline.config.run import load_config
    from pipeline.objectives.registry import mlm_head_training

    return bool(mlm_head_training(load_config(f"tiny-{objective}", []).objectives))


def signal_curves(records: list[dict]) -> dict[str, list[list[float]]]:
    """term -> [[step, value, reference], ...] over every logged step."""
    from pipeline.eval.signals import learning_signals

    curves: dict[str, list[list[float]]] = {}
    for record in records:
        for s in learning_signals(record):
            curves.setdefault(s.term, []).append([record["step"], s.value, s.reference])
    return curves


def run_one(objective: str, seed: int, study, args, work: Path) -> dict:
    """Train (or reuse) one run, evaluate its final checkpoint, and judge it."""
    import shlex

    from benchmarks.health.signal_criteria import judge_run
    from benchmarks.quality.ttq_eval import cached
    from benchmarks.study.local import evaluate_run
    from benchmarks.study.units import RunKey, eval_point
    from pipeline.train.metrics import read_jsonl

    key = RunKey(objective, args.lrs[objective], seed)
    started = time.perf_counter()
    train = evaluate_run(study, key, curves=False, launcher=shlex.split(args.launcher))
    heldout = None
    if train["status"] == "ok":
        heldout = eval_point(study, key, train["steps"][-1], curves=False)["report"]
    # the first (uncached) pass is the run's wall time: training, conversion and evaluation
    wall = cached(key.directory(work) / "wall.json", lambda: {"wall_s": round(time.perf_counter() - started, 1)})
    records = read_jsonl(key.directory(work) / "metrics.jsonl")
    verdict = judge_run(objective, records, heldout, token_head(objective))
    print(f"[{key.name}] {'MET' if verdict['met'] else 'MISSED'}: "
          + "; ".join(f"{c['criterion']} {'ok' if c['met'] else 'MISSED'}" for c in verdict["criteria"]), flush=True)
    return {"seed": seed, "lr": key.lr, "status": train["status"], "error": train.get("error"),
            "wall_s": wall["wall_s"], "device_hours": (train.get("device_hours") or {}).get(str(args.steps)),
            "heldout": heldout, **verdict, "curves": signal_curves(records)}


def thinned(runs: list[dict], every: int) -> list[dict]:
    """`runs` with each curve keeping every `every`-th logged point (the first, then each `every`-th
    after it), for the JSON files: only their size changes, never a criterion (judged before)."""
    return [{**run, "curves": {term: points[::every] for term, points in run["curves"].items()}} for run in runs]


def smoothed(points: list[list[float]], window: int = SMOOTH_STEPS) -> list[tuple[float, float]]:
    """(step, mean of value / reference over `window` logged steps) (references of 0 skipped)."""
    ratios = [(p[0], p[1] / p[2]) for p in points if p[2]]
    return [(ratios[i + window - 1][0] if i + window <= len(ratios) else ratios[-1][0],
             sum(r for _, r in ratios[i:i + window]) / len(ratios[i:i + window]))
            for i in range(0, len(ratios), window)]


def plot_objective(objective: str, runs: list[dict], path: Path) -> None:
    from benchmarks.common.report import panel_chart
    from pipeline.eval.signals import LOSS_RATIO, PLATEAU_MARGIN

    panels: dict[str, dict[str, list]] = {}
    lines: dict[str, list[tuple[float, str]]] = {}
    for run in runs:
        kinds = {s["term"]: s for s in run["final_signals"]}
        for term, points in run["curves"].items():
            panels.setdefault(term, {})[f"seed {run['seed']}"] = smoothed(points)
            kind = kinds.get(term, {}).get("kind")
            ref = [(1.0, "reference")]
            if kind == "chance" and kinds[term]["direction"] == "lower":
                ref.append((LOSS_RATIO, f"learned: {LOSS_RATIO}x"))
            elif kind == "plateau":
                plateau = kinds[term]["reference"]
                ref.append(((plateau + PLATEAU_MARGIN) / plateau, f"learned: +{PLATEAU_MARGIN}"))
            lines[term] = ref
    panel_chart(panels, path, f"{objective}: each learning signal / its reference (chance, plateau, unigram "
                f"entropy, collapse 0.9), mean of {SMOOTH_STEPS} logged steps", "step", "value / reference",
                hlines=lines)


def summary_rows(results: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for objective, runs in results.items():
        for run in runs:
            heldout = run["heldout"] or {}
            missed = [c["criterion"] for c in run["criteria"] if not c["met"]]
            ends = {s["term"]: s for s in run["final_signals"]}
            rows.append({
                "objective": objective, "seed": run["seed"], "lr": run["lr"], "status": run["status"],
                "end signals (value / reference)": ", ".join(
                    f"{t} {s['ratio']:.2f}x" if s["direction"] == "lower" else f"{t} {s['margin']:+.3f}"
                    for t, s in sorted(ends.items())),
                "heldout_mlm_acc": heldout.get("mlm_acc"), "unigram_acc": heldout.get("unigram_acc"),
                "token_cosine": heldout.get("token_cosine"),
                "criteria met": f"{sum(c['met'] for c in run['criteria'])}/{len(run['criteria'])}",
                "missed": "; ".join(missed) or "none", "wall_s": run["wall_s"],
            })
    return rows


def write_outputs(results: dict[str, list[dict]], args, out: Path, started: float) -> dict:
    from benchmarks.common.report import hardware_info, write_report
    from benchmarks.quality.ttq_eval import write_json

    verdicts = {o: all(r["met"] for r in runs) and len(runs) == len(args.seeds) for o, runs in results.items()}
    budget = (f"{args.steps} steps x {args.micro_batch * args.world_size} sequences x {args.seq_len} tokens per run, "
              f"model {args.size} {' '.join(args.set)}, warm-up {args.warmup_ratio:g} of the steps, seeds {args.seeds}")
    for objective, runs in results.items():
        write_json(out / f"learning_signals_{objective}.json", {
            "objective": objective, "met_every_seed": verdicts[objective], "budget": budget,
            "lr": args.lrs[objective], "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "hardware": hardware_info(), "curve_every": args.curve_every, "runs": thinned(runs, args.curve_every)})
        plot_objective(objective, runs, out / f"learning_signals_{objective}.png")
    notes = [f"budget: {budget}",
             "verdict per objective (every criterion met on every seed): "
             + ", ".join(f"{o} {'MET' if v else 'MISSED'}" for o, v in verdicts.items()),
             "end = mean over the last 20% of the logged steps; still falling = that mean below the mean of the "
             "20% before; lower-is-better signals as value / reference, higher-is-better as value - reference",
             "criteria: benchmarks/health/signal_criteria.py; held-out numbers on the report half of --heldout"]
    paths = write_report("learning_signals", summary_rows(results), out, "Learning signals against chance (issue 29)",
                         notes=notes, extra={"verdicts": verdicts, "lrs": args.lrs,
                                             "wall_seconds_this_invocation": round(time.perf_counter() - started, 1)})
    return {"verdicts": verdicts, "paths": paths}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from benchmarks.quality.time_to_quality import check_study_args, cpu_study
    from benchmarks.quality.ttq_data import build_text_shards

    args = parse_args(argv)
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    try:
        with sigterm_stops():  # `kill PID`: the running training checkpoints, a re-run resumes
            check_study_args(args, work, DEFINING, sweep_seed=False)
            study = cpu_study(args, build_text_shards(args, work), work, lrs=args.lrs)
            results = {o: [run_one(o, seed, study, args, work) for seed in args.seeds] for o in args.objectives}
    except (RuntimeError, ValueError, FileNotFoundError) as err:  # (StudyError is a ValueError)
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stopped: re-run the same command to resume (finished runs and evaluations are kept)", file=sys.stderr)
        return 130
    result = write_outputs(results, args, out, started)
    print("; ".join(f"{o} {'MET' if v else 'MISSED'}" for o, v in result["verdicts"].items()))
    print(f"wrote {result['paths']['json']} and {result['paths']['md']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
