"""StableAdamW: AdamW with per-tensor update clipping (Wortsman et al. 2023, "Stable and low-precision
training for large-scale vision-language models", Algorithm 2; the optimizer of ModernBERT / Ettin).

For every tensor θ with gradient g at step t (1-based), with β1, β2, ε, weight decay λ and the
scheduled rate η_t:

    β̂_i  = β_i (1 - β_i^(t-1)) / (1 - β_i^t)                  (bias correction folded into β: β̂ = 0 at t = 1)
    m_t  = β̂_1 m_(t-1) + (1 - β̂_1) g
    v_t  = β̂_2 v_(t-1) + (1 - β̂_2) g²
    RMS_t = sqrt(mean(g² / max(v_t, ε²)))                      (over the tensor's elements)
    η̂_t  = η_t / max(1, RMS_t)                                 (update clipping, AdaFactor's idea)
    θ_t  = θ_(t-1) - η̂_t λ θ_(t-1) - η̂_t m_t / (sqrt(v_t) + ε)

RMS_t > 1 means the second moment under-estimates the current gradient (a stale v after a loss
spike); the clipping shrinks that tensor's step instead of letting it blow up.

Why not `torch-optimi`'s StableAdamW (MIT, the maintained implementation): it keeps one step
counter per parameter *group* (`group["step"]`), incremented on every `step()` call even for a
group without gradients. DeepSpeed ZeRO 3 calls the client optimizer's `step()` once per
sub-group with only that sub-group's flat partition in its group (`stage3._optimizer_step`), so
with several sub-groups the counter — and the bias correction — advances several times a step.
This implementation keeps the step per tensor (`state["step"]`, as torch's AdamW), so any caller
order is right, and names its state like torch's AdamW (`step`, `exp_avg`, `exp_avg_sq`), which
DeepSpeed's checkpoint and universal-checkpoint code expects.

The clipping unit is the tensor the optimizer is given. Without ZeRO that is each weight matrix,
as in the paper. Under DeepSpeed ZeRO 1/2/3 the client optimizer is given each rank's flat fp32
partition of a parameter group (ZeRO 3: of a sub-group), so the RMS is taken over that partition
(padding included, which adds zeros to the mean): a coarser clip than per weight matrix that
depends on the rank count, the same on every resume. Per-weight clipping inside ZeRO partitions is not implemented.

No host synchronisation: the clip factor stays a 0-d tensor on the parameter's device.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch


def debiased_beta(beta: float, step: int) -> float:
    """β (1 - β^(t-1)) / (1 - β^t): the moment decay with Adam's bias correction folded in (0 at t = 1)."""
    return beta * (1.0 - beta ** (step - 1)) / (1.0 - beta ** step)


class StableAdamW(torch.optim.Optimizer):
    """StableAdamW (see the module docstring). `weight_decay` is decoupled and scaled by the
    clipped rate, as AdamW's (θ ← θ (1 - η̂ λ))."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"StableAdamW: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("StableAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)  # a tensor, as torch's AdamW (checkpoint formats expect it)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = int(state["step"].item())  # a CPU tensor: no device synchronisation
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, 1.0 - debiased_beta(beta1, t))
                exp_avg_sq.mul_(debiased_beta(beta2, t)).addcmul_(grad, grad, value=1.0 - debiased_beta(beta2, t))
                rms = grad.square().div_(exp_avg_sq.clamp_min(eps * eps)).mean().sqrt()
                rate = lr / rms.clamp_min(1.0)  # η̂_t, a 0-d tensor on p's device
                if weight_decay != 0.0:
                    p.mul_(1.0 - rate * weight_decay)
                p.sub_(exp_avg / (exp_avg_sq.sqrt() + eps) * rate)
        return loss
