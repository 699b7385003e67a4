"""Optimizer, learning-rate schedule and the optional NVIDIA apex fused ops.

`build_optimizer` picks the implementation: DeepSpeed's FusedAdam on GPU (torch's fused AdamW
when DeepSpeed's op cannot be built), DeepSpeedCPUAdam when ZeRO offloads the optimizer, torch
AdamW on CPU; NVIDIA apex FusedAdam / FusedLAMB when `optim.impl=apex`. apex is an optional extra
that is detected at run time and never required (and the unrelated PyPI package named `apex` is
rejected: it has no `apex.optimizers`).

The schedule is a pure function of the step (`lr_at`), applied to the optimizer before every
step, so resuming needs no scheduler state and skipped steps cannot shift it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from pipeline.config.checks import ConfigError, check_choice, check_positive

log = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "lamb")
OPTIMIZER_IMPLS = ("auto", "torch", "deepspeed", "apex")


@dataclass
class OptimConfig:
    name: str = "adamw"
    """`adamw` (decoupled weight decay) or `lamb` (GPU only: DeepSpeed or apex fused LAMB)."""
    impl: str = "auto"
    """`auto` (DeepSpeed FusedAdam on GPU, torch AdamW on CPU), `torch`, `deepspeed`, `apex`."""
    lr: float = 1e-4
    """Peak learning rate, reached at the end of warm-up."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam (beta1, beta2)."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay; never applied to biases and LayerNorm weights."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to `lr` over this many steps."""
    min_lr_ratio: float = 0.0
    """Linear decay after warm-up ends at `lr * min_lr_ratio` on the last step."""
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


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warm-up, then linear decay.

        warm-up  (s <= W):  lr * s / W
        decay    (s >  W):  lr * (r + (1 - r) * (T - s + 1) / (T - W))

    with W = warmup_steps, T = total_steps, r = min_lr_ratio: the peak is reached at s = W and
    the last step still trains (its rate is lr * (r + (1 - r) / (T - W))).
    """
    warmup = cfg.warmup_steps
    if step <= warmup:
        return cfg.lr * step / warmup
    span = max(1, total_steps - warmup)
    remaining = min(1.0, max(0.0, (total_steps - step + 1) / span))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * remaining)


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
    groups = param_groups(model, cfg.weight_decay)
    common = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    impl = resolve_impl(cfg, device_type, offload)
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
