"""Index sampling shared by the objectives (one home for "pick K items from other sequences").

Everything takes an explicit `torch.Generator` (the per-micro-batch `ctx.generator`) and returns
plain index tensors, which the pure loss functions in `pipeline.kernels.functional` then consume.
Nothing here builds a [N, M] matrix over all candidates: sampling "uniformly from the other groups" is done by
drawing an offset into the candidates that lie outside the anchor's own (contiguous) block. A
group is a row (sequence) or a document of a packed row (`document_groups`): in row-major order
the candidates of either are contiguous.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def document_groups(eligible: Tensor, documents: Optional[Tensor]) -> Tensor:
    """[B, L] int64 group number of every eligible position (-1 elsewhere), numbered 0, 1, ... in
    row-major order: one group per row, or per (row, document) when `documents` [B, L] (the batch's
    `document_ids`) is given. Increasing along the row-major flattening, as `sample_from_other_groups`
    needs."""
    batch, length = eligible.shape
    rows = torch.arange(batch, device=eligible.device)[:, None].expand(batch, length)
    key = rows * (length + 1) + (0 if documents is None else documents.clamp(min=0))
    flat_key = key.reshape(-1)[eligible.reshape(-1)]
    groups = torch.full((batch * length,), -1, dtype=torch.long, device=eligible.device)
    if flat_key.numel():
        groups[eligible.reshape(-1)] = torch.unique_consecutive(flat_key, return_inverse=True)[1]
    return groups.reshape(batch, length)


def sample_from_other_groups(
    candidate_groups: Tensor,
    anchor_groups: Tensor,
    num_groups: int,
    k: int,
    generator: torch.Generator,
) -> Tensor:
    """For each anchor, k indices into the candidate list, uniform over candidates of other groups.

    candidate_groups [M] int64 in [0, num_groups): the group (row, or document) of each candidate,
    sorted ascending (row-major flattening of a [B, L] mask gives exactly that). anchor_groups [N].
    Returns [N, k] int64. The group sizes are counted by a scatter into `num_groups` slots (a static
    shape), not by `bincount`, whose output size is data-dependent (a device sync); see
    `sample_outside_blocks` for the draw.
    """
    if candidate_groups.numel() == 0:
        raise ValueError("no candidate tokens to sample negatives from (every position is special or padding)")
    counts = torch.zeros(num_groups, dtype=torch.long, device=candidate_groups.device)
    counts.scatter_add_(0, candidate_groups, torch.ones_like(candidate_groups))
    return sample_outside_blocks(counts, anchor_groups, candidate_groups.numel(), k, generator)


def sample_outside_blocks(counts: Tensor, anchor_groups: Tensor, total: int, k: int, generator: torch.Generator) -> Tensor:
    """k draws per anchor, uniform over the `total` candidates outside the anchor's group's block.

    counts [G] int64: the sizes of the contiguous, ascending group blocks of the candidate list
    (summing to `total`, a host number: the list's length); anchor_groups [N]. Returns [N, k] int64
    indices into the candidate list.

    Uniform over the M - c_g candidates outside group g: draw u in [0, M - c_g) and skip the block
    [o_g, o_g + c_g) of group g. An anchor whose group holds *every* candidate (a micro-batch with
    one usable sequence) has no other-group candidate; it then samples from all M candidates, so
    the loss stays defined. Static shapes only: nothing here reads device data on the host.
    """
    if total == 0:
        raise ValueError("no candidate tokens to sample negatives from (every position is special or padding)")
    device = counts.device
    offsets = torch.cumsum(counts, 0) - counts  # start of each group's block
    own = counts[anchor_groups]  # [N]
    outside = total - own
    no_other = outside == 0
    span = torch.where(no_other, torch.full_like(outside, total), outside)
    u = torch.rand((anchor_groups.numel(), k), generator=generator, device=device)
    draw = torch.minimum((u * span[:, None]).long(), span[:, None] - 1)  # fp rounding can reach span
    skip = (draw >= offsets[anchor_groups][:, None]) & ~no_other[:, None]
    return draw + skip.long() * own[:, None]


def sample_window_positives(
    eligible: Tensor,
    anchor_rows: Tensor,
    anchor_cols: Tensor,
    window: int,
    generator: torch.Generator,
    groups: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """TACO positive: one position j_c with 0 < |j_c - j| <= window // 2 in the anchor's row,
    uniform over the *eligible* positions in that window (so it is clipped at the sequence ends
    and never lands on CLS/SEP/PAD) — and, with `groups` [B, L] (`document_groups`), in the
    anchor's own group, so a positive never crosses a document boundary of a packed row.

    eligible [B, L] bool; anchor_rows, anchor_cols [N]. Returns (positive_cols [N], has_positive
    [N] bool); anchors without any eligible neighbour get has_positive False (and col = anchor).
    """
    half = window // 2
    if half < 1:
        raise ValueError(f"window must be >= 2 to contain a neighbour, got {window}")
    length = eligible.shape[1]
    device = eligible.device  # offsets made there: a host tensor copied over would be a blocking copy
    offsets = torch.cat([torch.arange(-half, 0, device=device), torch.arange(1, half + 1, device=device)])  # [2*half]
    cols = anchor_cols[:, None] + offsets[None, :]  # [N, 2*half]
    inside = (cols >= 0) & (cols < length)
    clamped = cols.clamp(0, length - 1)
    ok = inside & eligible[anchor_rows[:, None], clamped]
    if groups is not None:
        ok &= groups[anchor_rows[:, None], clamped] == groups[anchor_rows, anchor_cols][:, None]
    scores = torch.rand(cols.shape, generator=generator, device=eligible.device).masked_fill(~ok, -1.0)
    choice = scores.argmax(dim=1)
    has_positive = ok.any(dim=1)
    positive_cols = torch.where(has_positive, cols.gather(1, choice[:, None]).squeeze(1), anchor_cols)
    return positive_cols, has_positive


def sample_per_row(candidates: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """Uniformly pick min(k, count) True columns per row of `candidates` [B, C] bool, without
    replacement. Returns a [B, C] bool selection."""
    scores = torch.rand(candidates.shape, generator=generator, device=candidates.device)
    scores = scores.masked_fill(~candidates, -1.0)
    k = min(k, candidates.shape[1])
    if k == 0 or candidates.shape[0] == 0:
        return torch.zeros_like(candidates)
    top = scores.topk(k, dim=1).indices
    chosen = torch.zeros_like(candidates).scatter_(1, top, True)
    return chosen & candidates
