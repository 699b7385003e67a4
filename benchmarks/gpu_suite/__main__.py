"""`python -m benchmarks.gpu_suite`: one front door for the project's GPU evidence.

    python -m benchmarks.gpu_suite --plan [modernbert]    # a plan's device commands in order, budgets, carry list
    python -m benchmarks.gpu_suite --prepare              # here: wheels + carried data; prints the commands
    python -m benchmarks.gpu_suite --stage NAME --out D   # on the GPU machine (D = $OUT): one stage's files
    python -m benchmarks.gpu_suite --dry-run --out D      # CPU rehearsal of every stage of every plan + the plan checks
    python -m benchmarks.gpu_suite --collect DIR [DIR..]  # here: file a command's results, regenerate README's table

Exit codes: 0 done (a stage that ran but missed a target still exits 0: its files say so); 1 a
stage could not measure (the image lacks something, a correctness check failed) or the plan breaks
a limit; 2 bad arguments.
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_suite", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--plan", nargs="?", const="core", metavar="NAME",
                      help="print a plan's GPU commands in order and check the limits (core, the default, runs first; "
                           "modernbert: the ModernBERT comparison, a lease of its own)")
    mode.add_argument("--prepare", action="store_true", help="build .whl and the carried data folder, print the commands")
    mode.add_argument("--stage", metavar="NAME", help="run one stage (add --dry-run for its CPU rehearsal)")
    mode.add_argument("--collect", nargs="+", metavar="DIR", help="file result folders and regenerate README's table")
    mode.add_argument("--table", action="store_true", help="only regenerate README's table from the committed results")
    p.add_argument("--dry-run", action="store_true", help="CPU rehearsal at tiny shapes (alone: every stage)")
    p.add_argument("--out", default=None, help="result folder (the device's $OUT)")
    p.add_argument("--shared", default=None, help="--prepare: the shared folder (default: ../shared beside the project)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--dry-run"] or (argv and "--dry-run" in argv and "--stage" not in argv and
                                 not any(a in argv for a in ("--plan", "--prepare", "--collect", "--table"))):
        argv = ["--stage", "all", *argv]  # `--dry-run` alone rehearses every stage
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dry_run and args.stage is None:
        parser.error("--dry-run goes alone (every stage) or with --stage NAME")
    from benchmarks.gpu_suite import plan

    if args.plan:
        if args.plan not in plan.PLANS:
            parser.error(f"--plan {args.plan}: no such plan; choose from {', '.join(plan.PLANS)}")
        stages = plan.PLANS[args.plan]
        print(plan.describe(stages, args.plan))
        from benchmarks.gpu_suite.prepare import carry_problems

        problems = plan.check_plan(stages, carry_bytes=plan.travelling_bytes()) + carry_problems()
        for line in problems:
            print(f"plan check: {line}")
        print("plan check: fits every limit" if not problems else "plan check: FAILED")
        return 1 if problems else 0
    if args.prepare:
        from benchmarks.gpu_suite.prepare import prepare

        return prepare(args.shared)
    if args.collect or args.table:
        from benchmarks.gpu_suite.collect import collect_main

        return collect_main(args.collect or [])
    if args.out is None:
        parser.error("--stage needs --out DIR (on the GPU machine: --out $OUT)")
    if args.stage == "all":
        if not args.dry_run:
            parser.error("--stage all exists only as the dry run (--dry-run); on a GPU run one stage per command")
        return dry_run_all(Path(args.out))
    try:
        stage = plan.stage_named(args.stage)
    except KeyError as err:
        parser.error(str(err.args[0]))
    return run_stage(stage, Path(args.out), args.dry_run)


def run_stage(stage, out: Path, dry_run: bool) -> int:
    """Run one stage in this process; its files go to `out`."""
    if dry_run:  # the kernels must see the interpreter switch before they are first imported
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from benchmarks.gpu_suite.env_stage import EnvironmentError_
    from benchmarks.gpu_suite.stage_io import StageContext

    module, function = stage.runner.split(":")
    ctx = StageContext(stage, out, dry_run)
    print(f"stage {stage.name}: {stage.title}; budget {ctx.budget_s:.0f} s{' (dry run)' if dry_run else ''}", flush=True)
    try:
        code = getattr(importlib.import_module(module), function)(ctx)
    except EnvironmentError_ as err:
        ctx.notes.append(f"stopped: {err}")
        ctx.write({}, [])
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 - the files still come back, saying what broke
        import traceback

        traceback.print_exc()
        ctx.notes.append(f"stage failed: {type(err).__name__}: {err}")
        ctx.write({}, [])
        return 1
    from benchmarks.gpu_suite.stage_io import print_targets
    import json

    payload = json.loads((out / f"{stage.name}.json").read_text())
    print_targets(payload["targets"])
    print(f"stage {stage.name}: {payload['wall_s']} s; files: {', '.join(payload['files'])}", flush=True)
    return code


def dry_run_all(out: Path) -> int:
    """Every stage's rehearsal (every plan's), each in its own process as on the GPU machine, then each
    plan's check with the measured times against the dry budgets and the files each wrote."""
    from benchmarks.gpu_suite import plan

    measured, files, failed = {}, {}, []
    for stage in plan.ALL_STAGES:
        stage_out = out / stage.name
        started = time.monotonic()
        code = subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", "--stage", stage.name, "--dry-run",
                               "--out", str(stage_out)], cwd=plan.REPO).returncode
        measured[stage.name] = time.monotonic() - started
        files[stage.name] = sum(1 for p in stage_out.rglob("*") if p.is_file()) if stage_out.is_dir() else 0
        if code != 0 or not (stage_out / f"{stage.name}.json").is_file():
            failed.append(f"{stage.name}: exit {code}")
        print(f"dry run {stage.name}: exit {code}, {measured[stage.name]:.1f} s, {files[stage.name]} files", flush=True)
    problems = list(failed)
    for name, stages in plan.PLANS.items():
        mine = {s.name for s in stages}
        problems += [f"plan {name}: {line}" for line in plan.check_plan(
            stages, measured_s={k: v for k, v in measured.items() if k in mine}, dry_run=True,
            files_written={k: v for k, v in files.items() if k in mine})]
    for line in problems:
        print(f"plan check: {line}")
    print("dry run: every stage ran and the plan fits" if not problems else "dry run: FAILED")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
