"""The SLURM executor of a study: its units (`pipeline.study.units`) as jobs, only those whose result
files are missing (`pipeline.study.local` is the other executor, over the same units and files).

* one `slurm/pretrain.sbatch` job per (objective, lr, seed) (its preemption, requeue and
  resume from `checkpoints/latest`), unless the run is recorded or its final checkpoint complete;
* one `slurm/study.sbatch eval` job array per run, a task per evaluation point still missing a
  result file, with `--dependency=afterany:<pretraining job>` (a task whose checkpoint is not there
  fails with that message; a diverged run is recorded as failed and the study goes on);
* a `driver` job after the sweep's arrays (`afterany`): it selects the learning rates from the
  sweep's files and submits the seed phase the same way, then a `final` job (the test splits and
  the random-init floor) after the seed phase's arrays.
Every submitted job is appended to `<work>/jobs.jsonl` (`status` reads it); `submit` refuses while
one of them is still queued or running, so a unit never has two jobs.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from pipeline.study.spec import Study, StudyError
from pipeline.study.units import RunKey, point_done, pretrain_overrides, pretraining_done

REPO_ROOT = Path(__file__).resolve().parents[2]


def _require(command: str) -> None:
    """One line (exit 2) where SLURM is not installed here, not a FileNotFoundError."""
    if shutil.which(command) is None:
        raise StudyError(f"SLURM's commands are not on PATH ({command} not found): run submit and status on the "
                         "cluster's login node, or `cpt-study run` to run the study here")


def _slurm(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    _require(cmd[0])
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def _flags(study: Study, kind: str) -> list[str]:
    """sbatch flags of one kind of job from `resources.<kind>` and `resources.sbatch`."""
    res = dict(study.resources.get(kind) or {})
    flags = [str(f) for f in study.resources.get("sbatch") or []]
    for key in ("nodes", "ntasks_per_node", "gpus_per_node", "cpus_per_task", "time", "mem"):
        if res.get(key) not in (None, 0, ""):
            flags.append(f"--{key.replace('_', '-')}={res[key]}")
    return flags + [str(f) for f in res.get("extra") or []]


def sbatch(study: Study, args: list[str], env: dict[str, str], kind: str, unit: str) -> str:
    """`sbatch --parsable ARGS` with `env` added; the job is recorded in `<work>/jobs.jsonl`."""
    run_env = dict(os.environ, CPT_ROOT=str(REPO_ROOT), PYTHON=os.environ.get("PYTHON", sys.executable), **env)
    out = _slurm(["sbatch", "--parsable", *args], env=run_env, cwd=REPO_ROOT)
    if out.returncode != 0:
        raise StudyError(f"sbatch for {kind} {unit} failed ({out.returncode}): {out.stderr.strip()}")
    job = out.stdout.strip().split(";")[0]
    study.work.mkdir(parents=True, exist_ok=True)
    with open(study.work / "jobs.jsonl", "a", encoding="utf-8") as fh:  # one short line per job: append is atomic
        fh.write(json.dumps({"job": job, "kind": kind, "unit": unit, "time": time.strftime("%F %T")}) + "\n")
    print(f"{kind}={job} {unit}", flush=True)
    return job


def registered(study: Study) -> list[dict]:
    path = study.work / "jobs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def queue_states(jobs: list[str]) -> dict[str, str]:
    """job id -> SLURM state of those still in the queue (array tasks folded onto their job id)."""
    if not jobs:
        return {}
    # every queued job, filtered here: `squeue -j` fails outright on an id the controller has forgotten
    out = _slurm(["squeue", "-h", "-o", "%F %T"])
    if out.returncode != 0:
        raise StudyError(f"squeue failed ({out.returncode}): {out.stderr.strip()}")
    states, ours = {}, set(jobs)
    for line in out.stdout.splitlines():
        job, state = line.split()
        if job in ours:
            states.setdefault(job, state)
    return states


def _after(jobs: list[str]) -> list[str]:
    return [f"--dependency=afterany:{':'.join(jobs)}"] if jobs else []


def submit_run(study: Study, key: RunKey, curves: bool) -> list[str]:
    """The pretraining job (if needed) and the evaluation array of the missing points of one run."""
    jobs, run_dir = [], key.directory(study.work)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if not pretraining_done(study, key):
        env = {"CONFIG": study.objectives[key.objective].preset, "OUTPUT_DIR": str(run_dir),
               "OVERRIDES": " ".join(pretrain_overrides(study, key))}
        jobs.append(sbatch(study, ["--job-name=cpt-study-pretrain", f"--output={run_dir}/logs/%x-%j.out",
                                   *_flags(study, "pretrain"), str(REPO_ROOT / "slurm" / "pretrain.sbatch")],
                           env, "pretrain", key.name))
    steps = study.eval_steps(key.objective)
    todo = [i for i, step in enumerate(steps) if not point_done(study, key, step, curves)]
    if todo:
        jobs.append(sbatch(study, ["--job-name=cpt-study-eval", f"--array={','.join(map(str, todo))}",
                                   f"--output={run_dir}/logs/%x-%A_%a.out", *_after(jobs), *_flags(study, "eval"),
                                   str(REPO_ROOT / "slurm" / "study.sbatch"), "eval", str(study.path), key.name,
                                   "curves" if curves else "final"], {}, "eval", key.name))
    return jobs


def submit_study(study: Study) -> list[str]:
    """`cpt-study submit`: the sweep's missing units and the driver job that continues after them."""
    from pipeline.study.results import sweep_keys

    _require("sbatch")  # before any directory is made or job queued
    queued = queue_states([j["job"] for j in registered(study)])
    if queued:
        raise StudyError(f"jobs of this study are still queued or running ({', '.join(f'{j} {s}' for j, s in queued.items())}); "
                         "wait for them or scancel them, then submit again")
    jobs = [j for key in sweep_keys(study) for j in submit_run(study, key, curves=False)]
    logs = study.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    jobs.append(sbatch(study, ["--job-name=cpt-study-driver", f"--output={logs}/%x-%j.out", *_after(jobs),
                               *_flags(study, "driver"), str(REPO_ROOT / "slurm" / "study.sbatch"), "driver",
                               str(study.path)], {}, "driver", "selection + seed phase"))
    return jobs


def submit_seed_phase(study: Study, chosen: dict) -> list[str]:
    """(In the driver job) every seed at each selected learning rate, with curves, then the final job."""
    from pipeline.study.results import selected_keys
    from pipeline.study.units import final_files

    jobs = [j for key in selected_keys(study, chosen) for j in submit_run(study, key, curves=True)]
    if jobs or not all(p.is_file() for k in selected_keys(study, chosen) for p in final_files(study, k)):
        logs = study.work / "logs"
        jobs.append(sbatch(study, ["--job-name=cpt-study-final", f"--output={logs}/%x-%j.out", *_after(jobs),
                                   *_flags(study, "eval"), str(REPO_ROOT / "slurm" / "study.sbatch"), "final",
                                   str(study.path)], {}, "final", "test splits + random-init floor"))
    return jobs


def status_lines(study: Study) -> list[str]:
    """Units done / missing per phase, and the study's jobs still in the queue."""
    from pipeline.study.results import Missing, selected_keys, selection, sweep_keys
    from pipeline.study.units import final_files

    def count(keys: list[RunKey], curves: bool) -> str:
        pre = sum(pretraining_done(study, k) for k in keys)
        pts = [(k, s) for k in keys for s in study.eval_steps(k.objective)]
        done = sum(point_done(study, k, s, curves) for k, s in pts)
        return f"pretraining {pre}/{len(keys)} runs, evaluation {done}/{len(pts)} points"

    lines = [f"study {study.name}: work dir {study.work}", f"sweep: {count(sweep_keys(study), False)}"]
    try:
        chosen, metric = selection(study)
        keys = selected_keys(study, chosen)
        lines.append("selected (" + metric + "): " + ", ".join(f"{o} {s['lr']}" for o, s in chosen.items()))
        lines.append(f"seeds: {count(keys, True)}")
        final = [p.is_file() for k in keys for p in final_files(study, k)]
        lines.append(f"final test: {sum(final)}/{len(final)} result files")
    except Missing:
        lines.append("seeds: after the sweep (not selected yet)")
    jobs = registered(study)
    queued = queue_states([j["job"] for j in jobs])
    lines.append(f"jobs: {len(jobs)} submitted, {len(queued)} queued or running"
                 + "".join(f"\n  {j['job']} {queued[j['job']]} {j['kind']} {j['unit']}" for j in jobs if j["job"] in queued))
    return lines


def run_unit(argv: list[str]) -> int:
    """Entry of `slurm/study.sbatch`: eval STUDY RUN curves|final (the point: SLURM_ARRAY_TASK_ID),
    driver STUDY, final STUDY."""
    from pipeline.study.results import selection, selected_keys
    from pipeline.study.spec import load_study
    from pipeline.study.units import eval_point, final_test, parse_run

    kind, study = argv[0], load_study(argv[1])
    if kind == "eval":
        key = parse_run(argv[2])
        step = study.eval_steps(key.objective)[int(os.environ.get("SLURM_ARRAY_TASK_ID", "0"))]
        eval_point(study, key, step, curves=argv[3] == "curves")
    elif kind == "driver":
        chosen, metric = selection(study)
        print("selected on " + metric + ": " + ", ".join(f"{o} {s['lr']}" for o, s in chosen.items()), flush=True)
        submit_seed_phase(study, chosen)
    elif kind == "final":
        final_test(study, selected_keys(study, selection(study)[0]))
    else:
        raise StudyError(f"unknown unit kind {kind!r} (eval, driver, final)")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    try:
        return run_unit(list(sys.argv[1:] if argv is None else argv))
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
