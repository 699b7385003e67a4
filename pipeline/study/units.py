"""The units of the time-to-quality study, each leaving its result files; both executors run them.

The study walks sweep -> selection -> seeds -> final over these units: a pretraining run per
(objective, lr, seed) (`pretrain_overrides`, recorded by `train_record`), one evaluation per
checkpoint (`eval_point`: conversion, held-out metrics, zero-shot STS with `sts:`, fine-tuning on each task), the learning-rate
selection (`select_lrs`, on a selection split only) and the test splits once (`final_test`). Who
runs them is the executor's business: `pipeline.study.local` (in this process; the CPU study and
`cpt-study run`) or `pipeline.study.jobs` (SLURM jobs; `cpt-study submit`).

Order of work (each unit leaves a JSON file; a re-run skips every unit whose file exists, and an
interrupted training run resumes from its last checkpoint through `pipeline.train`'s own exact resume):

1. **sweep**: every objective (MLM included) trains once per learning rate with the first seed;
   every checkpoint gets the held-out masked-LM metrics; the final one is fine-tuned on each task;
2. **selection** (`select_lrs`): per objective, the learning rate with the best *selection* metric
   at the final checkpoint: the first task's accuracy on its selection split (train examples never
   fine-tuned on; ties broken by the next item), or, without tasks, the masked-LM loss on the
   `heldout-select` half, or the study's `select: val/<metric>` (the runs' last validation record, on the
   `heldout-select` half). The reported numbers (dev and test, the `heldout-report` half) never take part;
3. **seeds**: the remaining seeds at the selected learning rate; every checkpoint of every selected
   run is fine-tuned (the downstream curves);
4. **final**: the final checkpoint of every selected run is fine-tuned once more with `test.tsv`
   scored (the only time it is), and once, beside MLM's first seed, the randomly initialised model
   of the same shape (the floor).

A training run that the non-finite guard stops (exit 3) is recorded as failed and the study goes on
(such a learning rate cannot be selected).

Layout under the study's work dir (a unit is "done" when its file exists):

    runs/<objective>/lr_<lr>/seed_<seed>/   the pretraining run (checkpoints/, metrics.jsonl, logs/)
        train.json                          GPU-seconds and health from the run's own metrics (`train_record`)
        hf/step_<N>/                        the converted checkpoint of each evaluation point
        eval/heldout_step_<N>.json          held-out masked-LM metrics (both halves)
        eval/sts_step_<N>.json              zero-shot STS-B dev and test with its reference points (`sts:`)
        downstream/<task>/step_<N>/seed_<s>.json   fine-tuning, per fine-tuning seed
        downstream/<task>/final_test/seed_<s>.json test split (selected runs; MLM's first seed: the floor too)
    tasks/<task>/select.tsv                 the task's selection split (train examples never fine-tuned on)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline.report_files import write_json
from pipeline.study.data import StudyData, prepare_sst2
from pipeline.study.evaluate import (cached, convert_once, finetune_sst2, heldout_metrics, merge_finetune_summaries,
                                     top_token_of)
from pipeline.study.spec import Study, StudyError, Task

#: pipeline.train exit code of the non-finite loss guard (a run that diverged: recorded, not fatal).
EXIT_NONFINITE = 3


@dataclass(frozen=True)
class RunKey:
    objective: str
    lr: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.objective}/lr{self.lr:g}/seed{self.seed}"

    def directory(self, work: Path) -> Path:
        return work / "runs" / self.objective / f"lr_{self.lr:g}" / f"seed_{self.seed}"


def cumulative_hours(records: list[dict], world_size: int) -> dict[int, float]:
    """step -> device-hours of training steps up to it (each logged step's time x world size).

    Needs `train.log_every=1` (every step logged), which the study sets."""
    hours, total = {}, 0.0
    for r in sorted(records, key=lambda r: r["step"]):
        total += r["step_time_s"] * world_size / 3600.0
        hours[r["step"]] = total
    return hours


def run_record(key: RunKey, records: list[dict], steps: list[int], world_size: int,
               validation: Optional[dict] = None, tokens: Optional[dict[int, int]] = None) -> dict:
    """A finished run's `train.json`: its evaluation steps, the device-hours of the training steps up
    to each (`cumulative_hours`; `gpu_seconds` the same in seconds), the tokens trained on up to each
    (`tokens`: the checkpoints' own `tokens_seen`, every rank's non-padding tokens), and its training health.
    `pipeline.train` truncates `metrics.jsonl` to the checkpoint it resumes from, so a step redone after
    a preemption is logged, and counted, once (`counted_steps`)."""
    from pipeline.monitor.signals import final_signals

    hours = cumulative_hours(records, world_size)
    last = records[-1] if records else {}
    return {
        "run": key.name, "status": "ok", "steps": steps,
        "device_hours": {str(s): hours[s] for s in steps},
        "gpu_seconds": {str(s): hours[s] * 3600.0 for s in steps},
        "tokens": {str(s): int(tokens[s]) for s in steps} if tokens else None,
        "counted_steps": len({r["step"] for r in records}), "world_size": world_size,
        "train_health": {
            "token_cosine": last.get("health/token_cosine"),
            "positive_cosines": {k: v for k, v in last.items() if k.endswith("positive_cosine")},
            "collapsed_steps": sum(1 for r in records if r.get("health/collapsed")),
            "logged_steps": len(records),
            # each learning signal against its chance level over the last 20% of the logged steps
            "signals": [s.to_dict() for s in final_signals(records)],
        },
        "final_train_loss": last.get("loss"),
        "validation": validation or None,  # the last val/ record (eval.* set: the study's `select`)
    }


def heldout_at(key: RunKey, step: int, data: StudyData, top_token: int, args, work: Path) -> dict:
    hf = key.directory(work) / "hf" / f"step_{step}"
    return cached(key.directory(work) / "eval" / f"heldout_step_{step}.json", lambda: {
        split: heldout_metrics(hf, shards, top_token, args.eval_sequences)
        for split, shards in (("select", data.select_shards), ("report", data.report_shards))})


def downstream_at(key: RunKey, step: int, data: StudyData, args, work: Path, final_test: bool = False,
                  random_init: bool = False, task: Optional[str] = None) -> Optional[dict]:
    """SST-2 at one checkpoint (dev + selection split; `final_test`: test as well, in its own files),
    one cached fine-tuning per `--finetune-seeds` seed (`downstream/<point>/seed_<s>.json`), merged
    in the order given: adding fine-tuning seeds to a study fine-tunes only the new ones.
    `task`: another GLUE task in `data.sst2_dir` (the SLURM study's), under `downstream/<task>/`."""
    if data.sst2_dir is None:
        return None
    run_dir = key.directory(work)
    point = run_dir / "downstream" / (task or "") / ("final_test" if final_test else f"step_{step}")

    def one_seed(seed: int) -> dict:
        return cached(point / f"seed_{seed}.json", lambda: finetune_sst2(
            run_dir / "hf" / f"step_{step}", data.sst2_dir, data.select_file, args,
            point / f"seed_{seed}.finetune.json", [seed], with_test=final_test, random_init=random_init,
            task=task or "sst2"))

    return merge_finetune_summaries([one_seed(seed) for seed in args.finetune_seeds])


#: selection metric -> (where it is read from a run record, higher is better); a `val/` metric (the study's
#: `select`, `spec.check_select`): its direction by name (`pipeline.monitor.signals.direction_of`)
SELECTION_METRICS = {"sst2_select_accuracy": True, "heldout_select_mlm_loss": False}


def higher_is_better(metric: str) -> bool:
    from pipeline.monitor.signals import direction_of

    return SELECTION_METRICS[metric] if metric in SELECTION_METRICS else direction_of(metric) == "higher"


def selection_value(record: dict, metric: str) -> Optional[float]:
    """The selection metric of a run record (`evaluate_run`'s output) at its final checkpoint; a `val/` metric
    from the run's last validation record (`train.json`'s `validation`, `run_record`)."""
    if metric.startswith("val/"):
        return ((record.get("train") or {}).get("validation") or {}).get(metric)
    final = record.get("final") or {}
    if metric == "sst2_select_accuracy":
        return ((final.get("downstream") or {}).get("pretrained", {}).get("select") or {}).get("mean")
    return ((final.get("heldout") or {}).get("select") or {}).get("mlm_loss")


def select_lrs(sweep: dict[str, dict[float, dict]], metric: str) -> dict[str, dict]:
    """Per objective, the learning rate whose final checkpoint is best on `metric` (a *selection*
    split: never a reported one); ties go to the smaller rate; failed runs are not candidates."""
    higher = higher_is_better(metric)
    chosen = {}
    for objective, by_lr in sweep.items():
        values = {lr: selection_value(rec, metric) for lr, rec in by_lr.items() if rec.get("status") == "ok"}
        values = {lr: v for lr, v in values.items() if v is not None}
        if not values:
            chosen[objective] = {"lr": None, "metric": metric, "values": {}, "note": "no run finished"}
            continue
        # ties (e.g. every rate fine-tunes to the majority class) go to the lower loss on the held-out
        # selection half (also never reported), then to the smaller rate
        tiebreak = {lr: selection_value(by_lr[lr], "heldout_select_mlm_loss") for lr in values}
        best = max(values, key=lambda lr: ((values[lr] if higher else -values[lr]),
                                           -(tiebreak[lr] if tiebreak[lr] is not None else float("inf")), -lr))
        chosen[objective] = {"lr": best, "metric": metric, "values": {f"{lr:g}": v for lr, v in sorted(values.items())}}
    return chosen


def parse_run(name: str) -> RunKey:
    """`objective/lr<lr>/seed<seed>` (`RunKey.name`) -> RunKey."""
    try:
        objective, lr, seed = name.split("/")
        return RunKey(objective, float(lr.removeprefix("lr")), int(seed.removeprefix("seed")))
    except ValueError:
        raise StudyError(f"{name!r}: expected OBJECTIVE/lr<LR>/seed<SEED>") from None


def study_data(study: Study, task: Optional[Task]) -> StudyData:
    """The study's data record for one downstream task (None: held-out metrics only)."""
    sh = study.shards
    if task is None:
        return StudyData(sh["train"], sh["heldout_select"], sh["heldout_report"], None, None)
    try:
        root, select, note = prepare_sst2(str(task.dir), study.work, task.train_examples, task.select_examples,
                                          study.subset_seed, task=task.name,
                                          select=study.work / "tasks" / task.name / "select.tsv")
    except ValueError as err:  # too few examples, an unlabelled test split: one line naming the task
        raise StudyError(f"{study.path}: tasks {task.name}: {err}") from None
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
            f"optim.warmup_steps={max(1, round(study.warmup_ratio * steps))}",
            *([f"eval.shards_dir={study.shards['heldout_select']}", f"eval.every={study.eval_every}"]
              if study.select else [])]  # validation on the selection half only: the study's `select`


def final_tags(study: Study, key: RunKey) -> dict[int, Path]:
    """The complete checkpoints of a run at its evaluation points."""
    from pipeline.train.checkpoint.tags import is_complete, list_tags

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
    from pipeline.train.validation import is_validation_record

    meta = json.loads((tags[steps] / "pipeline_meta.json").read_text())
    records = read_jsonl(run_dir / "metrics.jsonl")
    evaluations = [r for r in records if is_validation_record(r)]  # eval.* (the study's `select`): own records
    records = [r for r in records if not is_validation_record(r)]
    logged = [r["step"] for r in records]
    if logged != list(range(1, steps + 1)):
        raise StudyError(f"{run_dir / 'metrics.jsonl'}: expected steps 1..{steps} once each (train.log_every=1), "
                         f"found {len(logged)} records")
    tokens = {step: int(json.loads((tag / "pipeline_meta.json").read_text()).get("tokens_seen", 0)) for step, tag in tags.items()}
    record = run_record(key, records, sorted(tags), int(meta["world_size"]), evaluations[-1] if evaluations else None,
                        tokens if all(tokens.values()) else None)
    write_json(done, record)
    return record


def sts_file(run_dir: Path, step: int) -> Path:
    return run_dir / "eval" / f"sts_step_{step}.json"


def sts_at(study: Study, key: RunKey, step: int) -> dict:
    """Zero-shot STS-B of one converted checkpoint (`pipeline.eval.sts.measure`, both splits, every reference
    point, the bootstrap seeded 0: every point and run draws the same resamples), cached in `sts_file`."""
    from pipeline.eval.sts import measure, read_splits

    assert study.sts is not None
    run_dir = key.directory(study.work)

    def compute() -> dict:
        try:
            measured = measure(run_dir / "hf" / f"step_{step}", read_splits(study.sts.dir, flag="sts.dir"),
                               bootstrap=study.sts.bootstrap)
        except ValueError as err:  # e.g. a tokenizer that maps the STS sentences to [UNK]: one line naming the run
            raise StudyError(f"{study.path}: sts: {key.name} step {step}: {err}") from None
        return {**measured, "settings": study.sts.record()}

    return cached(sts_file(run_dir, step), compute)


def point_files(study: Study, key: RunKey, step: int, curves: bool) -> list[Path]:
    """The result files an evaluation point leaves (held-out metrics and STS at every point; downstream at every
    point with `curves`, else at the last)."""
    run_dir = key.directory(study.work)
    files = [run_dir / "eval" / f"heldout_step_{step}.json", *([sts_file(run_dir, step)] if study.sts else [])]
    if curves or step == study.steps_of[key.objective]:
        files += [run_dir / "downstream" / t.name / f"step_{step}" / f"seed_{s}.json"
                  for t in study.tasks for s in study.finetune["seeds"]]
    return files


def point_done(study: Study, key: RunKey, step: int, curves: bool) -> bool:
    record = key.directory(study.work) / "train.json"
    if record.is_file() and json.loads(record.read_text())["status"] != "ok":
        return True  # a diverged run has nothing to evaluate
    return all(p.is_file() for p in point_files(study, key, step, curves))


def eval_point(study: Study, key: RunKey, step: int, curves: bool) -> Optional[dict]:
    """The evaluation of one checkpoint (a SLURM array task, or a step of the local executor): record the
    run, convert the checkpoint, held-out metrics, zero-shot STS (`sts:`), fine-tune each task. A metric added to the study is
    computed here (and cached in its own file under the run, listed by `point_files`). Returns the held-out
    metrics ({"select": ..., "report": ...}), None for a run that failed."""
    record = train_record(study, key)
    if record["status"] != "ok":
        print(f"[{key.name}] {record['status']}: {record['error']}: nothing to evaluate", flush=True)
        return None
    run_dir = key.directory(study.work)
    hf = run_dir / "hf" / f"step_{step}"
    if not (hf / "config.json").is_file():
        convert_once(final_tags(study, key)[step], hf)
    held = heldout_at(key, step, study_data(study, None), top_token(study), study.args(key.objective), study.work)
    print(f"[{key.name}] step {step}: held-out MLM acc {held['report']['mlm_acc']:.4f}", flush=True)
    if study.sts:
        sts = sts_at(study, key, step)["splits"]
        print(f"[{key.name}] step {step}: STS-B Spearman x 100 dev {sts['dev']['model']['spearman']:.1f}, "
              f"test {sts['test']['model']['spearman']:.1f}", flush=True)
    if curves or step == study.steps_of[key.objective]:
        for task in study.tasks:
            result = downstream_at(key, step, study_data(study, task), study.args(key.objective, task), study.work,
                                   task=task.name)
            print(f"[{key.name}] step {step}: {task.name} dev {result['pretrained']['dev']['mean']:.4f}", flush=True)
    return held


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
