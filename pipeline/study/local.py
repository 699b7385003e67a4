"""The local executor of a study: every unit of `pipeline.study.units` in order, in this process.

Each pretraining run is the real `python -m pipeline.train` in a child process (or under a
`launcher`, e.g. `torchrun --nproc_per_node 8`); its evaluation points, the selection, the seed phase
and the final test splits follow as the SLURM executor (`pipeline.study.jobs`) runs them, over the
same units and result files, so a study started by one executor can be finished by the other and
`cpt-study collect` reports either. Run by `cpt-study run STUDY.yaml` (the CPU study:
`studies/cpu-small.yaml`).
"""
from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
import sys
from typing import Sequence

from pipeline.report_files import write_json
from pipeline.study.results import selected_keys, selection, sweep_keys
from pipeline.study.spec import Study, StudyError
from pipeline.study.units import (EXIT_NONFINITE, RunKey, eval_point, final_test, point_done, pretrain_overrides,
                                  pretraining_done, train_record)
from pipeline.train.exit_record import last_error_line

#: Seconds a stopped training child gets to write its checkpoint before it is killed.
STOP_GRACE_S = 300


def run_child(cmd: list[str], log) -> int:
    """Run `cmd` to completion; if this process is stopped (SIGTERM, turned into an exception by
    `pipeline.study.stop_signal.sigterm_stops`, or Ctrl-C), pass SIGTERM on, so `pipeline.train`
    writes a checkpoint and exits, and the re-run resumes from it."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        return proc.wait()
    except BaseException:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


def train_run(study: Study, key: RunKey, launcher: Sequence[str] = ()) -> dict:
    """Train (or resume) one run in a child process (log: `<run>/train.log`) and record it (`train.json`);
    a run the non-finite guard stops is recorded as failed, any other failure stops the study."""
    run_dir = key.directory(study.work)
    if not pretraining_done(study, key):
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = [*(launcher or [sys.executable]), "-m", "pipeline.train", "--config", study.objectives[key.objective].preset,
               *pretrain_overrides(study, key), f"train.output_dir={run_dir}", "train.tensorboard=false",
               "train.progress_bar=false"]
        print(f"[{key.name}] $ {shlex.join(cmd)}", flush=True)
        with open(run_dir / "train.log", "a", encoding="utf-8") as log:
            code = run_child(cmd, log)
        error = last_error_line((run_dir / "train.log").read_text(errors="replace"))
        if code == EXIT_NONFINITE:
            record = {"run": key.name, "status": "failed", "error": error}
            write_json(run_dir / "train.json", record)
            return record
        if code != 0:
            raise StudyError(f"{key.name}: pipeline.train exit {code}: {error} (log: {run_dir / 'train.log'})")
    return train_record(study, key)


def evaluate_run(study: Study, key: RunKey, curves: bool, launcher: Sequence[str] = ()) -> dict:
    """Train one run and evaluate every evaluation point still missing its files (`units.eval_point`);
    without `keep_checkpoints` its DeepSpeed checkpoints go once every point is converted."""
    record = train_run(study, key, launcher)
    if record["status"] == "ok":
        for step in study.eval_steps(key.objective):
            if not point_done(study, key, step, curves):
                eval_point(study, key, step, curves)
        if not study.keep_checkpoints:
            shutil.rmtree(key.directory(study.work) / "checkpoints", ignore_errors=True)
    return record


def run_study(study: Study, launcher: Sequence[str] = ()) -> None:
    """Sweep, selection, seeds and final test, each unit skipped when its files exist."""
    for key in sweep_keys(study):
        evaluate_run(study, key, curves=False, launcher=launcher)
    chosen, metric = selection(study)
    print("selected on " + metric + ": " + ", ".join(f"{o} {s['lr']}" for o, s in chosen.items()), flush=True)
    keys = selected_keys(study, chosen)
    for key in keys:
        evaluate_run(study, key, curves=True, launcher=launcher)
    final_test(study, keys)
