"""Time to quality, tuned fairly: every objective, MLM included, with the same learning-rate sweep,
selected on a held-out split, several pretraining seeds, SST-2 downstream and a random-init floor.

    python benchmarks/quality/time_to_quality.py --text ../shared/data/wikitext-2/valid.txt \\
        --heldout ../shared/data/wikitext-2/test.txt --sst2 ../shared/data/glue/SST-2 \\
        --out benchmarks/results/time_to_quality_cpu --work-dir ~/ttq-work

One study, two ways to run it: these flags describe a study (`cpu_study`: the same `Study` a
`cpt-study` YAML file gives) and its local executor runs it here (`benchmarks.study.local`, the units of
`benchmarks.study.units`; on SLURM: `cpt-study submit`). Every objective of `--objectives` and MLM train with the
real command (`python -m pipeline.train --config tiny-<objective>`, the same model, batch,
schedule, number of steps and therefore tokens) once per learning rate of `--lrs` (first seed);
the learning rate with the best SST-2 accuracy on a selection split (train examples never
fine-tuned on; without SST-2: the masked-LM loss on one held-out half) is kept, and the remaining
`--seeds` run at it. Every checkpoint (`--eval-every`) is converted and evaluated on the other
held-out half (masked-LM loss and accuracy, the unigram plateau at the same positions, the mean
token cosine: `benchmarks/quality/ttq_eval.py`) and, for the selected runs, fine-tuned on SST-2
(`pipeline.eval.finetune`, `--finetune-seeds`, dev accuracy). The labelled SST-2 test split is
scored once, at the end, for the selected runs and the randomly initialised floor.

The report (`benchmarks/quality/ttq_report.py`) gives every figure as a mean with a 95% t-interval over
pretraining seeds, every run's health, the MLM baseline's health check, and refuses the
time-to-target ratios when that check fails. Outputs: `<out>/time_to_quality*.{json,md}` and PNG
curves of quality against device-hours with their bands.

The study is resumable and incremental: a re-run with the same flags skips every finished
training run and evaluation (an interrupted run resumes from its last checkpoint); more
`--objectives` or `--seeds` can be added later. On a GPU the same command takes other flags only
(`--size base --micro-batch 32 --launcher "torchrun --nproc_per_node 8" --world-size 8`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence


if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.stop_signal import sigterm_stops  # noqa: E402
from benchmarks.common.runs import parse_list  # noqa: E402
from benchmarks.study.spec import STUDY_OWNED  # noqa: E402

#: pipeline.train keys these flags set for every run (beside the study's own, `STUDY_OWNED`).
FLAG_OWNED = {"model.size": "--size", "data.micro_batch_size": "--micro-batch",
              "data.global_batch_size": "--micro-batch and --world-size"}
#: Settings that define a study's results; a work directory made with other values is refused.
DEFINING_ARGS = ("text", "heldout", "sst2", "size", "set", "steps", "eval_every", "micro_batch", "world_size",
                 "seq_len", "vocab_size", "lrs", "warmup_ratio", "eval_sequences", "sst2_train", "sst2_select",
                 "subset_seed", "finetune_lr", "finetune_epochs")
# Not among them: the pretraining seeds after the first and `--finetune-seeds` (each seed's results are
# cached on their own, so adding seeds grows a study; it never mixes settings).
#: Objectives of a full study (MLM, the baseline, is always first).
ALL_OBJECTIVES = ("mlm", "taco", "capt", "cocolm", "infoword", "mlm-nce")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="time_to_quality.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--text", nargs="+", required=True, help="pretraining text (tokenizer + shards are built from it)")
    data.add_argument("--heldout", required=True, help="held-out text, split by article into a selection and a "
                      "report half")
    data.add_argument("--sst2", default="", help="GLUE SST-2 dir (train/dev/labelled test .tsv); absent: no downstream")
    data.add_argument("--sst2-train", type=int, default=4000, help="SST-2 train examples fine-tuned on")
    data.add_argument("--sst2-select", type=int, default=2000, help="other SST-2 train examples: the selection split")
    data.add_argument("--subset-seed", type=int, default=0, help="draws the SST-2 fine-tuning and selection examples")
    data.add_argument("--seq-len", type=int, default=128)
    data.add_argument("--vocab-size", type=int, default=8192)
    model = p.add_argument_group("pretraining")
    model.add_argument("--objectives", default=",".join(ALL_OBJECTIVES), help="objectives (MLM is always added)")
    model.add_argument("--size", default="tiny", help="model size preset (tiny, capt-small, base, ...)")
    model.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="extra pipeline.train override for every run (e.g. model.num_layers=4)")
    model.add_argument("--steps", type=int, default=1000, help="training steps of every run (the budget)")
    model.add_argument("--eval-every", type=int, default=250)
    model.add_argument("--micro-batch", type=int, default=32)
    model.add_argument("--world-size", type=int, default=1, help="ranks the launcher starts")
    model.add_argument("--launcher", default="", help='command replacing "python" (e.g. "torchrun --nproc_per_node 8")')
    model.add_argument("--lrs", default="5e-4,1e-3,2e-3", help="peak learning rates swept for every objective")
    model.add_argument("--warmup-ratio", type=float, default=0.06, help="linear warm-up, fraction of --steps")
    model.add_argument("--seeds", default="1,2,3", help="pretraining seeds (the first one runs the sweep)")
    model.add_argument("--keep-checkpoints", action="store_true",
                       help="keep the DeepSpeed checkpoints (default: deleted once converted)")
    ev = p.add_argument_group("evaluation")
    ev.add_argument("--eval-sequences", type=int, default=512, help="held-out sequences per half for the MLM metrics")
    ev.add_argument("--finetune-seeds", type=int, nargs="+", default=[1, 2, 3])
    ev.add_argument("--finetune-lr", type=float, default=1e-4)
    ev.add_argument("--finetune-epochs", type=int, default=3)
    ev.add_argument("--device", default="", help="fine-tuning device (default: cuda when available)")
    ev.add_argument("--plateau-margin", type=float, default=0.05,
                    help="baseline health: masked accuracy must beat the unigram plateau by more than this")
    p.add_argument("--out", required=True, help="report directory")
    p.add_argument("--work-dir", default="", help="tokenizer, shards, runs, evaluations (default: <out>/work)")
    return p


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for path in [*args.text, args.heldout]:
        if not Path(path).is_file():
            parser.error(f"{path}: not a file")
    if args.steps < 1 or args.eval_every < 1 or args.eval_every > args.steps:
        parser.error("need 1 <= --eval-every <= --steps")
    if not 0.0 <= args.warmup_ratio < 1.0:
        parser.error("--warmup-ratio must be in [0, 1)")
    try:
        args.objectives = list(dict.fromkeys(["mlm", *parse_list(args.objectives)]))
        args.lrs = sorted({float(x) for x in parse_list(args.lrs)})
        args.seeds = [int(x) for x in parse_list(args.seeds)]
    except ValueError as err:
        parser.error(f"--objectives / --lrs / --seeds: {err}")
    if len(set(args.seeds)) != len(args.seeds) or not args.seeds:
        parser.error("--seeds: give distinct seeds")
    if any(lr <= 0 for lr in args.lrs):
        parser.error("--lrs: learning rates must be positive")
    owned = [s for s in args.set if s.split("=", 1)[0] in STUDY_OWNED]
    if owned:
        parser.error(f"--set {owned}: the study sets these itself (use --lrs, --seeds, --warmup-ratio, --steps, ...)")
    flagged = [f"{s} (use {FLAG_OWNED[s.split('=', 1)[0]]})" for s in args.set if s.split("=", 1)[0] in FLAG_OWNED]
    if flagged:
        parser.error(f"--set {flagged}: the study sets these itself")
    from pipeline.config.loader import available_presets

    bad = [o for o in args.objectives if f"tiny-{o}" not in available_presets()]
    if bad:
        parser.error(f"--objectives {bad}: no tiny-<objective> preset")
    return args


def check_study_args(args, work: Path, defining: Sequence[str] = DEFINING_ARGS, sweep_seed: bool = True) -> None:
    """Record the `defining` settings in `<work>/study.json`, or refuse a work dir made with others
    (adding objectives, pretraining or fine-tuning seeds to a study is fine: that is how it grows).
    `sweep_seed`: the first seed is defining too (it runs the learning-rate sweep)."""
    import json

    from benchmarks.common.report import write_json

    current = {k: getattr(args, k) for k in defining}
    if sweep_seed:
        current["seeds"] = args.seeds[0]  # the sweep seed; later seeds may be added
    current = json.loads(json.dumps(current, default=str))
    path = work / "study.json"
    if path.is_file():
        recorded = json.loads(path.read_text())
        changed = sorted(k for k in current if recorded.get(k) != current[k])
        if changed:
            diffs = "; ".join(f"{k}: {recorded.get(k)!r} there, {current[k]!r} now" for k in changed)
            raise ValueError(f"{work} holds a study made with other settings ({diffs}); use another --work-dir "
                             "or the same flags")
    else:
        write_json(path, current)


def cpu_study(args, shards: Sequence[Path], work: Path):
    """The `Study` these flags describe (`benchmarks.study.spec`), over the shards `ttq_data` built
    (train, held-out selection half, held-out report half); SST-2 as its one task when `--sst2` has it."""
    from benchmarks.quality.ttq_data import SST2_FILES
    from benchmarks.study.spec import Objective, Study, Task, resolve_steps

    mb, world = args.micro_batch, args.world_size
    flags = (f"model.size={args.size}", f"data.micro_batch_size={mb}", f"data.global_batch_size={mb * world}")
    sst2 = getattr(args, "sst2", "")  # a missing or incomplete SST-2 dir: no task (the report says so)
    tasks = [Task("sst2", Path(sst2), args.sst2_train, args.sst2_select)] \
        if sst2 and all((Path(sst2) / f).is_file() for f in SST2_FILES) else []
    study = Study(path=work / "study.json", name=f"cpu-{work.name}", work=work,
                  objectives={o: Objective(o, f"tiny-{o}", (*flags, *args.set)) for o in args.objectives},
                  seeds=list(args.seeds), lrs=list(args.lrs),
                  warmup_ratio=args.warmup_ratio, budget={"steps": args.steps}, eval_every=args.eval_every,
                  shards=dict(zip(("train", "heldout_select", "heldout_report"), shards)), tasks=tasks,
                  finetune={"seeds": list(getattr(args, "finetune_seeds", [1])), "lr": getattr(args, "finetune_lr", 1e-4),
                            "epochs": getattr(args, "finetune_epochs", 3), "device": getattr(args, "device", "")},
                  eval_sequences=args.eval_sequences, plateau_margin=getattr(args, "plateau_margin", 0.05),
                  resources={"pretrain": {"nodes": 1, "ntasks_per_node": world}}, cost={},
                  subset_seed=getattr(args, "subset_seed", 0), keep_checkpoints=args.keep_checkpoints)
    resolve_steps(study)
    return study


def main(argv: Optional[Sequence[str]] = None) -> int:
    import shlex

    from benchmarks.quality.ttq_data import build_text_shards
    from benchmarks.study.local import run_study
    from benchmarks.study.results import collect
    from benchmarks.study.spec import StudyError
    from benchmarks.study.units import study_data

    args = parse_args(argv)
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per evaluated model otherwise
    started = time.perf_counter()
    try:
        with sigterm_stops():  # `kill PID`: the running training checkpoints, a re-run resumes
            check_study_args(args, work)
            study = cpu_study(args, build_text_shards(args, work), work)
            note = study_data(study, study.tasks[0]).sst2_note if study.tasks else \
                f"no SST-2 at --sst2 {args.sst2!r}: downstream evaluation skipped"
            print(note, flush=True)
            run_study(study, shlex.split(args.launcher))
    except (RuntimeError, ValueError, FileNotFoundError, StudyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stopped: re-run the same command to resume (finished runs and evaluations are kept)", file=sys.stderr)
        return 130
    budget = (f"{args.steps} steps x {args.micro_batch * args.world_size} sequences x {args.seq_len} tokens per run "
              f"(model {args.size} {' '.join(args.set)})")
    extra = {"wall_seconds_this_invocation": round(time.perf_counter() - started, 1), "args": dict(vars(args))}
    result, = collect(study, out, per_task_dirs=False, notes=[f"model: {budget}", note], extra=extra)
    print(result["verdict"])
    print(f"wrote {result['paths']['json']} and {result['paths']['md']} ({time.perf_counter() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
