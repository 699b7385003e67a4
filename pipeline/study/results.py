"""The study read back from its result files alone: the selection (`driver` job) and the report (`collect`).

Whichever executor ran the units, the report is `pipeline.study.report.write_study_report`, once
per downstream task (`<out>/<task>/`; `<out>/` alone without tasks or with `per_task_dirs=False`): tables,
plots, intervals and health checks.
Its x-axis is the runs' measured device-hours (`train.json`: world size x the logged step times).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from pipeline.study.spec import Study, StudyError, Task
from pipeline.study.units import RunKey, final_files, point_files, select_lrs, sts_file, with_floor


class Missing(StudyError):
    """Result files not there yet (the message lists the first ones)."""


def _read(path: Path, missing: list[Path]) -> Optional[dict]:
    if path.is_file():
        return json.loads(path.read_text())
    missing.append(path)
    return None


def _merge(parts: list[Optional[dict]]) -> Optional[dict]:
    from pipeline.study.evaluate import merge_finetune_summaries

    return merge_finetune_summaries(parts) if parts and all(p is not None for p in parts) else None


def read_run(study: Study, key: RunKey, curves: bool, task: Optional[Task], missing: list[Path]) -> dict:
    """One run, from its files (absent ones appended to `missing`): {key, train, status, points, final}."""
    run_dir = key.directory(study.work)
    train = _read(run_dir / "train.json", missing) or {"status": "missing"}
    out = {"key": key, "train": train, "status": train["status"], "points": [], "final": None}
    if train["status"] != "ok":
        return out
    final_step = study.steps_of[key.objective]
    for step in train["steps"]:
        files = point_files(study, key, step, curves)
        heldout = _read(files[0], missing)
        sts = _read(sts_file(run_dir, step), missing) if study.sts else None
        downstream = None
        if task is not None and (curves or step == final_step):
            downstream = _merge([_read(run_dir / "downstream" / task.name / f"step_{step}" / f"seed_{s}.json", missing)
                                 for s in study.finetune["seeds"]])
        out["points"].append({"step": step, "device_hours": train["device_hours"][str(step)], "heldout": heldout,
                              "tokens": (train.get("tokens") or {}).get(str(step)), "sts": sts,
                              "downstream": downstream})
    out["final"] = out["points"][-1] if out["points"] else None
    return out


def _raise_missing(missing: list[Path], what: str, study: Study) -> None:
    if missing:
        shown = ", ".join(str(p.relative_to(study.work)) for p in missing[:4])
        raise Missing(f"{what}: {len(missing)} result file(s) missing under {study.work} ({shown}"
                      f"{', ...' if len(missing) > 4 else ''}); `cpt-study status {study.path}` says which jobs "
                      f"are queued, `cpt-study submit {study.path}` runs the missing units")


def sweep_keys(study: Study) -> list[RunKey]:
    return [RunKey(o, lr, study.seeds[0]) for o in study.objectives for lr in study.lrs]


def selection(study: Study) -> tuple[dict, str]:
    """The learning rate of each objective, chosen on the study's `select` validation metric, else the first
    task's selection split (no task: the held-out selection half), from the sweep's files; raises `Missing`
    while the sweep is unfinished."""
    task = study.tasks[0] if study.tasks else None
    metric = study.select or ("sst2_select_accuracy" if task else "heldout_select_mlm_loss")
    missing: list[Path] = []
    sweep: dict[str, dict[float, dict]] = {}
    for key in sweep_keys(study):
        sweep.setdefault(key.objective, {})[key.lr] = read_run(study, key, False, task, missing)
    _raise_missing(missing, "the learning-rate sweep", study)
    return select_lrs(sweep, metric), metric


def selected_keys(study: Study, chosen: dict) -> list[RunKey]:
    return [RunKey(o, s["lr"], seed) for o, s in chosen.items() if s["lr"] is not None for seed in study.seeds]


def study_records(study: Study, task: Optional[Task]) -> dict:
    """What `write_study_report` takes, for one task, from the files of every unit."""
    chosen, metric = selection(study)
    missing: list[Path] = []
    sweep: dict[str, dict[float, dict]] = {}
    for key in sweep_keys(study):
        sweep.setdefault(key.objective, {})[key.lr] = read_run(study, key, False, task, missing)
    selected: dict[str, list[dict]] = {}
    final, floor = {}, None
    for key in selected_keys(study, chosen):
        run = read_run(study, key, True, task, missing)
        selected.setdefault(key.objective, []).append(run)
        if run["status"] != "ok" or task is None:
            continue
        files = [p for p in final_files(study, key) if p.parent.parent.name == task.name]
        result = _merge([_read(p, missing) for p in files])
        final[key.name] = result
        if with_floor(study, key) and result is not None:
            floor = result.get("random_init")
    _raise_missing(missing, "the study", study)
    return {"metric": metric, "sweep": sweep, "selection": chosen, "selected": selected, "final": final,
            "floor": floor}


def cost_rows(study: Study) -> list[dict]:
    """Per run: the GPU-seconds of its training steps and the steps counted (each once)."""
    rows = []
    for path in sorted(study.work.glob("runs/*/lr_*/seed_*/train.json")):
        rec = json.loads(path.read_text())
        if rec.get("status") == "ok":
            last = str(rec["steps"][-1])
            rows.append({"run": rec["run"], "world_size": rec["world_size"], "counted_steps": rec["counted_steps"],
                         "gpu_seconds": rec["gpu_seconds"][last], "gpu_hours": rec["gpu_seconds"][last] / 3600.0})
    return rows


def collect(study: Study, out: Path, per_task_dirs: bool = True, notes: list[str] | None = None,
            extra: dict | None = None) -> list[dict]:
    """Every report of the study under `out`; returns each one's verdict and paths."""
    from pipeline.study.report import write_study_report

    results = []
    costs = cost_rows(study)
    for task in study.tasks or [None]:
        records = study_records(study, task)
        args = study.args("mlm", task)
        budget = (f"{study.budget} per run ({', '.join(f'{o}: {s} steps' for o, s in study.steps_of.items())}), "
                  f"warm-up {study.warmup_ratio:g} of the steps, evaluated every {study.eval_every} steps")
        task_notes = [f"budget: {budget}",
                      f"study {study.name} ({study.path}); downstream task: {task.name if task else 'none'} "
                      "(its columns keep the sst2_* names)",
                      "device_hours = GPU-hours measured by each run: world size x its logged step times, each step "
                      "once (a preempted run's redone steps replace the dropped records), no queue or evaluation time",
                      *(notes or [])]
        payload = {"budget": budget, "study": str(study.path), "task": task.name if task else None,
                   "gpu_seconds": costs, "total_gpu_hours": sum(r["gpu_hours"] for r in costs), **(extra or {})}
        target = out / task.name if task and per_task_dirs else out
        result = write_study_report(records, args, task_notes, target, payload)
        results.append({"task": task.name if task else None, **result})
    return results
