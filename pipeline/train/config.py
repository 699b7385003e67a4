"""`train.*`: length, seed, output, logging, checkpointing and the guards of a run, owned and validated here."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.checks import ConfigError, check_positive


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
    """Also write metrics to TensorBoard in `<output_dir>/tb/`."""

    def check(self) -> None:
        """Stage-1 checks (the config alone)."""
        for name in ("total_steps", "log_every", "checkpoint_every", "keep_last", "max_nonfinite_steps",
                     "dist_timeout_s"):
            check_positive(getattr(self, name), f"train.{name}")
        for name in ("max_loss_ratio", "max_weight_norm_ratio"):
            value = getattr(self, name)
            if value != 0 and value <= 1:
                raise ConfigError(f"train.{name}={value}: must be > 1 (a ratio to the run's own history), or 0 for off")
        if not self.resume:
            raise ConfigError("train.resume: use 'auto', 'never' or a checkpoint directory")
