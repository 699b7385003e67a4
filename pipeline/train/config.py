"""`train.*`: length, seed, output, logging, checkpointing and the guards of a run, owned and validated here."""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.checks import ConfigError, check_positive
from pipeline.train.profiler import ProfileConfig
from pipeline.train.trackers import DEFAULT_TRACKERS, check_installed, check_tracker_names


@dataclass
class TrainConfig:
    total_steps: int = 20
    """Optimizer steps of the whole run (the LR schedule and CAPT's temperature depend on it)."""
    seed: int = 1234
    """Seed of initialisation, data order, masking, objective sampling and dropout (`pipeline.seeding`)."""
    output_dir: str = ""
    """Run directory (checkpoints/, metrics.jsonl, tb/); default: runs/<preset name>."""
    log_every: int = 10
    """Write metrics every this many steps (and on the last step)."""
    checkpoint_every: int = 1000
    """Save a checkpoint every this many steps (and on the last step, and on SIGTERM/SIGUSR1)."""
    keep_last: int = 3
    """Complete checkpoints kept in `<output_dir>/checkpoints/` (older ones are deleted)."""
    keep_best: str = ""
    """A logged metric (e.g. `val/mlm/loss`) whose best value's checkpoint is kept besides the
    `keep_last` newest: a new best saves that step's checkpoint, `checkpoints/best.json` names it, and
    pruning never deletes it (`pipeline.train.checkpoint.best`). "" = off."""
    keep_best_mode: str = "min"
    """`min` (a loss) or `max` (an accuracy, a correlation): which direction of `keep_best` is better."""
    resume: str = "auto"
    """`auto` (from `<output_dir>/checkpoints/latest` if present), `never`, or a checkpoint tag directory."""
    allow_config_change: bool = False
    """Resume even if the checkpoint's config or data manifest differs (the differences are logged)."""
    max_nonfinite_steps: int = 10
    """Stop with an error after this many consecutive steps with a non-finite loss (each one is skipped)."""
    max_loss_ratio: float = 10.0
    """Divergence guard: stop (exit 3, no checkpoint of that step) when a step's finite loss exceeds this
    many times the running mean of the run's losses (an exponential moving average, weight 0.1 per
    step, kept in the checkpoint). 0 switches it off."""
    max_weight_norm_ratio: float = 10.0
    """Divergence guard at every save: stop (exit 3, that checkpoint not written) when the weights' L2
    norm exceeds this many times the norm at the previous checkpoint of the run. 0 switches it off."""
    dist_timeout_s: int = 1800
    """Seconds any collective (all-reduce, barrier, checkpoint agreement) waits for the other ranks
    before failing (the gloo/NCCL process-group timeout): a dead or hung rank ends the run after
    this long instead of hanging it. Must exceed the longest legitimate wait (rank 0 hashing a
    checkpoint, a first universal-format conversion on resume)."""
    deterministic: bool = False
    """`torch.use_deterministic_algorithms` (e.g. scatter-add gradients in a fixed order): bitwise
    reproducible runs and resumes; costs little on CPU, can be slower on GPU."""
    progress_bar: bool = True
    """Rank-0 tqdm progress bar."""
    tensorboard: bool = True
    """Older switch of the TensorBoard tracker, kept working: `false` drops `tensorboard` from `train.trackers`."""
    trackers: list[str] = field(default_factory=lambda: list(DEFAULT_TRACKERS))
    """Where each logged step's scalars go: any of `jsonl` (`metrics.jsonl`, read by resume and `cpt-status`),
    `tensorboard` (`tb/`), `wandb`, `mlflow` (optional extras: `pip install ".[wandb]"` / `".[mlflow]"`);
    rank 0 only; a tracker failing mid-run is dropped with one warning (`pipeline.train.trackers`)."""
    tracker_project: str = ""
    """W&B project / MLflow experiment; "" -> `WANDB_PROJECT` / `MLFLOW_EXPERIMENT_NAME`, then the preset name."""
    tracker_run_name: str = ""
    """W&B / MLflow run name; "" -> `WANDB_NAME` / `MLFLOW_RUN_NAME`, then the output directory's name."""
    tracker_tags: list[str] = field(default_factory=list)
    """Tags of the W&B / MLflow run (empty: W&B reads `WANDB_TAGS`)."""
    mlflow_tracking_uri: str = ""
    """MLflow store; "" -> `MLFLOW_TRACKING_URI`, then a local file store `file://<output_dir>/mlruns`."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """`{start, steps}`: a `torch.profiler` trace of steps start..start+steps-1 on rank 0 and a table of the top
    operators by self time, in `<output_dir>/profile/` (`pipeline.train.profiler`); `start: 0` (default): off."""

    def active_trackers(self) -> list[str]:
        """`trackers`, less `tensorboard` when the older `tensorboard` switch is false."""
        return [t for t in self.trackers if self.tensorboard or t != "tensorboard"]

    def check(self) -> None:
        """Stage-1 checks (the config alone)."""
        for name in ("total_steps", "log_every", "checkpoint_every", "keep_last", "max_nonfinite_steps",
                     "dist_timeout_s"):
            check_positive(getattr(self, name), f"train.{name}")
        for name in ("max_loss_ratio", "max_weight_norm_ratio"):
            value = getattr(self, name)
            if value != 0 and value <= 1:
                raise ConfigError(f"train.{name}={value}: must be > 1 (a ratio to the run's own history), or 0 for off")
        if self.keep_best_mode not in ("min", "max"):
            raise ConfigError(f"train.keep_best_mode={self.keep_best_mode!r}: use 'min' or 'max'")
        if not isinstance(self.keep_best, str):
            raise ConfigError(f"train.keep_best={self.keep_best!r}: a metric name (e.g. val/mlm/loss), or '' for off")
        if not self.resume:
            raise ConfigError("train.resume: use 'auto', 'never' or a checkpoint directory")
        check_tracker_names(self.trackers)
        self.profile.check(self.total_steps)
        check_installed(self.active_trackers())  # before compute: the install line, not a crash at step 1
