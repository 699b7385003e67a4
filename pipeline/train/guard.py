"""The non-finite guard: counts steps whose loss or gradients were not finite, and stops a run that
keeps producing them.

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

from typing import Protocol

import torch
from torch import nn


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss, or a non-finite update that was applied."""


class GuardCounters(Protocol):
    skipped_steps: int
    nonfinite_steps: int
    nonfinite_in_row: int


class NonFiniteGuard:
    def __init__(self, max_in_row: int, fp16: bool) -> None:
        self.max_in_row, self.fp16 = max_in_row, fp16

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


def count_nonfinite_weights(module: nn.Module, device: torch.device) -> torch.Tensor:
    """Number of this rank's parameter tensors holding a NaN/Inf, as a 1-element tensor on `device`
    (to be all-reduced). Under ZeRO-3 each rank checks its own partition (`ds_tensor`)."""
    count = torch.zeros(1, dtype=torch.float64, device=device)
    with torch.no_grad():
        for param in module.parameters():
            tensor = getattr(param, "ds_tensor", param)
            if tensor.numel():
                count += (~torch.isfinite(tensor)).any().to(device=device, dtype=torch.float64)
    return count
