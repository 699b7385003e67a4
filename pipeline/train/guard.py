"""The non-finite guard: counts steps whose loss or gradients were not finite, and stops a run that
keeps producing them.

A step is *bad* when any rank's loss was NaN/Inf, or when DeepSpeed dropped the update (its
gradients were not finite) outside fp16, where a dropped update is routine loss-scale overflow.
DeepSpeed skips bad updates itself; the guard checks that it did (an applied update with a
non-finite loss means this DeepSpeed version does not skip them), keeps the counters in the
checkpointed `TrainState`, and raises `NonFiniteLossError` after `max_in_row` bad steps in a row.
"""
from __future__ import annotations

from typing import Protocol


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
