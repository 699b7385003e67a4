"""CPU step time of a training recipe (default: `tiny-mlm`, the default recipe) through the real entry
point, an older tree against a newer one, side by side from one invocation (issue 38: "CPU step
time of the default recipe unchanged").

`--before DIR` / `--after DIR` are extracted copies of the code (`git archive <commit> | tar -x -C DIR`,
then `echo <commit> > DIR/.commit` so the report names it).
Each measurement is a fresh process that runs that tree's training entry point
(`pipeline.train.cli.main(["--config", <recipe>, ...])`; `pipeline.train.loop.main` in trees before
issue 48; `PYTHONPATH` and the working directory set to the tree, `OMP_NUM_THREADS=1`) on the same
shards for `--steps` steps; its step time is the median of `metrics.jsonl`'s `step_time_s` after
`--warmup` steps — one optimizer step: collation, forward,
backward, LR schedule, optimizer step. The worker points the metrics module's clock at
`time.process_time`, so `step_time_s` is this process's CPU time per step, not wall time: the
machine is shared, and other processes inflate wall time, not this process's CPU time.
The trees alternate (before, after, after, before, ...: the order flips every round) for `--rounds`
rounds, so drift of a shared machine hits both alike; each round gives one after/before ratio, and
the report gives the median ratio with its min-max spread over rounds.

    OMP_NUM_THREADS=1 python -m benchmarks.throughput.recipe_step_ab --before /tmp/base --after /tmp/now \\
        --shards SHARDS --out benchmarks/results --name recipes_step_time
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence


def tree_commit(tree: Path) -> str:
    """The commit named in the tree's `.commit` file (write it when extracting: `echo <commit> > DIR/.commit`),
    else the tree's path."""
    marker = tree / ".commit"
    return marker.read_text().strip() if marker.is_file() else str(tree)


def worker(tree: Path, argv: list[str]) -> int:
    """Inside the tree under test: its training entry point, step times measured in CPU time."""
    import importlib
    import time
    import types

    import pipeline.train.metrics as metrics

    try:  # the entry point's home since issue 48; before, `pipeline.train.loop`
        train_main = importlib.import_module("pipeline.train.cli").main
    except ModuleNotFoundError:
        train_main = importlib.import_module("pipeline.train.loop").main

    clock = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    clock.perf_counter = time.process_time  # the step timer's clock: this process's CPU time
    metrics.time = clock
    return int(train_main(argv) or 0)


def run_once(tree: Path, recipe: str, shards: Path, steps: int, warmup: int, extra: Sequence[str]) -> float:
    """Median `step_time_s` (CPU seconds) of steps warmup+1 .. steps of one training process in `tree`
    (the loop's own step, timed by the loop)."""
    from benchmarks.common.runs import quiet_overrides  # here, not at the top: the worker imports only the tree's code

    with tempfile.TemporaryDirectory(prefix="recipe_ab_") as tmp:
        out = Path(tmp) / "run"
        train_args = ["--config", recipe, f"data.shards_dir={shards}", *quiet_overrides(out, steps), *extra]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(tree), "--", *train_args]
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{tree}: training failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        times = [r["step_time_s"] for r in rows if r.get("step", 0) > warmup and "step_time_s" in r]
        if not times:
            raise SystemExit(f"{tree}: no step_time_s after step {warmup} in {out / 'metrics.jsonl'}")
        return statistics.median(times)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:  # `--worker TREE -- <training arguments>`
        return worker(Path(argv[1]), argv[3:])
    from pipeline.report_files import write_report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="extracted older tree")
    parser.add_argument("--after", type=Path, required=True, help="extracted newer tree")
    parser.add_argument("--shards", type=Path, required=True, help="shards directory (data_prep.build_shards)")
    parser.add_argument("--recipe", default="tiny-mlm", help="preset to time (default: tiny-mlm, the default recipe)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--extra", nargs="*", default=[], help="overrides passed to both trees")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default="recipes_step_time")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    for flag, tree in (("--before", args.before), ("--after", args.after)):
        if not (tree / "pipeline" / "train" / "loop.py").is_file():
            parser.error(f"{flag} {tree}: not a tree of this project (no pipeline/train/loop.py)")

    measured: dict[str, list[float]] = {"before": [], "after": []}
    ratios = []
    for round_ in range(args.rounds):
        order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
        got = {}
        for side in order:
            got[side] = run_once(getattr(args, side), args.recipe, args.shards, args.steps, args.warmup, args.extra)
            measured[side].append(got[side])
        ratios.append(got["after"] / got["before"])
        print(f"round {round_ + 1}: before {got['before'] * 1e3:.2f} ms  after {got['after'] * 1e3:.2f} ms  "
              f"ratio {ratios[-1]:.3f}", flush=True)
    row = {
        "recipe": args.recipe,
        "before": tree_commit(args.before),
        "after": tree_commit(args.after),
        "before_ms_median": round(statistics.median(measured["before"]) * 1e3, 3),
        "after_ms_median": round(statistics.median(measured["after"]) * 1e3, 3),
        "ratio_median": round(statistics.median(ratios), 4),
        "ratio_min": round(min(ratios), 4),
        "ratio_max": round(max(ratios), 4),
        "rounds": args.rounds,
        "steps": f"{args.warmup + 1}-{args.steps}",
    }
    notes = [f"step time: median of metrics.jsonl step_time_s (CPU time of the process) over steps {args.warmup + 1}-{args.steps} of one "
             "process per tree and round, OMP_NUM_THREADS=1; trees alternate, order flipped every round",
             "ratio: after / before per round; median and min-max over rounds (a shared, loaded machine: the spread "
             "is the measurement's noise)",
             f"per-round before ms: {[round(t * 1e3, 2) for t in measured['before']]}; after ms: "
             f"{[round(t * 1e3, 2) for t in measured['after']]}",
             f"command: `OMP_NUM_THREADS=1 python -m benchmarks.throughput.recipe_step_ab {' '.join(argv)}`"]
    paths = write_report(args.name, [row], args.out, f"CPU step time of `{args.recipe}`: before vs after", notes=notes,
                         extra={"ratios": ratios, "before_s": measured["before"], "after_s": measured["after"]})
    print(json.dumps(row), "->", paths["json"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
