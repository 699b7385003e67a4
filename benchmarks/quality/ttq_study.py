"""The time-to-quality study as resumable units: sweep, selection, seeds, final test.

Order of work (each unit leaves a JSON file; a re-run skips every unit whose file exists, and an
interrupted training run resumes from its last checkpoint through `pipeline.train`'s own exact
resume):

1. **sweep**: every objective (MLM included) trains once per learning rate of `--lrs` with the
   first pretraining seed; every checkpoint gets the held-out masked-LM metrics; the final one is
   fine-tuned on SST-2 (dev + selection split);
2. **selection** (`select_lrs`): per objective, the learning rate with the best *selection* metric
   at the final checkpoint: SST-2 accuracy on the selection split (`ttq_data`: train examples never
   fine-tuned on; ties broken by the next item), or, without SST-2, the masked-LM loss on the
   `heldout-select` half. The reported numbers (SST-2 dev and test, the `heldout-report` half)
   never take part;
3. **seeds**: the remaining pretraining seeds at the selected learning rate; every checkpoint of
   every selected run is fine-tuned (dev + selection split): the downstream curves;
4. **final**: the final checkpoint of every selected run is fine-tuned once more with `test.tsv`
   scored (the only time it is), and once, beside MLM's first seed, the randomly initialised model
   of the same shape (the floor).

A training run that the non-finite guard stops (exit 3) is recorded as failed and the study goes
on (such a learning rate cannot be selected); any other failure stops the study with the log's tail.
"""
from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.common.runs import last_error_line
from benchmarks.quality.ttq_data import StudyData
from benchmarks.quality.ttq_eval import (cached, convert_once, finetune_sst2, heldout_metrics, merge_finetune_summaries,
                                 write_json)

#: pipeline.train exit code of the non-finite loss guard (a run that diverged: recorded, not fatal).
EXIT_NONFINITE = 3
#: Seconds a stopped training child gets to write its checkpoint before it is killed.
STOP_GRACE_S = 300
#: Settings that define a study's results; a work directory made with other values is refused.
DEFINING_ARGS = ("text", "heldout", "sst2", "size", "set", "steps", "eval_every", "micro_batch", "world_size",
                 "seq_len", "vocab_size", "lrs", "warmup_ratio", "eval_sequences", "sst2_train", "sst2_select",
                 "subset_seed", "finetune_lr", "finetune_epochs")
# Not among them: the pretraining seeds after the first and `--finetune-seeds` (each seed's results are
# cached on their own, so adding seeds grows a study; it never mixes settings).


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


def check_study_args(args, work: Path, defining: Sequence[str] = DEFINING_ARGS, sweep_seed: bool = True) -> None:
    """Record the `defining` settings in `<work>/study.json`, or refuse a work dir made with others
    (adding objectives, pretraining or fine-tuning seeds to a study is fine: that is how it grows).
    `sweep_seed`: the first seed is defining too (it runs the learning-rate sweep)."""
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


def train_overrides(key: RunKey, data: StudyData, run_dir: Path, args) -> list[str]:
    """`pipeline.train` overrides of one run: the study's recipe with this run's learning rate and seed."""
    keep = 1_000_000  # every evaluation point, and any stop-signal checkpoint beside them (deleted once converted)
    warmup = max(1, round(args.warmup_ratio * args.steps))
    return [f"model.size={args.size}", f"data.shards_dir={data.train_shards}",
            f"data.micro_batch_size={args.micro_batch}", f"data.global_batch_size={args.micro_batch * args.world_size}",
            f"train.total_steps={args.steps}", f"train.checkpoint_every={args.eval_every}", f"train.keep_last={keep}",
            "train.log_every=1", "train.resume=auto", "train.tensorboard=false", "train.progress_bar=false",
            f"train.seed={key.seed}", f"train.output_dir={run_dir}", f"optim.lr={key.lr}",
            f"optim.warmup_steps={warmup}", *args.set]


def cumulative_hours(records: list[dict], world_size: int) -> dict[int, float]:
    """step -> device-hours of training steps up to it (each logged step's time x world size).

    Needs `train.log_every=1` (every step logged), which the study sets."""
    hours, total = {}, 0.0
    for r in sorted(records, key=lambda r: r["step"]):
        total += r["step_time_s"] * world_size / 3600.0
        hours[r["step"]] = total
    return hours


def run_record(key: RunKey, records: list[dict], steps: list[int], world_size: int) -> dict:
    """A finished run's `train.json`: its evaluation steps, the device-hours of the training steps up
    to each (`cumulative_hours`; `gpu_seconds` the same in seconds), and its training health.
    `pipeline.train` truncates `metrics.jsonl` to the checkpoint it resumes from, so a step redone after
    a preemption is logged, and counted, once (`counted_steps`)."""
    from pipeline.eval.signals import final_signals

    hours = cumulative_hours(records, world_size)
    last = records[-1] if records else {}
    return {
        "run": key.name, "status": "ok", "steps": steps,
        "device_hours": {str(s): hours[s] for s in steps},
        "gpu_seconds": {str(s): hours[s] * 3600.0 for s in steps},
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
    }


def run_child(cmd: list[str], log) -> int:
    """Run `cmd` to completion; if this process is stopped (SIGTERM, turned into an exception by
    `time_to_quality.main`, or Ctrl-C), pass SIGTERM on, so `pipeline.train` writes a checkpoint
    and exits, and the re-run resumes from it."""
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


def train_run(key: RunKey, data: StudyData, args, work: Path) -> dict:
    """Train (or resume) one run, convert every checkpoint, and record it in `train.json`."""
    from pipeline.train.checkpoint import is_complete, list_tags
    from pipeline.train.metrics import read_jsonl

    def complete_tags() -> list[tuple[int, Path]]:
        return [(step, tag) for step, tag in list_tags(run_dir / "checkpoints") if is_complete(tag)]

    run_dir = key.directory(work)
    done = run_dir / "train.json"
    if done.is_file():
        return json.loads(done.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    tags = complete_tags()
    if not tags or tags[-1][0] < args.steps:
        launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
        cmd = [*launcher, "-m", "pipeline.train", "--config", f"tiny-{key.objective}",
               *train_overrides(key, data, run_dir, args)]
        print(f"[{key.name}] $ {shlex.join(cmd)}", flush=True)
        with open(run_dir / "train.log", "a", encoding="utf-8") as log:
            code = run_child(cmd, log)
        if code == EXIT_NONFINITE:
            record = {"run": key.name, "status": "failed", "error": last_error_line((run_dir / "train.log").read_text(
                errors="replace"))}
            write_json(done, record)
            return record
        if code != 0:
            raise RuntimeError(f"{key.name}: pipeline.train exit {code}: "
                               f"{last_error_line((run_dir / 'train.log').read_text(errors='replace'))} "
                               f"(log: {run_dir / 'train.log'})")
        tags = complete_tags()
    records = read_jsonl(run_dir / "metrics.jsonl")
    # evaluation points only: a checkpoint written on a stop signal (any step) is a resume point
    tags = [(step, tag) for step, tag in tags if step % args.eval_every == 0 or step == args.steps]
    for step, tag in tags:
        convert_once(tag, run_dir / "hf" / f"step_{step}")
    record = run_record(key, records, [s for s, _ in tags], args.world_size)
    write_json(done, record)
    if not args.keep_checkpoints:  # every checkpoint is converted; the optimizer states are not needed again
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return record


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


#: selection metric -> (where it is read from a run record, higher is better)
SELECTION_METRICS = {"sst2_select_accuracy": True, "heldout_select_mlm_loss": False}


def selection_value(record: dict, metric: str) -> Optional[float]:
    """The selection metric of a run record (`evaluate_run`'s output) at its final checkpoint."""
    final = record.get("final") or {}
    if metric == "sst2_select_accuracy":
        return ((final.get("downstream") or {}).get("pretrained", {}).get("select") or {}).get("mean")
    return ((final.get("heldout") or {}).get("select") or {}).get("mlm_loss")


def select_lrs(sweep: dict[str, dict[float, dict]], metric: str) -> dict[str, dict]:
    """Per objective, the learning rate whose final checkpoint is best on `metric` (a *selection*
    split: never a reported one); ties go to the smaller rate; failed runs are not candidates."""
    higher = SELECTION_METRICS[metric]
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


def evaluate_run(key: RunKey, data: StudyData, top_token: int, args, work: Path, curves: bool) -> dict:
    """Train one run and evaluate it: held-out metrics at every checkpoint, SST-2 at the final one
    (`curves`: at every one). Returns {"train", "points": [{step, hours, heldout, downstream}], "final"}."""
    train = train_run(key, data, args, work)
    out = {"key": key, "train": train, "status": train["status"], "points": [], "final": None}
    if train["status"] != "ok":
        return out
    final_step = train["steps"][-1]
    for step in train["steps"]:
        point = {"step": step, "device_hours": train["device_hours"][str(step)],
                 "heldout": heldout_at(key, step, data, top_token, args, work), "downstream": None}
        if curves or step == final_step:
            point["downstream"] = downstream_at(key, step, data, args, work)
        out["points"].append(point)
        print(f"[{key.name}] step {step}: held-out MLM acc {point['heldout']['report']['mlm_acc']:.4f} "
              f"(unigram {point['heldout']['report']['unigram_acc']:.4f}), token cosine "
              f"{point['heldout']['report']['token_cosine']:.3f}"
              + (f", SST-2 dev {point['downstream']['pretrained']['dev']['mean']:.4f}" if point["downstream"] else ""),
              flush=True)
    out["final"] = out["points"][-1]
    return out


def run_study(args, data: StudyData, top_token: int, work: Path) -> dict:
    """Every unit of the study in order; returns what the report needs."""
    metric = "sst2_select_accuracy" if data.sst2_dir is not None else "heldout_select_mlm_loss"
    sweep: dict[str, dict[float, dict]] = {}
    for objective in args.objectives:
        for lr in args.lrs:
            sweep.setdefault(objective, {})[lr] = evaluate_run(RunKey(objective, lr, args.seeds[0]), data,
                                                               top_token, args, work, curves=False)
    selection = select_lrs(sweep, metric)
    write_json(work / "selection.json", selection)
    selected: dict[str, list[dict]] = {}
    for objective in args.objectives:
        lr = selection[objective]["lr"]
        if lr is None:
            continue
        selected[objective] = [evaluate_run(RunKey(objective, lr, seed), data, top_token, args, work, curves=True)
                               for seed in args.seeds]
    final, floor = {}, None
    for objective, runs in selected.items():
        for run in runs:
            if run["status"] != "ok":
                continue
            key = run["key"]
            with_floor = objective == "mlm" and key.seed == args.seeds[0] and data.sst2_dir is not None
            result = downstream_at(key, run["final"]["step"], data, args, work, final_test=True, random_init=with_floor)
            final[key.name] = result
            if with_floor and result is not None:
                floor = result["random_init"]
    return {"metric": metric, "sweep": sweep, "selection": selection, "selected": selected, "final": final,
            "floor": floor}
