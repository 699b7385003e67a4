"""Experiment trackers: where each logged step's scalars go besides `metrics.jsonl` (`train.trackers`).

`train.trackers` lists any of `TRACKERS`: `jsonl` (`<output_dir>/metrics.jsonl`, written by
`pipeline.train.metrics.MetricsWriter` itself; `cpt-status` and resume read it), `tensorboard`
(`<output_dir>/tb/`), `wandb` (Weights & Biases) and `mlflow`. Every tracker gets the same scalars on
every logged step (every number of the step's metrics record: losses, each learning signal beside
its `_chance` / unigram reference, LR, tokens/s, MFU where known, grad norm, skipped steps), and once
the run's resolved config and its recipe (preset + overrides) as the run's config / params. Only
rank 0 tracks (`MetricsWriter` is enabled there only).

Names: `train.tracker_project` (W&B project, MLflow experiment), `train.tracker_run_name` and
`train.tracker_tags`; where empty, the trackers' own environment variables (`WANDB_PROJECT`,
`WANDB_NAME`, `WANDB_TAGS`, `WANDB_ENTITY`, `WANDB_MODE`; `MLFLOW_EXPERIMENT_NAME`,
`MLFLOW_RUN_NAME`, `MLFLOW_TRACKING_URI`), then the preset name and the output directory's name.
MLflow's store is `train.mlflow_tracking_uri`, else `MLFLOW_TRACKING_URI`, else a local file store
in `<output_dir>/mlruns` (MLflow 3 refuses file stores unless `MLFLOW_ALLOW_FILE_STORE=true`, which
is set for a `file:` store when unset). W&B writes under `<output_dir>/wandb/`; with
`WANDB_MODE=offline` (compute nodes without internet) that is a run `wandb sync` uploads later.

One tracker run per training run: the W&B run id and the MLflow run id are kept in
`<output_dir>/trackers.json` (`IDS_FILE`, written atomically before the tracker starts), and a
resumed or requeued run continues those runs instead of opening new ones. W&B steps go on the
`trainer/step` axis (`STEP_KEY`), so re-logging the steps after the last checkpoint on resume is
not refused as "step went backwards".

A rewind starts new tracker runs: a resume from an older tag of the run (`train.resume=<tag>`, its
newer tags set aside, usually with `train.allow_config_change`) re-runs steps the tracker runs
already hold from the abandoned trajectory, and MLflow and W&B cannot cut a run back as
`metrics.jsonl` and TensorBoard are cut. So such a resume opens a new W&B run and a new MLflow run
(`RunIdentity.rewound_to`), linked to the one they branch from: MLflow tags `parent_run_id`,
`branched_at_step` and `mlflow.parentRunId` (shown nested under its parent), W&B config
`parent_run_id` and `branched_at_step`; `trackers.json` then names the new runs (with the same two
fields), which later requeues continue.

How the run ended reaches the trackers at close (`OUTCOMES`): `finished` (exit 0), `failed` (an
error or a divergence: MLflow status FAILED, W&B exit code 1) or `stopped` (preempted for requeue,
exit 75: MLflow KILLED, W&B marked preempting with exit code 75); the requeued run sets the same
tracker run back to running. A SIGKILL leaves no close: the tracker run stays RUNNING / crashed.

Tracking never stops training: a tracker that fails to start or fails mid-run (disk, server gone)
logs one warning naming itself and the error, and the run goes on without it. A tracker that is not
installed is refused before compute (`check_installed`, from `TrainConfig.check`) with the install
line of its extra (`pip install ".[wandb]"`, `".[mlflow]"`).
"""
from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import secrets
import string
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from pipeline.io import write_atomic
from pipeline.train.preemption import REQUEUE_EXIT_CODE  # standard library only: nothing heavy imported

log = logging.getLogger(__name__)

#: Every tracker `train.trackers` may list.
TRACKERS = ("tensorboard", "wandb", "mlflow", "jsonl")
#: The default: what a run wrote before `train.trackers` existed.
DEFAULT_TRACKERS = ("tensorboard", "jsonl")
#: Trackers that are optional extras: name -> (module to import, install line).
EXTRAS = {"wandb": ("wandb", 'pip install ".[wandb]"  (or: pip install wandb)'),
          "mlflow": ("mlflow", 'pip install ".[mlflow]"  (or: pip install mlflow-skinny)')}
#: Tracker run ids of the run, so a resume continues the same tracker runs.
IDS_FILE = "trackers.json"
#: The W&B x-axis every scalar is logged against.
STEP_KEY = "trainer/step"
#: How a training run can end, as its trackers are told at close (`TrackerSet.close`).
OUTCOMES = ("finished", "failed", "stopped")
_MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}
_WANDB_EXIT_CODE = {"finished": 0, "failed": 1, "stopped": REQUEUE_EXIT_CODE}
#: MLflow's limits per `log_batch` call (params / metrics).
_MLFLOW_PARAMS_PER_BATCH, _MLFLOW_METRICS_PER_BATCH = 100, 1000
_MLFLOW_PARAM_CHARS = 6000
_MLFLOW_BAD_KEY = re.compile(r"[^\w\-./ :]")


def check_tracker_names(names: Sequence[str], where: str = "train.trackers") -> None:
    """Unknown or repeated tracker names: one line naming the field and the choices."""
    from pipeline.config.checks import ConfigError

    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"{where}: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        raise ConfigError(f"{where}: {', '.join(repeated)} listed more than once")


def check_installed(names: Sequence[str], where: str = "train.trackers") -> None:
    """Refuse (before compute) a tracker whose package cannot be imported, with its install line."""
    from pipeline.config.checks import ConfigError

    for name in names:
        if name not in EXTRAS:
            continue
        module, install = EXTRAS[name]
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"{where} lists {name}, but {module} is not installed here ({err}); install it with: "
                              f"{install}, or drop {name} from {where}") from err


@dataclass
class RunIdentity:
    """What the trackers are told about the run."""

    output_dir: Path
    project: str = ""  # train.tracker_project ("" -> the tracker's env variable, then `default_project`)
    run_name: str = ""  # train.tracker_run_name ("" -> env variable, then the output directory's name)
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # the resolved run config (`RunConfig.to_dict`)
    recipe: dict[str, Any] = field(default_factory=dict)  # `describe_recipe`: preset and overrides
    default_project: str = "contrastive-pretrain"
    mlflow_tracking_uri: str = ""
    rewound_to: Optional[int] = None  # a rewind resumed at this step: new tracker runs, linked to their parents

    def name(self, env: str) -> str:
        return self.run_name or os.environ.get(env, "") or self.output_dir.resolve().name

    def project_name(self, env: str) -> str:
        return self.project or os.environ.get(env, "") or self.default_project


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`section.field -> str(value)` of a nested config (MLflow params are flat strings)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{path}."))
        else:
            out[path] = json.dumps(value, sort_keys=True, default=str) if not isinstance(value, str) else value
    return out


def read_ids(output_dir: Path) -> dict[str, dict[str, str]]:
    """The tracker run ids a previous attempt of this run recorded ({} when none or unreadable)."""
    try:
        raw = json.loads((output_dir / IDS_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return raw if isinstance(raw, dict) else {}


def write_ids(output_dir: Path, name: str, ids: dict[str, str]) -> None:
    """Record `name`'s run ids in `<output_dir>/trackers.json` (atomic: temp file + rename)."""
    all_ids = read_ids(output_dir)
    all_ids[name] = ids
    write_atomic(output_dir / IDS_FILE, json.dumps(all_ids, indent=1, sort_keys=True))


class Tracker:
    """One destination of the scalars; `log` and `close` may raise (the `TrackerSet` catches)."""

    name = ""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self, outcome: str = "finished") -> None:
        """`outcome`: one of `OUTCOMES`, how the training run ended."""


class TensorBoardTracker(Tracker):
    """`<output_dir>/tb/`; on resume from step S, events after S are purged (the interrupted run's)."""

    name = "tensorboard"

    def __init__(self, identity: RunIdentity, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(identity.output_dir / "tb"), purge_step=resume_step + 1)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._tb.add_scalar(key, value, step)
        self._tb.flush()  # a failing disk shows here, at this step, not silently in a writer thread

    def close(self, outcome: str = "finished") -> None:
        self._tb.close()  # TensorBoard has no run state: the outcome is in run_state.json


class WandbTracker(Tracker):
    """A W&B run in `<output_dir>/wandb/`: config = {"config": run config, "recipe": preset + overrides}."""

    name = "wandb"

    def __init__(self, identity: RunIdentity, resume_step: int) -> None:
        import wandb

        previous = read_ids(identity.output_dir).get(self.name, {})
        branch = branch_fields(previous, identity)
        run_id = (None if branch else previous.get("run_id")) or new_run_id()
        ids = {"run_id": run_id, **branch} if branch else {"run_id": run_id, **_branch_of(previous)}
        write_ids(identity.output_dir, self.name, ids)  # before init: a crash in it keeps the id
        tags = identity.tags or None  # None: wandb reads WANDB_TAGS itself
        self.run = wandb.init(
            project=identity.project_name("WANDB_PROJECT"), name=identity.name("WANDB_NAME"), tags=tags,
            id=run_id, resume="allow", dir=str(identity.output_dir), reinit="create_new",
            config={"config": identity.config, "recipe": identity.recipe, **_branch_of(ids)},
            # the run's console output stays the job's (stdout/stderr untouched: SLURM logs, exit-record tap)
            settings=wandb.Settings(console="off"))
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        if resume_step:
            log.info("wandb: continuing run %s from step %d", run_id, resume_step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, STEP_KEY: step})

    def close(self, outcome: str = "finished") -> None:
        if outcome == "stopped":
            self.run.mark_preempting()  # W&B's own state for a run that a requeue continues
        self.run.finish(exit_code=_WANDB_EXIT_CODE[outcome])


class MlflowTracker(Tracker):
    """An MLflow run (the client API: no process-wide active run): params = the flattened run config
    and the recipe; on resume only params not yet logged are added (MLflow params cannot change)."""

    name = "mlflow"

    def __init__(self, identity: RunIdentity, resume_step: int) -> None:
        from mlflow.tracking import MlflowClient

        uri = (identity.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
               or (identity.output_dir.resolve() / "mlruns").as_uri())
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: file stores are opt-in
        self.client = MlflowClient(tracking_uri=uri)
        with _mlflow_startup_limits():  # a server that does not answer: a warning in seconds, not minutes
            self._start(identity, uri, resume_step)

    def _start(self, identity: RunIdentity, uri: str, resume_step: int) -> None:
        previous = read_ids(identity.output_dir).get(self.name, {})
        same_store = previous.get("tracking_uri") == uri
        branch = branch_fields(previous, identity) if same_store else {}
        if previous.get("run_id") and same_store and not branch:
            self.run_id = previous["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            logged = set(self.client.get_run(self.run_id).data.params)
            log.info("mlflow: continuing run %s from step %d", self.run_id, resume_step)
        else:
            experiment = identity.project_name("MLFLOW_EXPERIMENT_NAME")
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            tags = {t: "true" for t in identity.tags}
            if branch:  # nested under the run it branches from
                tags.update({k: str(v) for k, v in branch.items()})
                tags["mlflow.parentRunId"] = branch["parent_run_id"]
                log.info("mlflow: rewound to step %d: new run, branched from %s", identity.rewound_to,
                         branch["parent_run_id"])
            run = self.client.create_run(experiment_id, run_name=identity.name("MLFLOW_RUN_NAME"), tags=tags)
            self.run_id, logged = run.info.run_id, set()
            write_ids(identity.output_dir, self.name, {"run_id": self.run_id, "tracking_uri": uri,
                                                       "experiment_id": experiment_id, **branch})
        self._log_params({**flat_params(identity.config), **flat_params({"recipe": identity.recipe})}, logged)

    def _log_params(self, params: dict[str, str], logged: set[str]) -> None:
        from mlflow.entities import Param

        new = [Param(_mlflow_key(k), v[:_MLFLOW_PARAM_CHARS]) for k, v in sorted(params.items())
               if _mlflow_key(k) not in logged]
        for i in range(0, len(new), _MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + _MLFLOW_PARAMS_PER_BATCH])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), float(v), stamp, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), _MLFLOW_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _MLFLOW_METRICS_PER_BATCH])

    def close(self, outcome: str = "finished") -> None:
        self.client.set_terminated(self.run_id, status=_MLFLOW_STATUS[outcome])


#: MLflow's HTTP settings while a tracker starts (its own defaults retry for minutes): variable -> value
MLFLOW_STARTUP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                         "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


@contextlib.contextmanager
def _mlflow_startup_limits() -> Iterator[None]:
    """MLflow's request retries and timeout bounded (`MLFLOW_STARTUP_LIMITS`: about 13 s for a server that
    refuses connections, 30 s for one that never answers) for the start-up's requests, each variable
    only where the user has not set it; logging mid-run keeps MLflow's own (a brief outage is ridden out)."""
    unset = [k for k in MLFLOW_STARTUP_LIMITS if k not in os.environ]
    os.environ.update({k: MLFLOW_STARTUP_LIMITS[k] for k in unset})
    try:
        yield
    finally:
        for key in unset:
            os.environ.pop(key, None)


def branch_fields(previous: dict[str, str], identity: RunIdentity) -> dict[str, Any]:
    """{parent_run_id, branched_at_step} when this start is a rewind of a run a tracker already holds
    (a new tracker run then begins); {} otherwise (a fresh run, or a resume that continues the run)."""
    if identity.rewound_to is None or not previous.get("run_id"):
        return {}
    return {"parent_run_id": previous["run_id"], "branched_at_step": identity.rewound_to}


def _branch_of(ids: dict[str, Any]) -> dict[str, Any]:
    """The branch fields a run's ids carry (kept when a requeue continues a branched run)."""
    return {k: ids[k] for k in ("parent_run_id", "branched_at_step") if k in ids}


def new_run_id() -> str:
    """A W&B run id: 8 characters of [a-z0-9], as W&B's own (about 2.8e12 of them)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _mlflow_key(key: str) -> str:
    """MLflow accepts letters, digits, `_ - . / :` and spaces in names; anything else becomes `_`."""
    return _MLFLOW_BAD_KEY.sub("_", key)


_OPENERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


class TrackerSet:
    """The run's trackers (jsonl aside); a tracker that raises is reported once and dropped."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)
        self.failed: list[str] = []

    @classmethod
    def open(cls, names: Sequence[str], identity: RunIdentity, resume_step: int) -> "TrackerSet":
        trackers = []
        for name in names:
            if name not in _OPENERS:
                continue
            try:
                trackers.append(_OPENERS[name](identity, resume_step))
            except Exception as err:  # noqa: BLE001 - tracking never stops training
                hint = ("; on a node without internet or W&B login: WANDB_MODE=offline, then `wandb sync "
                        f"{identity.output_dir}/wandb/offline-run-*` from a node with one") if name == "wandb" else ""
                log.warning("tracker %s could not start (%s: %s); the run goes on without it%s",
                            name, type(err).__name__, err, hint)
        return cls(trackers)

    def _drop(self, tracker: Tracker, what: str, err: BaseException) -> None:
        log.warning("tracker %s failed %s (%s: %s); the run goes on without it", tracker.name, what,
                    type(err).__name__, err)
        self.trackers.remove(tracker)
        self.failed.append(tracker.name)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(step, scalars)
            except Exception as err:  # noqa: BLE001 - tracking never stops training
                self._drop(tracker, f"at step {step}", err)

    def close(self, outcome: str = "finished") -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"tracker outcome {outcome!r}: expected one of {', '.join(OUTCOMES)}")
        for tracker in list(self.trackers):
            try:
                tracker.close(outcome)
            except Exception as err:  # noqa: BLE001
                self._drop(tracker, "at close", err)
        self.trackers = []


def scalars_of(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record (what every tracker gets)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def open_identity(output_dir: str | os.PathLike, config: Optional[dict], recipe: Optional[dict],
                  train: Any = None, default_project: str = "") -> RunIdentity:
    """A `RunIdentity` from the run's `TrainConfig` (`train`: names, tags, MLflow URI) and config dicts."""
    return RunIdentity(
        output_dir=Path(output_dir), project=getattr(train, "tracker_project", ""),
        run_name=getattr(train, "tracker_run_name", ""), tags=list(getattr(train, "tracker_tags", []) or []),
        config=dict(config or {}), recipe=dict(recipe or {}),
        default_project=default_project or "contrastive-pretrain",
        mlflow_tracking_uri=getattr(train, "mlflow_tracking_uri", ""))
