"""The study file of `cpt-study`: what a time-to-quality study on SLURM trains, evaluates and costs.

A YAML file (see `studies/tiny.yaml`, `studies/bert-base.yaml` and docs/slurm.md#the-time-to-quality-study-on-slurm)::

    name: tiny
    work_dir: ../runs/study-tiny          # relative to this file; every result file lives here
    objectives:                           # each a preset and overrides; `mlm` is the baseline
      mlm:  {preset: tiny-mlm}
      taco: {preset: tiny-taco, overrides: [objective_options.taco.temperature=0.07]}
    seeds: [1, 2]                         # pretraining seeds; the first runs the learning-rate sweep
    lrs: [1.0e-3]
    warmup_ratio: 0.06
    budget: {steps: 8}                    # or {tokens: N}: steps = ceil(N / (global batch x seq_len))
    eval_every: 4                         # evaluation points: every eval_every steps and the last
    shards: {train: DIR, heldout_select: DIR, heldout_report: DIR}
    tasks:                                # GLUE-format dirs with a labelled test.tsv, several at once
      - {name: sst2, dir: DIR, train_examples: 4000, select_examples: 2000}
    finetune: {seeds: [1, 2, 3], lr: 1.0e-4, epochs: 3}
    eval_sequences: 512
    plateau_margin: 0.05
    resources:                            # sbatch flags of each kind of job
      pretrain: {nodes: 1, ntasks_per_node: 8, gpus_per_node: 8, time: "24:00:00"}
      eval: {gpus_per_node: 1, time: "04:00:00"}
      sbatch: [--partition=gpu, --account=me]   # every job
    cost: {mfu: 0.4, device: H100, tokens_per_s: {mlm: 250000}, flops_factor: {cocolm: 1.33}}
    keep_checkpoints: true                # false: the final job deletes converted runs' DeepSpeed checkpoints
    select: val/mlm_head/loss             # optional: select the lr on this validation metric (`check_select`)
    sts: {dir: DIR, bootstrap: 1000}      # optional: zero-shot STS-B (SentEval copy) at every evaluation point

`${VAR}` in a path is expanded from the environment (the tiny study names its data that way); `plan`
needs no data and keeps a path whose variable is unset as written, `submit` and `run` refuse it.
Every error is one line naming the file and the field, before anything is submitted.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

#: pipeline.train keys the study sets per run (an objective override of one would defeat the sweep).
STUDY_OWNED = ("optim.lr", "optim.warmup_steps", "train.seed", "train.total_steps", "train.checkpoint_every",
               "train.output_dir", "train.resume", "data.shards_dir", "train.log_every", "train.keep_last")
TOP_KEYS = {"name", "work_dir", "objectives", "seeds", "lrs", "warmup_ratio", "budget", "eval_every", "shards",
            "tasks", "finetune", "eval_sequences", "plateau_margin", "resources", "cost", "subset_seed",
            "keep_checkpoints", "select", "sts"}
#: fields of `sts:` (`StsSettings`)
STS_KEYS = {"dir", "bootstrap"}


class StudyError(ValueError):
    """A study file that cannot run: the message names the file and the field."""


@dataclass(frozen=True)
class Objective:
    name: str
    preset: str
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Task:
    name: str  # a GLUE task of pipeline.eval.glue.GLUE_TASKS with an accuracy metric
    dir: Path
    train_examples: int
    select_examples: int


@dataclass(frozen=True)
class StsSettings:
    """Zero-shot STS-B at every evaluation point (`pipeline.eval.sts.measure`: dev and test, Spearman x 100 with
    a paired bootstrap interval over `bootstrap` resamples of the pairs, and its reference points)."""

    dir: Path
    bootstrap: int = 1000

    def record(self) -> dict:
        return {"dir": str(self.dir), "bootstrap": self.bootstrap}


@dataclass
class Study:
    path: Path
    name: str
    work: Path
    objectives: dict[str, Objective]
    seeds: list[int]
    lrs: list[float]
    warmup_ratio: float
    budget: dict[str, int]
    eval_every: int
    shards: dict[str, Path]
    tasks: list[Task]
    finetune: dict[str, Any]
    eval_sequences: int
    plateau_margin: float
    resources: dict[str, Any]
    cost: dict[str, Any]
    subset_seed: int = 0
    keep_checkpoints: bool = True
    sts: Optional[StsSettings] = None  # zero-shot STS at every evaluation point (`units.sts_at`)
    select: str = ""  # a val/ metric the lr is selected on (`check_select`); "": the first task / held-out MLM loss
    steps: int = 0  # resolved by `resolve_steps` (a token budget needs the preset's batch and seq_len)
    steps_of: dict[str, int] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        pre = self.resources.get("pretrain", {})
        return int(pre.get("nodes", 1)) * int(pre.get("ntasks_per_node", 1))

    def eval_steps(self, objective: str) -> list[int]:
        """The evaluation points of one run: every `eval_every` steps and the last step."""
        steps = self.steps_of[objective]
        return sorted({*range(self.eval_every, steps + 1, self.eval_every), steps})

    def args(self, objective: str, task: Optional[Task] = None) -> argparse.Namespace:
        """The settings in the form the units' evaluation and report read them (`units`, `evaluate`, `report`)."""
        ft = self.finetune
        return argparse.Namespace(
            steps=self.steps_of[objective], eval_every=self.eval_every, warmup_ratio=self.warmup_ratio,
            eval_sequences=self.eval_sequences, finetune_seeds=list(ft["seeds"]), finetune_lr=float(ft["lr"]),
            finetune_epochs=int(ft["epochs"]), device=str(ft.get("device", "")), subset_seed=self.subset_seed,
            sst2_train=task.train_examples if task else 0, sst2_select=task.select_examples if task else 0,
            plateau_margin=self.plateau_margin, lrs=self.lrs, seeds=self.seeds, objectives=list(self.objectives),
            world_size=self.world_size,
            keep_checkpoints=self.keep_checkpoints)


def _need(raw: dict, key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if key not in raw:
        raise StudyError(f"{where}: missing field '{key}'")
    value = raw[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise StudyError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _numbers(raw: dict, key: str, where: str, kind: type) -> list:
    """`raw[key]` as a list of `kind` (int or float), or one line naming the field."""
    values = _need(raw, key, where, list)
    try:
        if kind is int and any(isinstance(v, float) and not v.is_integer() or isinstance(v, bool) for v in values):
            raise ValueError
        return [kind(v) for v in values]
    except (TypeError, ValueError):
        raise StudyError(f"{where}: {key}: expected a list of {'integers' if kind is int else 'numbers'}, "
                         f"got {values!r}") from None


def _path(value: Any, base: Path, where: str, strict: bool = True) -> Path:
    text = os.path.expandvars(str(value))
    if "$" in text:
        if not strict:  # plan: the path as written, checked at submit
            return Path(str(value))
        raise StudyError(f"{where}: {value!r} names an environment variable that is not set")
    p = Path(text).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def load_study(path: str | Path, check_data: bool = True) -> Study:
    """Read and check a study file (`check_data`: the shard and task directories must exist)."""
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"{path}: no such study file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise StudyError(f"{path}: not valid YAML{at}: {what}") from None
    if not isinstance(raw, dict):
        raise StudyError(f"{path}: expected a mapping of fields")
    where, base = str(path), path.resolve().parent
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise StudyError(f"{where}: unknown field(s) {unknown} (known: {sorted(TOP_KEYS)})")
    from pipeline.config.loader import available_presets, resolve_preset

    objectives: dict[str, Objective] = {}
    for name, spec in _need(raw, "objectives", where, dict).items():
        w = f"{where}: objectives.{name}"
        if not isinstance(spec, dict) or "preset" not in spec:
            raise StudyError(f"{w}: expected {{preset: NAME, overrides: [KEY=VALUE, ...]}}")
        overrides = spec.get("overrides") or []
        if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o and not any(c.isspace() for c in o)
                                                      for o in overrides):
            # slurm/pretrain.sbatch splits OVERRIDES at whitespace
            raise StudyError(f"{w}.overrides: expected a list of KEY=VALUE strings without spaces")
        owned = [o for o in overrides if o.split("=", 1)[0] in STUDY_OWNED]
        if owned:
            raise StudyError(f"{w}.overrides: {owned}: the study sets these itself (lrs, seeds, budget, eval_every)")
        try:
            resolve_preset(str(spec["preset"]))
        except Exception:  # noqa: BLE001 - any failure to find it is the same user error
            raise StudyError(f"{w}.preset: {spec['preset']!r} is neither a preset ({', '.join(available_presets())}) "
                             "nor a YAML file") from None
        objectives[str(name)] = Objective(str(name), str(spec["preset"]), tuple(overrides))
    if "mlm" not in objectives:
        raise StudyError(f"{where}: objectives: needs 'mlm', the baseline every objective is measured against")
    seeds = _numbers(raw, "seeds", where, int)
    if not seeds or len(set(seeds)) != len(seeds):
        raise StudyError(f"{where}: seeds: give distinct pretraining seeds")
    lrs = sorted(set(_numbers(raw, "lrs", where, float)))
    if not lrs or any(lr <= 0 for lr in lrs):
        raise StudyError(f"{where}: lrs: give positive learning rates")
    budget = _need(raw, "budget", where, dict)
    if len(budget) != 1 or next(iter(budget)) not in ("steps", "tokens") or int(next(iter(budget.values()))) < 1:
        raise StudyError(f"{where}: budget: give exactly one of {{steps: N}} or {{tokens: N}}, N >= 1")
    eval_every = int(_need(raw, "eval_every", where, int))
    warmup = float(raw.get("warmup_ratio", 0.06))
    if not 0.0 <= warmup < 1.0:
        raise StudyError(f"{where}: warmup_ratio: must be in [0, 1)")
    shards_raw = _need(raw, "shards", where, dict)
    shards = {}
    for key in ("train", "heldout_select", "heldout_report"):
        shards[key] = _path(_need(shards_raw, key, f"{where}: shards", (str, Path)), base, f"{where}: shards.{key}",
                            check_data)
    tasks = []
    from pipeline.eval.glue import GLUE_TASKS

    for i, t in enumerate(raw.get("tasks") or []):
        w = f"{where}: tasks[{i}]"
        name = str(_need(t, "name", w, str))
        if name not in GLUE_TASKS or "accuracy" not in GLUE_TASKS[name].metrics:
            raise StudyError(f"{w}.name: {name!r}: give a GLUE classification task "
                             f"({', '.join(k for k, s in GLUE_TASKS.items() if 'accuracy' in s.metrics)})")
        tasks.append(Task(name, _path(_need(t, "dir", w, str), base, f"{w}.dir", check_data), int(t.get("train_examples", 4000)),
                          int(t.get("select_examples", 2000))))
    if len({t.name for t in tasks}) != len(tasks):
        raise StudyError(f"{where}: tasks: each task once")
    ft_raw = raw.get("finetune") or {}
    if not isinstance(ft_raw, dict):
        raise StudyError(f"{where}: finetune: expected {{seeds: [..], lr: X, epochs: N}}, got {ft_raw!r}")
    finetune = {"seeds": [1, 2, 3], "lr": 1e-4, "epochs": 3, **ft_raw}
    finetune["seeds"] = _numbers(finetune, "seeds", f"{where}: finetune", int)
    try:
        finetune["lr"], finetune["epochs"] = float(finetune["lr"]), int(finetune["epochs"])
    except (TypeError, ValueError):
        raise StudyError(f"{where}: finetune: lr and epochs must be numbers, got {finetune['lr']!r}, "
                         f"{finetune['epochs']!r}") from None
    study = Study(path=path.resolve(), name=str(raw.get("name", path.stem)),
                  work=_path(raw.get("work_dir", f"study-{path.stem}"), base, f"{where}: work_dir", check_data),
                  objectives=objectives, seeds=seeds, lrs=lrs, warmup_ratio=warmup,
                  budget={k: int(v) for k, v in budget.items()}, eval_every=eval_every, shards=shards, tasks=tasks,
                  finetune=finetune, eval_sequences=int(raw.get("eval_sequences", 512)),
                  plateau_margin=float(raw.get("plateau_margin", 0.05)), resources=raw.get("resources") or {},
                  cost=raw.get("cost") or {}, subset_seed=int(raw.get("subset_seed", 0)),
                  keep_checkpoints=bool(raw.get("keep_checkpoints", True)),
                  select=str(raw.get("select") or ""), sts=_sts(raw, base, where, check_data))
    resolve_steps(study)
    check_select(study, check_data)
    check_conversions(study)  # after select's own refusals of a row's overrides, which name the study's field
    if check_data:
        for key, p in shards.items():
            if not (p / "manifest.json").is_file():
                raise StudyError(f"{where}: shards.{key}: {p} has no manifest.json (build it with cpt-build-shards)")
        for i, t in enumerate(tasks):
            missing = [f for f in ("train.tsv", "dev.tsv", "test.tsv") if not (t.dir / f).is_file()]
            if missing:
                raise StudyError(f"{where}: tasks[{i}].dir: {t.dir} lacks {', '.join(missing)} (test.tsv labelled)")
    return study


def _sts(raw: dict, base: Path, where: str, check_data: bool) -> Optional[StsSettings]:
    """`sts: {dir, bootstrap}` or None; `check_data`: both splits read and checked now (each problem one line
    naming the file and line, `pipeline.eval.sts.read_sts`), not at the first evaluation point hours later."""
    if raw.get("sts") is None:
        return None
    spec = raw["sts"]
    if not isinstance(spec, dict) or set(spec) - STS_KEYS or "dir" not in spec:
        raise StudyError(f"{where}: sts: expected {{dir: DIR, bootstrap: N}} (the SentEval STS-B copy), got {spec!r}")
    bootstrap = spec.get("bootstrap", 1000)
    if not isinstance(bootstrap, int) or isinstance(bootstrap, bool) or bootstrap < 0:
        raise StudyError(f"{where}: sts.bootstrap: expected an integer >= 0 (0: no interval), got {bootstrap!r}")
    settings = StsSettings(_path(spec["dir"], base, f"{where}: sts.dir", check_data), bootstrap)
    if check_data:
        from pipeline.eval.sts import read_splits

        try:
            read_splits(settings.dir, flag=f"{where}: sts.dir")
        except ValueError as err:
            raise StudyError(str(err) if str(err).startswith(where) else f"{where}: sts.dir: {err}") from None
    return settings


def run_config(study: Study, objective: str, extra: tuple[str, ...] = ()):
    """The objective's `RunConfig` (its preset and overrides; `data.shards_dir` from the study)."""
    from pipeline.train.run_config import load_config

    obj = study.objectives[objective]
    try:
        return load_config(obj.preset, [f"data.shards_dir={study.shards['train']}", *obj.overrides, *extra])
    except ValueError as err:
        raise StudyError(f"{study.path}: objectives.{objective}: {err}") from None


def resolve_steps(study: Study) -> None:
    """Training steps of each objective: the step budget, or the token budget over the preset's
    tokens per step (global batch x seq_len), rounded up; `eval_every` checked against it."""
    for name in study.objectives:
        if "steps" in study.budget:
            steps = study.budget["steps"]
        else:
            cfg = run_config(study, name)
            if not cfg.data.seq_len:
                raise StudyError(f"{study.path}: budget.tokens: preset {study.objectives[name].preset!r} of {name} "
                                 "sets no data.seq_len (it takes the shards'); give budget: {steps: N}, or "
                                 "data.seq_len=N in objectives." + name + ".overrides")
            steps = math.ceil(study.budget["tokens"] / (cfg.data.global_batch_size * cfg.data.seq_len))
        if not 1 <= study.eval_every <= steps:
            raise StudyError(f"{study.path}: eval_every: {study.eval_every} must be in [1, {steps}] "
                             f"(the budget of {name} in steps)")
        study.steps_of[name] = steps
    study.steps = max(study.steps_of.values())


def check_conversions(study: Study) -> None:
    """Every run the study trains must convert as its evaluation converts it (`evaluate.convert_once`):
    refused before any job, naming the objective and `cpt-convert`'s reason, rather than once its
    pretraining has been paid for (`evaluate.conversion_problem`)."""
    from pipeline.study.evaluate import conversion_problem

    for name in study.objectives:
        cfg = run_config(study, name)
        problem = conversion_problem(dict(cfg.objectives), cfg.model.arch)
        if problem:
            raise StudyError(f"{study.path}: objectives.{name}: its runs could not be converted for the evaluation: "
                             f"{problem}")


def check_select(study: Study, check_data: bool = False) -> None:
    """`select: val/<metric>`: the learning rate is selected on a validation metric, the run's last `val/` record
    (`pipeline.train.validation`, with `eval.shards_dir` = the `heldout_select` shards, evaluated every
    `eval_every` steps), lowest or highest by the name's direction (`pipeline.monitor.signals.direction_of`).
    Refused (before any job) unless every objective's run logs it: `val/` + `loss`, `health/...`, one of its
    objectives' terms, or `mlm_head/...` where an objective trains the shared MLM head; and its direction must
    be known (`..._loss` lower, `..._accuracy` / `..._auc` higher). `check_data`: `heldout_select` must pass the
    runs' own `eval.shards_dir` checks (`pipeline.train.eval_config.check_eval_set`: tokenizer, seq_len, not the
    training set, one evaluation batch per rank)."""
    if not study.select:
        return
    from pipeline.monitor.signals import direction_of
    from pipeline.objectives.registry import mlm_head_training

    where, name = f"{study.path}: select: {study.select}", study.select.removeprefix("val/")
    if not study.select.startswith("val/"):
        raise StudyError(f"{where}: give a validation metric, val/<term> (e.g. val/mlm_head/loss)")
    if direction_of(name) is None:
        raise StudyError(f"{where}: its direction is unknown; give a loss (..._loss, lower is better) or an "
                         "accuracy / AUC (higher is better), e.g. val/mlm_head/loss")
    for objective in study.objectives:
        owned = [o for o in study.objectives[objective].overrides
                 if o.split("=", 1)[0] in ("eval.shards_dir", "eval.every")]
        if owned:
            raise StudyError(f"{where}: objectives.{objective}.overrides: {owned}: with select the study sets these "
                             "itself (shards.heldout_select, eval_every)")
        objectives = run_config(study, objective).objectives
        known = ["loss", "health", *objectives, *(["mlm_head"] if mlm_head_training(objectives) else [])]
        if name.split("/", 1)[0] not in known:
            raise StudyError(f"{where}: objectives.{objective} does not log it; its validation metrics start with "
                             f"{', '.join('val/' + k for k in known)}")
        if check_data:
            from pipeline.config.checks import ConfigError
            from pipeline.data.shards import read_manifest
            from pipeline.train.eval_config import EvalConfig, check_eval_set

            held, cfg = str(study.shards["heldout_select"]), run_config(study, objective)
            try:
                check_eval_set(EvalConfig(shards_dir=held, every=study.eval_every),
                               read_manifest(study.shards["train"]), str(study.shards["train"]), [],
                               study.world_size, cfg.data.micro_batch_size)
            except (ConfigError, ValueError, OSError) as err:
                raise StudyError(f"{where}: shards.heldout_select (the runs' eval.shards_dir, objectives.{objective}): "
                                 f"{err}") from None


def check_work_dir(study: Study, record: bool = True) -> None:
    """Record the settings that define the results in `<work_dir>/study.json`, or refuse a work
    directory made with other ones before anything runs. Objectives and pretraining or fine-tuning
    seeds may be added (that is how a study grows); the first seed runs the sweep, so it is defining.
    `record` False: check only (`submit` records once its jobs are queued)."""
    from pipeline.report_files import write_json

    current = json.loads(json.dumps({
        "objectives": {n: [o.preset, *o.overrides] for n, o in study.objectives.items()}, "sweep_seed": study.seeds[0],
        "lrs": study.lrs, "warmup_ratio": study.warmup_ratio, "budget": study.budget, "eval_every": study.eval_every,
        "shards": study.shards, "tasks": [[t.name, t.dir, t.train_examples, t.select_examples] for t in study.tasks],
        "finetune": [study.finetune["lr"], study.finetune["epochs"]], "eval_sequences": study.eval_sequences,
        "subset_seed": study.subset_seed, "select": study.select,
        "sts": study.sts.record() if study.sts else None}, default=str))
    path = study.work / "study.json"
    if path.is_file():
        recorded = json.loads(path.read_text())
        was = recorded.get("objectives", {})
        changed = {f"objectives.{n}": (was[n], v) for n, v in current["objectives"].items() if n in was and was[n] != v}
        # STS may be added to a study that ran without it (its points gain the metric), not changed once set
        changed.update({k: (recorded.get(k), v) for k, v in current.items() if k != "objectives" and recorded.get(k) != v
                        and not (k == "sts" and (recorded.get(k) is None or v is None))})
        if changed:
            diffs = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in sorted(changed.items()))
            raise StudyError(f"{study.path}: work_dir {study.work} holds a study made with other settings ({diffs}); "
                             "use another work_dir or the recorded settings")
        current["objectives"] = {**was, **current["objectives"]}
        current["sts"] = current["sts"] or recorded.get("sts")
    if record:
        write_json(path, current)
