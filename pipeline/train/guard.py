"""The non-finite and divergence guard: counts steps whose loss or gradients were not finite, stops a
run that keeps producing them, and stops a run whose loss or weights blow up while staying finite.

A step is *bad* when any rank's loss was NaN/Inf, or when DeepSpeed dropped the update (its
gradients were not finite) outside fp16, where a dropped update is routine loss-scale overflow.
DeepSpeed skips bad updates itself; the guard checks that it did (an applied update with a
non-finite loss means this DeepSpeed version does not skip them), keeps the counters in the
checkpointed `TrainState`, and raises `NonFiniteLossError` after `max_in_row` bad steps in a row.

Before every checkpoint (`check_savable`) it also makes sure no checkpoint of a broken run is
ever written or made `latest`, whatever `max_in_row` is:
  * weights with a NaN/Inf on any rank (a blow-up through a finite loss, or any other way) stop
    the run, and that checkpoint is not written;
  * a run whose last step ends a streak of bad steps fails instead of finishing: its final
    checkpoint would hold the weights from before the streak under the final step's name, and a
    resume would then find nothing left to do.
"""
from __future__ import annotations

import math
from typing import Callable, Protocol

import torch
from torch import nn


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss, or a non-finite update that was applied."""


class GuardCounters(Protocol):
    skipped_steps: int
    nonfinite_steps: int
    nonfinite_in_row: int


class DivergenceCounters(Protocol):
    loss_ema: float  # running mean of the finite step losses (0 = none yet)
    weight_norm: float  # weights' L2 norm at the previous checkpoint (0 = none yet)


class NonFiniteGuard:
    def __init__(self, max_in_row: int, fp16: bool, max_loss_ratio: float = 0.0,
                 max_weight_norm_ratio: float = 0.0) -> None:
        self.max_in_row, self.fp16 = max_in_row, fp16
        self.max_loss_ratio, self.max_weight_norm_ratio = max_loss_ratio, max_weight_norm_ratio

    def loss_diverged(self, counters: "DivergenceCounters", loss: float) -> bool:
        """Record step's mean loss; True when it is finite and above `max_loss_ratio` x the running
        mean (the mean is then left as it was: it describes the healthy steps)."""
        if not math.isfinite(loss):
            return False  # the non-finite guard's business
        if self.max_loss_ratio and counters.loss_ema > 0 and loss > self.max_loss_ratio * counters.loss_ema:
            return True
        counters.loss_ema = loss if counters.loss_ema == 0 else 0.9 * counters.loss_ema + 0.1 * loss
        return False

    def loss_divergence_error(self, counters: "DivergenceCounters", step: int, loss: float,
                              last_good: str) -> "NonFiniteLossError":
        return NonFiniteLossError(
            f"step {step}: loss {loss:.4g} is {loss / counters.loss_ema:.1f}x its running mean "
            f"{counters.loss_ema:.4g} (train.max_loss_ratio={self.max_loss_ratio:g}): the run diverged and was "
            f"stopped; nothing from step {step - 1} on was saved as good. Last good checkpoint: {last_good}. Lower "
            "optim.lr or raise optim.warmup_steps, then resume from it with train.resume=<that tag dir>")

    def check_weight_norm(self, counters: "DivergenceCounters", step: int, norm: float,
                          last_good: Callable[[], str]) -> None:
        """Raise before saving step `step` when the weights' norm grew more than `max_weight_norm_ratio`
        x since the previous checkpoint; otherwise record `norm` as the reference for the next one.
        `last_good()` names the last good checkpoint (called, collectively, only when raising)."""
        previous = counters.weight_norm
        if self.max_weight_norm_ratio and previous > 0 and not norm <= self.max_weight_norm_ratio * previous:
            raise NonFiniteLossError(
                f"step {step}: the weights' L2 norm {norm:.4g} is {norm / previous:.1f}x the norm {previous:.4g} at the "
                f"previous checkpoint (train.max_weight_norm_ratio={self.max_weight_norm_ratio:g}): the run diverged and "
                f"was stopped; the checkpoint of step {step} was not written. Last good checkpoint: {last_good()}. Lower "
                "optim.lr or raise optim.warmup_steps, then resume from it with train.resume=<that tag dir>")
        counters.weight_norm = norm

    def observe(self, counters: GuardCounters, step: int, nonfinite_losses: float, update_applied: bool) -> bool:
        """Record one step (losses summed over micro-batches and ranks); returns whether it was bad."""
        if nonfinite_losses and update_applied:
            raise NonFiniteLossError(f"step {step}: the loss is not finite but DeepSpeed applied the update; "
                                     "this DeepSpeed version does not skip non-finite steps")
        counters.skipped_steps += int(not update_applied)
        bad = nonfinite_losses > 0 or (not update_applied and not self.fp16)
        counters.nonfinite_steps += int(bad)
        counters.nonfinite_in_row = counters.nonfinite_in_row + 1 if bad else 0
        return bad

    def check(self, counters: GuardCounters, step: int) -> None:
        """Raise once `max_in_row` consecutive steps were bad."""
        if counters.nonfinite_in_row >= self.max_in_row:
            raise NonFiniteLossError(
                f"{counters.nonfinite_in_row} consecutive steps (up to step {step}) had a non-finite loss or "
                f"gradients and were skipped (train.max_nonfinite_steps={self.max_in_row}); lower optim.lr, raise "
                "optim.warmup_steps, or use fp32/bf16, then resume from the last checkpoint")

    def check_savable(self, counters: GuardCounters, step: int, final: bool, nonfinite_tensors: float) -> None:
        """Raise before a checkpoint that must not be written: `nonfinite_tensors` = weight tensors with
        a NaN/Inf summed over ranks (`count_nonfinite_weights`); `final` = the run's last step."""
        if nonfinite_tensors:
            raise NonFiniteLossError(
                f"step {step}: {int(nonfinite_tensors)} weight tensor(s) hold NaN/Inf values; the checkpoint of "
                "this step was not written (checkpoints/latest still names the last good one). Lower optim.lr, "
                "raise optim.warmup_steps or optim.grad_clip, or use fp32/bf16, then resume from the last checkpoint")
        if final and counters.nonfinite_in_row:
            raise NonFiniteLossError(
                f"the run's last {counters.nonfinite_in_row} step(s) (up to its final step {step}) had a non-finite "
                "loss or gradients and were skipped; the run did not finish: no final checkpoint was written "
                f"(checkpoints/latest still names the last one before). train.max_nonfinite_steps={self.max_in_row} "
                "was not reached only because the run ended first. Lower optim.lr, raise optim.warmup_steps, or "
                "use fp32/bf16, then resume from the last checkpoint")


def weight_stats(module: nn.Module, device: torch.device, is_main: bool) -> torch.Tensor:
    """`[parameter tensors holding a NaN/Inf, sum of squares of the weights]` of this rank, a
    2-element float64 tensor on `device` to be all-reduced (summed over ranks). Under ZeRO-3 each
    rank holds its own partition (`ds_tensor`), so every rank adds its part of the squares; under
    ZeRO 0-2 every rank holds all weights, so only rank 0 adds them (the sum is then the same for
    any rank count). Every rank counts its non-finite tensors."""
    stats = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for param in module.parameters():
            partitioned = hasattr(param, "ds_tensor")
            tensor = param.ds_tensor if partitioned else param
            if tensor.numel():
                stats[0] += (~torch.isfinite(tensor)).any().to(device=device, dtype=torch.float64)
                if partitioned or is_main:
                    stats[1] += tensor.detach().double().pow(2).sum().to(device)
    return stats
