"""`cpt-study plan|submit|run|status|collect STUDY.yaml`: the time-to-quality study, on a SLURM cluster or here.

    cpt-study plan    studies/bert-base.yaml   # jobs and estimated GPU-hours; submits nothing
    cpt-study submit  studies/bert-base.yaml   # the units whose result files are missing (again after a failure)
    cpt-study run     studies/tiny.yaml        # the same units in this process (the local executor), then collect
    cpt-study status  studies/bert-base.yaml   # units done per phase, the study's jobs in the queue
    cpt-study collect studies/bert-base.yaml --out REPORT_DIR   # the CPU study's report, from the files alone

The study file format: `pipeline/study/spec.py`; the units: `pipeline/study/units.py`; the executors:
`pipeline/study/jobs.py` (SLURM) and `pipeline/study/local.py` (here; `studies/cpu-small.yaml` is the CPU study);
docs/slurm.md#the-time-to-quality-study-on-slurm walks through a run on a cluster.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from pipeline.study.spec import StudyError, check_work_dir, load_study


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpt-study", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("command", choices=("plan", "submit", "run", "status", "collect"))
    p.add_argument("study", help="the study file (YAML)")
    p.add_argument("--out", default="", help="run, collect: report directory (default: <work_dir>/report); "
                   "plan: also write the plan as JSON here")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        # plan needs no data yet (a study is planned before its shards exist); the others do
        study = load_study(args.study, check_data=args.command != "plan")
        if args.command == "plan":
            from pipeline.study.plan import format_plan, plan, write_plan

            p = plan(study)
            print(format_plan(p))
            if args.out:
                write_plan(p, Path(args.out) / "plan.json")
        elif args.command == "submit":
            from pipeline.study.jobs import submit_study
            from pipeline.study.plan import format_plan, plan

            costs = [line for line in format_plan(plan(study)).splitlines()
                     if line.startswith(("jobs:", "estimated GPU-hours:"))]
            print("\n".join(costs), flush=True)  # what the whole study costs
            check_work_dir(study, record=False)  # refused before anything is queued, recorded once it is
            jobs = submit_study(study)
            check_work_dir(study)
            print(f"submitted {len(jobs)} job(s); the driver job submits the seed phase when the sweep ends "
                  f"(`cpt-study status {args.study}`)")
        elif args.command == "status":
            from pipeline.study.jobs import status_lines

            print("\n".join(status_lines(study)))
        else:
            from pipeline.study.stop_signal import sigterm_stops
            from pipeline.study.local import run_study
            from pipeline.study.results import collect

            if args.command == "run":
                check_work_dir(study)
                with sigterm_stops():  # `kill PID`: the running training checkpoints, a re-run resumes
                    run_study(study)
            out = Path(args.out) if args.out else study.work / "report"
            for result in collect(study, out):
                print(f"[{result['task'] or 'held-out only'}] {result['verdict']}")
                print(f"wrote {result['paths']['json']} and {result['paths']['md']}")
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stopped: run the same command again to resume (finished units are kept)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
