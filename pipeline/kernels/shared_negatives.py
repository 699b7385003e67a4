"""BERT-NCE's registered kernel op, and its shared-negatives path ("every token of the other
sequences"), fused.

`sampled_softmax_cross_entropy` has the reference's signature (`pipeline.kernels.functional`):
per-row negatives [N, K] go to `linear_cross_entropy.sampled_softmax_cross_entropy` (the gathered
candidate kernel); the shared layout (negative_ids [U], negative_counts [G, U], anchor_groups [N])
is computed here:

    L = mean_n [ logsumexp( s_n(t_n), { s_n(u_k) + log c_{g_n k} : u_k != t_n } ) - s_n(t_n) ]

Targets and negatives are scored together over the distinct ids C = unique(targets ∪ negatives)
(|C| <= V; C = all V ids, with no `unique` and so no device sync, when the negatives list at least
half the vocabulary, as the objectives' static "all" layouts do): one [chunk, |C|] GEMM per chunk of rows, as the full-vocabulary cross-entropy of
`linear_cross_entropy` does over V, with a per-(row, column) offset added to the scores:

    offset[n, k] = 0                    where c_k = t_n   (the positive, counted once)
                 = log count_{g_n}(c_k) elsewhere       (-inf for ids absent from Neg_n)

The Triton row kernel of `linear_cross_entropy` (online log-sum-exp; -inf entries excluded) turns
the scores into per-row losses and overwrites them with dL/dZ; then dH = dZ @ W_C,
dW_C += dZ^T @ h, db_C += column sums, scattered into dW / db once at the end. Gradients are
computed in the forward pass (the loss is a scalar; backward scales them). Peak memory: the
[chunk, |C|] scores and offsets (two fp32 buffers of about CHUNK_BYTES each) and the [|C|, H]
gathered rows — never the [N, K+1, H] gather of the per-row layout, which at "every token of the
batch" (K ~ 10^5) would not fit.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pipeline.kernels import linear_cross_entropy as lce
from pipeline.kernels.linear_cross_entropy import chunk_rows_for, scaled_grads, softmax_xent_rows
from pipeline.kernels.functional import check_shared_negatives


def _shared_forward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    negative_ids: Tensor,
    negative_counts: Tensor,
    anchor_groups: Tensor,
    want: tuple[bool, bool, bool],
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Loss and fp32 gradients (dH, dW, db; None where not wanted), chunk by chunk."""
    rows, hid = hidden.shape
    device = hidden.device
    want_h, want_w, want_b = want
    if 2 * negative_ids.numel() >= weight.shape[0]:
        # the whole vocabulary as C (a superset of every id): no `unique`, whose data-dependent size
        # would make the host wait for the device; the objectives' "all" layouts pass all V ids
        columns = torch.arange(weight.shape[0], device=device)
    else:
        columns = torch.unique(torch.cat([negative_ids, targets]))  # sorted distinct ids C
    negative_cols = torch.searchsorted(columns, negative_ids)
    target_cols = torch.searchsorted(columns, targets)
    counts = torch.zeros(negative_counts.shape[0], columns.numel(), device=device, dtype=torch.float32)
    counts.index_add_(1, negative_cols, negative_counts.float())  # a repeated id adds its counts
    log_counts = torch.log(counts)  # log 0 = -inf: not a negative of that group
    w_c = weight[columns].float()  # [|C|, H]
    bias_c = None if bias is None else bias[columns].float().contiguous()

    inv_count = torch.full((1,), 1.0 / max(rows, 1), device=device)
    loss_rows = torch.empty(rows, device=device, dtype=torch.float32)
    d_hidden = torch.empty(rows, hid, device=device, dtype=torch.float32) if want_h else None
    d_wc = torch.zeros_like(w_c) if want_w else None
    d_bc = torch.zeros(columns.numel(), device=device, dtype=torch.float32) if want_b else None
    any_grad = want_h or want_w or want_b
    chunk = chunk_rows_for(2 * columns.numel(), rows)  # scores + offsets
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        h = hidden[start:stop].float()
        t_cols = target_cols[start:stop]
        z = h @ w_c.t()  # fp32 [chunk, |C|]
        offsets = log_counts[anchor_groups[start:stop]]
        offsets.scatter_(1, t_cols[:, None], 0.0)  # the positive, once; its copies among the negatives dropped
        z += offsets
        del offsets
        softmax_xent_rows(z, t_cols, loss_rows[start:stop], inv_count, z if any_grad else None, bias_c, -1)
        if want_h:
            d_hidden[start:stop] = z @ w_c
        if want_w:
            d_wc.addmm_(z.t(), h)
        if want_b:
            d_bc += z.sum(0)
        del z
    d_weight = d_bias = None
    every_id = columns.numel() == weight.shape[0]  # C = all V ids in order: the gradient needs no scatter
    if want_w:
        d_weight = d_wc if every_id else torch.zeros(weight.shape, device=device, dtype=torch.float32)
        if not every_id:
            d_weight[columns] = d_wc
    if want_b:
        d_bias = d_bc if every_id else torch.zeros(weight.shape[0], device=device, dtype=torch.float32)
        if not every_id:
            d_bias[columns] = d_bc
    return (loss_rows.sum() * inv_count).reshape(()), d_hidden, d_weight, d_bias


class _SharedNegativesXent(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, negative_ids, negative_counts, anchor_groups, grad_enabled):
        # needs_input_grad stays True under torch.no_grad(); grad_enabled (taken by the caller) does not.
        needs = [grad_enabled and n for n in ctx.needs_input_grad]
        want = (needs[0], needs[1], bias is not None and needs[2])
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            loss, dh, dw, db = _shared_forward(
                hidden, weight, bias, targets.contiguous(), negative_ids.contiguous(), negative_counts,
                anchor_groups.contiguous(), want,
            )
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(dh, dw, db)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads = scaled_grads(ctx.saved_tensors, grad_loss, ctx.dtypes)
        return grads[0], grads[1], grads[2], None, None, None, None, None


def sampled_softmax_cross_entropy(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, negative_ids: Tensor,
    negative_counts: Optional[Tensor] = None, anchor_groups: Optional[Tensor] = None,
) -> Tensor:
    """Fused `functional.sampled_softmax_cross_entropy` (BERT-NCE), either layout (module docstring)."""
    if negative_counts is None and negative_ids.dim() == 2:
        return lce.sampled_softmax_cross_entropy(hidden, weight, bias, targets, negative_ids)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] \
            or hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"sampled_softmax_cross_entropy: hidden [N, H], weight [V, H] and targets [N] expected, got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(targets.shape)}")
    check_shared_negatives(targets, negative_ids, negative_counts, anchor_groups)
    if targets.numel() == 0:  # nothing selected: a graph-connected zero, like the reference
        zero = hidden.float().sum() * 0.0 + weight.float()[:0].sum()
        return zero if bias is None else zero + bias.float()[:0].sum()
    return _SharedNegativesXent.apply(hidden, weight, bias, targets, negative_ids, negative_counts, anchor_groups,
                                      torch.is_grad_enabled())
