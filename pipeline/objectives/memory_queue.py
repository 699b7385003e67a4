"""`MemoryQueue`: CAPT's FIFO queue of past sequence representations (Luo et al. 2021, Sec. 2.2).

Each training step enqueues the detached aggregated representations of the current batch (both
views); once the capacity is reached the oldest rows are overwritten. The rows are extra
negatives in every denominator of the contrastive loss (no momentum encoder, so entries are
"updated along with the training process" simply by being replaced).

Distributed: `enqueue` all-gathers the rows of every rank (in rank order) when
`torch.distributed` is initialised with world size > 1, so every rank holds identical content —
the queue spans the *global* batch and any rank's state is the checkpoint.

Storage is a plain float32 tensor, deliberately not a module buffer: a buffer would be cast to
bf16 by `engine.bfloat16()` and would leak into the Hugging Face state dict. It follows the
device of the rows it is given. State for exact resume: `state_dict()` / `load_state_dict()`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pipeline.distributed import all_gather_rows


class MemoryQueue:
    """Fixed-capacity FIFO of [capacity, dim] float32 rows."""

    def __init__(self, capacity: int, dim: int) -> None:
        if capacity < 1 or dim < 1:
            raise ValueError(f"MemoryQueue: capacity and dim must be positive, got {capacity}, {dim}")
        self.capacity, self.dim = capacity, dim
        self.buffer = torch.zeros(capacity, dim, dtype=torch.float32)
        self.ptr = 0  # next row to write
        self.size = 0  # rows filled so far (<= capacity)

    def __len__(self) -> int:
        return self.size

    def _to(self, device: torch.device) -> None:
        if self.buffer.device != device:
            self.buffer = self.buffer.to(device)

    @torch.no_grad()
    def enqueue(self, rows: Tensor, gather: bool = True) -> None:
        """Append `rows` [n, dim] (detached, float32) of this rank — and, with `gather`, of every
        rank in rank order. If more than `capacity` rows arrive at once only the newest are kept."""
        if rows.dim() != 2 or rows.shape[1] != self.dim:
            raise ValueError(f"MemoryQueue.enqueue: expected rows of shape [n, {self.dim}], got {tuple(rows.shape)}")
        rows = rows.detach().float()
        if gather:
            rows = all_gather_rows(rows)
        self._to(rows.device)
        if rows.shape[0] > self.capacity:
            skipped = rows.shape[0] - self.capacity
            self.ptr = (self.ptr + skipped) % self.capacity  # as if the skipped rows had been written
            self.size = self.capacity
            rows = rows[skipped:]
        n = rows.shape[0]
        idx = (self.ptr + torch.arange(n, device=rows.device)) % self.capacity
        self.buffer[idx] = rows
        self.ptr = (self.ptr + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def negatives(self, device: Optional[torch.device] = None) -> Optional[Tensor]:
        """The filled rows (any order; None when empty), as a constant for the loss."""
        if self.size == 0:
            return None
        if device is not None:
            self._to(device)
        return self.buffer[: self.size] if self.size < self.capacity else self.buffer

    def ordered(self) -> Tensor:
        """The filled rows from oldest to newest (for inspection and tests)."""
        if self.size < self.capacity:
            return self.buffer[: self.size].clone()
        return torch.roll(self.buffer, shifts=-self.ptr, dims=0).clone()

    def state_dict(self) -> dict:
        return {"capacity": self.capacity, "dim": self.dim, "ptr": self.ptr, "size": self.size, "buffer": self.buffer.cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        if (state["capacity"], state["dim"]) != (self.capacity, self.dim):
            raise ValueError(
                f"MemoryQueue checkpoint has capacity/dim {(state['capacity'], state['dim'])}, "
                f"this run is configured with {(self.capacity, self.dim)} (CAPT's queue_size option)"
            )
        device = self.buffer.device
        self.buffer = state["buffer"].to(device=device, dtype=torch.float32).clone()
        self.ptr, self.size = int(state["ptr"]), int(state["size"])
