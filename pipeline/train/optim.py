"""Optimizer, learning-rate schedule and the optional NVIDIA apex fused ops.

`build_optimizer` picks the implementation: DeepSpeed's FusedAdam on GPU (torch's fused AdamW
when DeepSpeed's op cannot be built), DeepSpeedCPUAdam when ZeRO offloads the optimizer, torch
AdamW on CPU; NVIDIA apex FusedAdam / FusedLAMB when `optim.impl=apex`; `optim.name=stable_adamw`
is `pipeline.train.stable_adamw.StableAdamW` on every device. apex is an optional extra that is
detected at run time and never required (and the unrelated PyPI package named `apex` is
rejected: it has no `apex.optimizers`).

The schedule (`optim.schedule`: linear, cosine, wsd) is a pure function of the step (`lr_at`),
applied to the optimizer before every step, so resuming needs no scheduler state and skipped
steps cannot shift it; `first_lr_change` compares two schedules over the steps already trained
(a WSD decay branched off a stable-phase checkpoint, `pipeline.train.checkpoint.schedule_branch`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from pipeline.config.checks import ConfigError, check_choice, check_positive

log = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "lamb", "stable_adamw")
OPTIMIZER_IMPLS = ("auto", "torch", "deepspeed", "apex")
SCHEDULES = ("linear", "cosine", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
#: `optim.*` fields that only `lr_at` reads (a resume may change them when the rate of every trained step stays)
SCHEDULE_FIELDS = ("lr", "schedule", "warmup_steps", "min_lr_ratio", "decay_shape", "decay_steps", "decay_fraction")


@dataclass
class OptimConfig:
    name: str = "adamw"
    """`adamw` (decoupled weight decay), `lamb` (GPU only: DeepSpeed or apex fused LAMB) or `stable_adamw`
    (AdamW with per-tensor update clipping, Wortsman et al. 2023: `pipeline.train.stable_adamw`; impl auto/torch)."""
    impl: str = "auto"
    """`auto` (DeepSpeed FusedAdam on GPU, torch AdamW on CPU), `torch`, `deepspeed`, `apex`."""
    lr: float = 1e-4
    """Peak learning rate, reached at the end of warm-up."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam (beta1, beta2)."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay λ; never applied to biases and LayerNorm weights. Per step, θ ← θ (1 - η_t λ)
    (AdamW's convention, scaled by the rate), or θ ← θ (1 - λ η_t / lr) with `decoupled_wd`."""
    decoupled_wd: bool = False
    """Fully decoupled weight decay (Loshchilov & Hutter 2019's schedule multiplier; torch-optimi's
    `decouple_lr=True`, ModernBERT's convention): the decay per step is λ η_t / `lr`, i.e. λ itself at the
    peak and following the schedule's shape, independent of the peak rate. false: AdamW's λ η_t."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to `lr` over this many steps."""
    min_lr_ratio: float = 0.0
    """The decay ends at `lr * min_lr_ratio` (every schedule)."""
    schedule: str = "linear"
    """After warm-up: `linear` decay, `cosine` decay, or `wsd` (warm-up, stable at `lr`, then a decay of
    `decay_shape` over the last `decay_steps` / `decay_fraction` of the steps); see `lr_at`."""
    decay_shape: str = "linear"
    """`wsd` only: the decay's shape, `linear`, `cosine` or `1-sqrt` (Hägele et al. 2024)."""
    decay_steps: int = 0
    """`wsd` only: the decay's length in steps (the last ones of `train.total_steps`); 0 = `decay_fraction`."""
    decay_fraction: float = 0.2
    """`wsd` only, when `decay_steps` is 0: the decay's share of `train.total_steps`, rounded (0.2: Hägele et al.
    2024's cool-down that matches a cosine run)."""
    grad_clip: float = 1.0
    """Global gradient-norm clipping threshold (0 disables)."""

    def check(self) -> None:
        """Stage-1 checks (the config alone)."""
        check_choice(self.name, OPTIMIZERS, "optim.name")
        check_choice(self.impl, OPTIMIZER_IMPLS, "optim.impl")
        check_positive(self.lr, "optim.lr")
        check_positive(self.eps, "optim.eps")
        check_positive(self.weight_decay, "optim.weight_decay", allow_zero=True)
        check_positive(self.warmup_steps, "optim.warmup_steps", allow_zero=True)
        check_positive(self.grad_clip, "optim.grad_clip", allow_zero=True)
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas={list(self.betas)}: each must be in [0, 1)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        check_choice(self.schedule, SCHEDULES, "optim.schedule")
        check_choice(self.decay_shape, DECAY_SHAPES, "optim.decay_shape")
        check_positive(self.decay_steps, "optim.decay_steps", allow_zero=True)
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(f"optim.decay_fraction={self.decay_fraction}: must be in (0, 1]")
        if self.schedule != "wsd":
            wsd_only = {"decay_shape": "linear", "decay_steps": 0, "decay_fraction": 0.2}
            for key, default in wsd_only.items():
                if getattr(self, key) != default:
                    raise ConfigError(f"optim.{key}={getattr(self, key)!r} applies to optim.schedule=wsd only "
                                      f"(optim.schedule={self.schedule!r})")
        if self.decoupled_wd and self.name == "lamb":
            raise ConfigError("optim.decoupled_wd=true: LAMB adds the decay to the update before its trust ratio, "
                              "so it cannot be decoupled from the rate; use optim.name=adamw or stable_adamw")
        if self.name == "stable_adamw" and self.impl not in ("auto", "torch"):
            raise ConfigError(f"optim.impl={self.impl} has no StableAdamW; optim.name=stable_adamw runs with "
                              "optim.impl=auto or torch (pipeline.train.stable_adamw)")

    def check_steps(self, total_steps: int, where: str = "train.total_steps") -> None:
        """Checks against the run's length (`where` names it): warm-up and the WSD decay must fit."""
        if self.warmup_steps >= total_steps and total_steps > 1:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be < {where}={total_steps}")
        if self.schedule == "wsd":
            start, length = decay_window(self, total_steps)
            if self.decay_steps > total_steps:
                raise ConfigError(f"optim.decay_steps={self.decay_steps} exceeds the run ({where}={total_steps}): the "
                                  f"WSD decay is the run's last decay_steps steps; set it to at most {total_steps}")
            if start < self.warmup_steps:
                field = f"optim.decay_steps={self.decay_steps}" if self.decay_steps else \
                    f"optim.decay_fraction={self.decay_fraction} ({length} steps)"
                raise ConfigError(f"{field}: the WSD decay would start at step {start + 1}, inside the warm-up "
                                  f"(optim.warmup_steps={self.warmup_steps}) of {where}={total_steps}")

    def check_device(self, cuda: bool) -> None:
        """Stage-2 checks: the implementation this machine must support."""
        from pipeline.capabilities import apex_available

        if self.impl == "apex" and not (cuda and apex_available()):
            raise ConfigError("optim.impl=apex needs NVIDIA apex (built from github.com/NVIDIA/apex, never the "
                              "PyPI package 'apex') on a GPU machine")
        if self.name == "lamb" and not cuda:
            raise ConfigError("optim.name=lamb needs a GPU (DeepSpeed FusedLamb or apex FusedLAMB); use optim.name=adamw")
        if self.impl == "deepspeed" and not cuda:
            raise ConfigError("optim.impl=deepspeed (FusedAdam) needs a GPU; use optim.impl=auto or torch")


def check_optimizer_kept(saved: dict, config: dict) -> None:
    """A resume keeps the optimizer (`saved`, `config`: the checkpoint's and this run's config dicts): the
    checkpoint's moments are that optimizer's own (AdamW stores m and v bias-uncorrected, StableAdamW
    debiased; LAMB's fused kernels their own layout), and another would silently reinterpret them, so
    a change of `optim.name` is refused even with `train.allow_config_change` (no conversion is made)."""
    old, new = (saved.get("optim") or {}).get("name", "adamw"), (config.get("optim") or {}).get("name", "adamw")
    if old != new:
        raise ConfigError(f"optim.name={new}: the checkpoint was trained with optim.name={old}, whose optimizer state "
                          f"(moments) {new} would misread; a resume keeps the optimizer. Resume with optim.name={old}, "
                          "or start a new train.output_dir warm-started from the converted weights (model.init_from)")


def group_weight_decay(cfg: OptimConfig) -> float:
    """The `weight_decay` handed to the optimizer, whose update is θ ← θ (1 - η_t · it) in every
    implementation here: λ (AdamW's convention), or λ / lr with `decoupled_wd` (so that the decay is
    λ η_t / lr, torch-optimi's `decouple_lr`, with any AdamW kernel)."""
    return cfg.weight_decay / cfg.lr if cfg.decoupled_wd else cfg.weight_decay


#: float32's half-ulp below 1: 1 - x rounds to exactly 1.0 in float32 for every x <= this (ties to even)
FLOAT32_HALF_ULP_BELOW_ONE = 2.0 ** -25


def ineffective_decay_warning(cfg: OptimConfig) -> Optional[str]:
    """The warning for a weight decay that cannot change a float32 weight, else None: the decay factor
    at the peak rate, 1 - x with x = lr λ (or λ with `decoupled_wd`), is exactly 1.0 in float32
    (x <= 2^-25), so every multiplication by it leaves the weight as it was (and earlier in warm-up,
    with a smaller rate, too)."""
    if cfg.weight_decay == 0.0:
        return None
    per_step = cfg.weight_decay if cfg.decoupled_wd else cfg.lr * cfg.weight_decay
    if float(torch.tensor(1.0 - per_step, dtype=torch.float32)) != 1.0:
        return None
    convention = "optim.decoupled_wd=true: λ" if cfg.decoupled_wd else \
        f"lr x weight_decay = {cfg.lr:g} x {cfg.weight_decay:g}"
    hint = "" if cfg.decoupled_wd else ", or set optim.decoupled_wd=true (decay λ per step)"
    return (f"optim.weight_decay={cfg.weight_decay:g} does nothing: the decay per step at the peak rate ({convention} "
            f"= {per_step:.3g}) is below float32's resolution at 1 ({FLOAT32_HALF_ULP_BELOW_ONE:.3g}), so "
            f"1 - it == 1.0 and float32 weights never change by it; raise it{hint}")


def warn_ineffective_decay(cfg: OptimConfig) -> None:
    """Log `ineffective_decay_warning`, if any (once per run, before compute: `check_run`)."""
    if (message := ineffective_decay_warning(cfg)) is not None:
        log.warning("%s", message)


def decay_window(cfg: OptimConfig, total_steps: int) -> tuple[int, int]:
    """(S, D): the decay trains steps S+1 .. S+D = T. linear / cosine: S = W, D = max(1, T - W);
    wsd: D = decay_steps, or round(decay_fraction * T) (at least 1), and S = T - D (steps W+1 .. S
    are the stable phase at the peak rate)."""
    if cfg.schedule != "wsd":
        return cfg.warmup_steps, max(1, total_steps - cfg.warmup_steps)
    length = cfg.decay_steps if cfg.decay_steps > 0 else max(1, math.floor(cfg.decay_fraction * total_steps + 0.5))
    return total_steps - length, length


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (1-based) under `optim.schedule`.

        warm-up  (s <= W):       lr * s / W
        stable   (W < s <= S):   lr                                    (wsd only; S = W otherwise)
        decay    (s >  S):       lr * (r + (1 - r) * f(a)),   a = clip((T - s + 1) / D, 0, 1)

    with W = warmup_steps, T = total_steps, r = min_lr_ratio, (S, D) = `decay_window`, and the
    decay shape f: linear f(a) = a (`linear` schedule, today's values bit for bit, and wsd's
    `linear`), cosine f(a) = (1 - cos(pi a)) / 2 (`cosine`, and wsd's `cosine`), 1-sqrt
    f(a) = 1 - sqrt(1 - a) (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond
    Fixed Training Durations"). a runs from 1 at the first decay step down to 1/D at the last, so
    the peak is reached at s = W (s = S+1 for linear/cosine) and the last step still trains (chosen,
    as the linear schedule always did: a step at rate 0 would be a wasted step).
    """
    warmup = cfg.warmup_steps
    if step <= warmup:
        return cfg.lr * step / warmup
    start, span = decay_window(cfg, total_steps)
    if step <= start:
        return cfg.lr
    remaining = min(1.0, max(0.0, (total_steps - step + 1) / span))
    shape = "cosine" if cfg.schedule == "cosine" else cfg.decay_shape if cfg.schedule == "wsd" else "linear"
    if shape == "cosine":
        remaining = 0.5 * (1.0 - math.cos(math.pi * remaining))
    elif shape == "1-sqrt":
        remaining = 1.0 - math.sqrt(1.0 - remaining)
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * remaining)


def first_lr_change(old: OptimConfig, old_total: int, new: OptimConfig, new_total: int, through: int) -> Optional[int]:
    """The first step in 1 .. `through` whose rate differs (exact float comparison) between the two
    schedules, or None: whether a resume at step `through` leaves every trained step's rate as it was."""
    for step in range(1, through + 1):
        if lr_at(step, old, old_total) != lr_at(step, new, new_total):
            return step
    return None


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices with weight decay; biases and LayerNorm weights (1-D) without (BERT)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # de-duplicates the tied embedding
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig, device_type: str, offload: bool = False) -> torch.optim.Optimizer:
    """The optimizer for `model` per `optim.name`/`optim.impl` (see the module docstring)."""
    groups = param_groups(model, group_weight_decay(cfg))
    common = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    impl = resolve_impl(cfg, device_type, offload)
    if cfg.name == "stable_adamw":
        if offload:
            raise ConfigError("optim.name=stable_adamw: ZeRO's offload_optimizer steps with DeepSpeedCPUAdam (plain "
                              "AdamW); use an engine without offload_optimizer, or optim.name=adamw")
        from pipeline.train.stable_adamw import StableAdamW

        return StableAdamW(groups, **common)
    if cfg.name == "lamb":
        if impl == "apex":
            from apex.optimizers import FusedLAMB

            return FusedLAMB(groups, **common, max_grad_norm=0.0)  # clipping is DeepSpeed's
        from deepspeed.ops.lamb import FusedLamb

        return FusedLamb(groups, **common)
    if impl == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, **common, adamw_mode=True)
    if impl == "apex":
        from apex.optimizers import FusedAdam as ApexFusedAdam

        return ApexFusedAdam(groups, **common, adam_w_mode=True)
    if impl == "deepspeed":
        try:
            from deepspeed.ops.adam import FusedAdam

            return FusedAdam(groups, **common, adam_w_mode=True)
        except Exception as err:  # the op is JIT-built; without a CUDA toolchain fall back to torch's fused kernel
            if cfg.impl == "deepspeed":
                raise RuntimeError(f"optim.impl=deepspeed: DeepSpeed FusedAdam unavailable ({err})") from err
            log.warning("DeepSpeed FusedAdam unavailable (%s); using torch AdamW(fused=True)", err)
            return torch.optim.AdamW(groups, **common, fused=True)
    return torch.optim.AdamW(groups, **common, fused=device_type == "cuda")


def resolve_impl(cfg: OptimConfig, device_type: str, offload: bool) -> str:
    """`optim.impl` made concrete for this device: cpu_adam, apex, deepspeed or torch."""
    if offload:
        return "cpu_adam"
    if cfg.name == "stable_adamw":
        return "torch"
    if cfg.impl == "auto":
        return "deepspeed" if device_type == "cuda" else "torch"
    return cfg.impl


def use_apex_layernorm(model: nn.Module) -> int:
    """Replace every `nn.LayerNorm` by apex's FusedLayerNorm (same parameter names); returns the count."""
    from apex.normalization import FusedLayerNorm

    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.LayerNorm:
                fused = FusedLayerNorm(child.normalized_shape, eps=child.eps, elementwise_affine=True)
                with torch.no_grad():
                    fused.weight.copy_(child.weight)
                    fused.bias.copy_(child.bias)
                setattr(parent, name, fused)
                replaced += 1
    return replaced


def count_parameters(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)
