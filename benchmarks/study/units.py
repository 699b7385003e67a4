"""The units of a SLURM study, each run inside a job and each leaving its result files.

The CPU study's units (`benchmarks.quality.ttq_study`: `heldout_at`, `downstream_at`,
`run_record`, `select_lrs`) are used as they are; what differs is who trains (a
`slurm/pretrain.sbatch` job per run) and who evaluates (one array task per evaluation point).

Layout under the study's work dir (the CPU study's, so a unit is "done" when its file exists):

    runs/<objective>/lr_<lr>/seed_<seed>/   the pretraining run (checkpoints/, metrics.jsonl, logs/)
        train.json                          GPU-seconds and health from the run's own metrics (`train_record`)
        hf/step_<N>/                        the converted checkpoint of each evaluation point
        eval/heldout_step_<N>.json          held-out masked-LM metrics (both halves)
        downstream/<task>/step_<N>/seed_<s>.json   fine-tuning, per fine-tuning seed
        downstream/<task>/final_test/seed_<s>.json test split (selected runs; MLM's first seed: the floor too)
    tasks/<task>/select.tsv                 the task's selection split (train examples never fine-tuned on)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from benchmarks.quality.ttq_data import StudyData, prepare_sst2
from benchmarks.quality.ttq_eval import cached, convert_once, top_token_of, write_json
from benchmarks.quality.ttq_study import EXIT_NONFINITE, RunKey, downstream_at, heldout_at, run_record
from benchmarks.study.spec import Study, StudyError, Task


def parse_run(name: str) -> RunKey:
    """`objective/lr<lr>/seed<seed>` (`RunKey.name`) -> RunKey."""
    try:
        objective, lr, seed = name.split("/")
        return RunKey(objective, float(lr.removeprefix("lr")), int(seed.removeprefix("seed")))
    except ValueError:
        raise StudyError(f"{name!r}: expected OBJECTIVE/lr<LR>/seed<SEED>") from None


def study_data(study: Study, task: Optional[Task]) -> StudyData:
    """The CPU study's data record for one downstream task (None: held-out metrics only)."""
    sh = study.shards
    if task is None:
        return StudyData(sh["train"], sh["heldout_select"], sh["heldout_report"], None, None)
    root, select, note = prepare_sst2(str(task.dir), study.work, task.train_examples, task.select_examples,
                                      study.subset_seed, task=task.name,
                                      select=study.work / "tasks" / task.name / "select.tsv")
    if root is None:
        raise StudyError(f"{study.path}: tasks {task.name}: {note}")
    return StudyData(sh["train"], sh["heldout_select"], sh["heldout_report"], root, select, note)


def top_token(study: Study) -> int:
    return cached(study.work / "top_token.json", lambda: {"top_token": top_token_of(study.shards["train"])})["top_token"]


def pretrain_overrides(study: Study, key: RunKey) -> list[str]:
    """`pipeline.train` overrides of one run: the objective's own, then the study's recipe with this
    run's learning rate and seed, a checkpoint at every evaluation point (all kept) and every step
    logged (its time is the run's GPU-seconds)."""
    steps = study.steps_of[key.objective]
    return [*study.objectives[key.objective].overrides, f"data.shards_dir={study.shards['train']}",
            f"train.total_steps={steps}", f"train.checkpoint_every={study.eval_every}", "train.keep_last=1000000",
            "train.log_every=1", "train.resume=auto", f"train.seed={key.seed}", f"optim.lr={key.lr}",
            f"optim.warmup_steps={max(1, round(study.warmup_ratio * steps))}"]


def final_tags(study: Study, key: RunKey) -> dict[int, Path]:
    """The complete checkpoints of a run at its evaluation points."""
    from pipeline.train.checkpoint import is_complete, list_tags

    points = set(study.eval_steps(key.objective))
    return {step: tag for step, tag in list_tags(key.directory(study.work) / "checkpoints")
            if step in points and is_complete(tag)}


def pretraining_done(study: Study, key: RunKey) -> bool:
    """The run needs no pretraining job: recorded, or its final checkpoint is complete."""
    run_dir = key.directory(study.work)
    return (run_dir / "train.json").is_file() or study.steps_of[key.objective] in final_tags(study, key)


def diverged(run_dir: Path) -> bool:
    """A rank of the last pretraining job exited with the non-finite loss guard's code."""
    jobs = sorted((run_dir / "logs").glob("*/"), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    return bool(jobs) and any(f.read_text().strip() == str(EXIT_NONFINITE) for f in jobs[-1].glob("rank*.exit"))


def train_record(study: Study, key: RunKey) -> dict:
    """`train.json` of a finished run (made once): GPU-seconds per evaluation point from its metrics,
    world size from its checkpoint; a diverged run is recorded as failed, an unfinished one is an error."""
    from pipeline.train.metrics import read_jsonl

    run_dir = key.directory(study.work)
    done = run_dir / "train.json"
    if done.is_file():
        return json.loads(done.read_text())
    steps = study.steps_of[key.objective]
    tags = final_tags(study, key)
    if steps not in tags:
        if diverged(run_dir):
            record = {"run": key.name, "status": "failed", "error": "non-finite loss (pipeline.train exit 3)"}
            write_json(done, record)
            return record
        raise StudyError(f"{key.name}: pretraining not finished (complete checkpoints at steps {sorted(tags)} of "
                         f"{steps}; logs: {run_dir / 'logs'}): run `cpt-study submit {study.path}` again")
    meta = json.loads((tags[steps] / "pipeline_meta.json").read_text())
    records = read_jsonl(run_dir / "metrics.jsonl")
    logged = [r["step"] for r in records]
    if logged != list(range(1, steps + 1)):
        raise StudyError(f"{run_dir / 'metrics.jsonl'}: expected steps 1..{steps} once each (train.log_every=1), "
                         f"found {len(logged)} records")
    record = run_record(key, records, sorted(tags), int(meta["world_size"]))
    write_json(done, record)
    return record


def point_files(study: Study, key: RunKey, step: int, curves: bool) -> list[Path]:
    """The result files an evaluation point leaves (downstream at every point with `curves`, else at the last)."""
    run_dir = key.directory(study.work)
    files = [run_dir / "eval" / f"heldout_step_{step}.json"]
    if curves or step == study.steps_of[key.objective]:
        files += [run_dir / "downstream" / t.name / f"step_{step}" / f"seed_{s}.json"
                  for t in study.tasks for s in study.finetune["seeds"]]
    return files


def point_done(study: Study, key: RunKey, step: int, curves: bool) -> bool:
    record = key.directory(study.work) / "train.json"
    if record.is_file() and json.loads(record.read_text())["status"] != "ok":
        return True  # a diverged run has nothing to evaluate
    return all(p.is_file() for p in point_files(study, key, step, curves))


def eval_point(study: Study, key: RunKey, step: int, curves: bool) -> None:
    """One array task: record the run, convert the checkpoint, held-out metrics, fine-tune each task."""
    record = train_record(study, key)
    if record["status"] != "ok":
        print(f"[{key.name}] {record['status']}: {record['error']}: nothing to evaluate", flush=True)
        return
    run_dir = key.directory(study.work)
    hf = run_dir / "hf" / f"step_{step}"
    if not (hf / "config.json").is_file():
        convert_once(final_tags(study, key)[step], hf)
    held = heldout_at(key, step, study_data(study, None), top_token(study), study.args(key.objective), study.work)
    print(f"[{key.name}] step {step}: held-out MLM acc {held['report']['mlm_acc']:.4f}", flush=True)
    if curves or step == study.steps_of[key.objective]:
        for task in study.tasks:
            result = downstream_at(key, step, study_data(study, task), study.args(key.objective, task), study.work,
                                   task=task.name)
            print(f"[{key.name}] step {step}: {task.name} dev {result['pretrained']['dev']['mean']:.4f}", flush=True)


def final_files(study: Study, key: RunKey) -> list[Path]:
    run_dir = key.directory(study.work)
    return [run_dir / "downstream" / t.name / "final_test" / f"seed_{s}.json"
            for t in study.tasks for s in study.finetune["seeds"]]


def with_floor(study: Study, key: RunKey) -> bool:
    """The randomly initialised floor is fine-tuned once, beside MLM's first seed."""
    return key.objective == "mlm" and key.seed == study.seeds[0]


def final_test(study: Study, selected: list[RunKey]) -> None:
    """The test split of every task, scored once per selected run (and the floor)."""
    import shutil

    for key in selected:
        if train_record(study, key)["status"] != "ok":
            continue
        for task in study.tasks:
            downstream_at(key, study.steps_of[key.objective], study_data(study, task),
                          study.args(key.objective, task), study.work, final_test=True,
                          random_init=with_floor(study, key), task=task.name)
    if not study.keep_checkpoints:  # the DeepSpeed checkpoints of every run whose points are all converted
        for record in study.work.glob("runs/*/lr_*/seed_*/train.json"):
            run_dir = record.parent
            steps = json.loads(record.read_text()).get("steps") or []
            if steps and all((run_dir / "hf" / f"step_{s}" / "config.json").is_file() for s in steps):
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
