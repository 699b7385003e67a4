"""`python -m benchmarks.gpu_suite`: one front door for the project's GPU evidence.

    python -m benchmarks.gpu_suite --plan [modernbert]       # the commands to type on a lease, the lease arithmetic, readiness
    python -m benchmarks.gpu_suite --prepare                 # here, before a lease: .whl/ (wheels) + .gpu_suite/source.json
    python -m benchmarks.gpu_suite --stage NAME --out $OUT   # on the lent GPU, after the install line: one command's rows (--dry-run: on the CPU)
    python -m benchmarks.gpu_suite --local [modernbert] --out DIR  # a GPU of your own (no lease, no $OUT): every command of a plan
    python -m benchmarks.gpu_suite --dry-run --out DIR       # CPU rehearsal of every command of every plan + the plan checks
    python -m benchmarks.gpu_suite --collect DIR [DIR ...]   # here: file returned results, regenerate README's table

Exit codes: 0 done (a row that failed or missed a target still exits 0: the files say so); 1 a
command could not measure (the machine lacks something) or a plan breaks a limit; 2 bad arguments.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

#: The deadline counts from here: the first thing the process runs (before torch's import).
PROCESS_START = time.monotonic()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_suite", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--plan", nargs="?", const="core", metavar="NAME",
                      help="print a plan's device commands and check it against the lease (core, the default; "
                           "modernbert: a lease of its own)")
    mode.add_argument("--prepare", action="store_true", help="build .whl and .gpu_suite/source.json for a lease")
    mode.add_argument("--stage", metavar="NAME", help="run one command's rows in this process")
    mode.add_argument("--local", nargs="?", const="core", metavar="PLAN",
                      help="on a GPU of your own: every command of PLAN, one process each, no deadline, files in --out")
    mode.add_argument("--collect", nargs="+", metavar="DIR", help="file result folders and regenerate README's table")
    mode.add_argument("--table", action="store_true", help="only regenerate README's table from the committed results")
    p.add_argument("--dry-run", action="store_true",
                   help="the CPU rehearsal at tiny shapes: alone, of every command of every plan; with --stage, of one")
    p.add_argument("--out", default=None, help="result folder (on a lease: $OUT)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="--stage: seconds from the start after which no row starts (default: the plan's on a lease; "
                        "none with --dry-run or --local; inf: none)")
    p.add_argument("--shared", default=None, help="--prepare: the shared folder (default: ../shared beside the project)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.plan or args.prepare or args.stage or args.local or args.collect or args.table or args.dry_run):
        parser.error("one of --plan, --prepare, --stage, --local, --dry-run, --collect, --table is required")
    if args.dry_run and (args.plan or args.prepare or args.local or args.collect or args.table):
        parser.error("--dry-run goes alone (every command) or with --stage NAME")
    from benchmarks.gpu_suite import plan

    if args.plan:
        if args.plan not in plan.PLANS:
            parser.error(f"--plan {args.plan}: no such plan; choose from {', '.join(plan.PLANS)}")
        return plan.show_plan(args.plan)
    if args.prepare:
        from benchmarks.gpu_suite.prepare import prepare

        return prepare(args.shared)
    if args.collect or args.table:
        from benchmarks.gpu_suite.collect import collect_main

        return collect_main(args.collect or [])
    if args.out is None:
        parser.error("--stage, --local and --dry-run need --out DIR (on a lease: --out $OUT)")
    if args.local:
        if args.local not in plan.PLANS:
            parser.error(f"--local {args.local}: no such plan; choose from {', '.join(plan.PLANS)}")
        return run_plan(plan.PLANS[args.local], Path(args.out), rehearse=False)
    if args.stage is None:  # --dry-run alone
        return run_plan(plan.ALL_STAGES, Path(args.out), rehearse=True)
    try:
        stage = plan.stage_named(args.stage)
    except KeyError as err:
        parser.error(str(err.args[0]))
    if args.dry_run:  # the kernels must see the interpreter switch before they are first imported
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    lease = args.deadline_s is None and not args.dry_run
    deadline = stage.deadline_s if lease else args.deadline_s
    deadline = None if deadline is None or math.isinf(deadline) else deadline
    command = stage.command() if lease else " ".join(["python -m benchmarks.gpu_suite", *argv])
    from benchmarks.gpu_suite.runner import run_stage

    return run_stage(stage, Path(args.out), args.dry_run, deadline, command, started=PROCESS_START)


def run_plan(stages, out: Path, rehearse: bool) -> int:
    """Each stage in its own process, as on a lease (`--local`: on this GPU, no deadline; the dry run:
    at tiny shapes on the CPU, each in `out/<stage>/`), then the plan checks: every stage exited 0 and
    wrote its JSON, within the files that come back; every plan fits the lease (arithmetic, no clock)."""
    from benchmarks.gpu_suite import plan

    failed, files = [], {}
    for stage in stages:
        stage_out = out / stage.name if rehearse else out
        cmd = [sys.executable, "-m", "benchmarks.gpu_suite", "--stage", stage.name, "--out", str(stage_out),
               "--deadline-s", "inf"] + (["--dry-run"] if rehearse else [])
        code = subprocess.run(cmd, cwd=plan.REPO).returncode
        if code != 0 or not (stage_out / f"{stage.name}.json").is_file():
            failed.append(f"{stage.name}: exit {code}")
        files[stage.name] = sum(1 for p in stage_out.glob(f"{stage.name}*") if p.is_file())
        print(f"{'dry run' if rehearse else 'local'} {stage.name}: exit {code}, {files[stage.name]} files", flush=True)
    problems = list(failed)
    for name, plan_stages in plan.PLANS.items():
        mine = {s.name for s in plan_stages}
        problems += [f"plan {name}: {line}" for line in plan.check_plan(
            plan_stages, files_written={k: v for k, v in files.items() if k in mine})]
    for line in problems:
        print(f"plan check: {line}")
    print(("dry run" if rehearse else "local run") + (": every stage ran and the plans fit" if not problems
                                                     else ": FAILED"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
