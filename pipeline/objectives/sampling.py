"""Index sampling shared by the objectives (one home for "pick K items from other sequences").

Everything takes an explicit `torch.Generator` (the per-micro-batch `ctx.generator`) and returns
plain index tensors, which the pure loss functions in `functional.py` then consume. Nothing here
builds a [N, M] matrix over all candidates: sampling "uniformly from the other sequences" is done
by drawing an offset into the candidates that lie outside the anchor's own (contiguous) block.
"""
from __future__ import annotations

import torch
from torch import Tensor


def sample_from_other_rows(
    candidate_rows: Tensor,
    anchor_rows: Tensor,
    num_rows: int,
    k: int,
    generator: torch.Generator,
) -> Tensor:
    """For each anchor, k indices into the candidate list, uniform over candidates of other rows.

    candidate_rows [M] int64: the row (sequence) of each candidate, sorted ascending (row-major
    flattening of a [B, L] mask gives exactly that). anchor_rows [N]. Returns [N, k] int64.

    Uniform over the M - c_r candidates outside row r: draw u in [0, M - c_r) and skip the block
    [o_r, o_r + c_r) of row r. An anchor whose row holds *every* candidate (a micro-batch with one
    usable sequence) has no other-row candidate; it then samples from all M candidates, so the
    loss stays defined — callers that care can check `candidate_rows.unique().numel() > 1`.
    """
    if candidate_rows.numel() == 0:
        raise ValueError("no candidate tokens to sample negatives from (every position is special or padding)")
    device = candidate_rows.device
    counts = torch.bincount(candidate_rows, minlength=num_rows)  # [B]
    offsets = torch.cumsum(counts, 0) - counts  # start of each row's block
    total = candidate_rows.numel()
    own = counts[anchor_rows]  # [N]
    outside = total - own
    no_other = outside == 0
    span = torch.where(no_other, torch.full_like(outside, total), outside)
    u = torch.rand((anchor_rows.numel(), k), generator=generator, device=device)
    draw = torch.minimum((u * span[:, None]).long(), span[:, None] - 1)  # fp rounding can reach span
    skip = (draw >= offsets[anchor_rows][:, None]) & ~no_other[:, None]
    return draw + skip.long() * own[:, None]


def sample_window_positives(
    eligible: Tensor,
    anchor_rows: Tensor,
    anchor_cols: Tensor,
    window: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """TACO positive: one position j_c with 0 < |j_c - j| <= window // 2 in the anchor's row,
    uniform over the *eligible* positions in that window (so it is clipped at the sequence ends
    and never lands on CLS/SEP/PAD).

    eligible [B, L] bool; anchor_rows, anchor_cols [N]. Returns (positive_cols [N], has_positive
    [N] bool); anchors without any eligible neighbour get has_positive False (and col = anchor).
    """
    half = window // 2
    if half < 1:
        raise ValueError(f"window must be >= 2 to contain a neighbour, got {window}")
    length = eligible.shape[1]
    offsets = torch.cat([torch.arange(-half, 0), torch.arange(1, half + 1)]).to(eligible.device)  # [2*half]
    cols = anchor_cols[:, None] + offsets[None, :]  # [N, 2*half]
    inside = (cols >= 0) & (cols < length)
    ok = inside & eligible[anchor_rows[:, None], cols.clamp(0, length - 1)]
    scores = torch.rand(cols.shape, generator=generator, device=eligible.device).masked_fill(~ok, -1.0)
    choice = scores.argmax(dim=1)
    has_positive = ok.any(dim=1)
    positive_cols = torch.where(has_positive, cols.gather(1, choice[:, None]).squeeze(1), anchor_cols)
    return positive_cols, has_positive


def sample_one_per_row(candidates: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Uniformly pick one True column per row of `candidates` [B, C] bool.

    Returns (column [B] int64, has_any [B] bool); rows without a candidate return column 0.
    """
    scores = torch.rand(candidates.shape, generator=generator, device=candidates.device)
    scores = scores.masked_fill(~candidates, -1.0)
    return scores.argmax(dim=1), candidates.any(dim=1)
