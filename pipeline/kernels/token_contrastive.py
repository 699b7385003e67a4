"""TACO token-alignment InfoNCE without the gathered [N, K, H] negatives, and the shared
"InfoNCE over index-gathered candidates" kernel it is built on (also used by BERT-NCE).

Same signature and semantics as `pipeline.kernels.functional.token_contrastive_loss`:

    f(a, c) = cos(a, c) / tau,   L = mean_n [ logsumexp_k f(g_{x_n}, g_{c_nk}) - f(g_{x_n}, g_{c_n0}) ]

with c_n0 the positive and c_n1..K the negatives. The reference gathers and normalises
[N, K, H] fp32 candidate rows (about 13 GB at BERT-large / 64k tokens / K=50); here one Triton
program per anchor walks its candidate list in [BLOCK_K, H] tiles, loading each row straight from
g, and keeps only per-anchor scalars plus one H-vector:

    pass 1 (forward):  online log-sum-exp over the candidate scores, and - flash-attention style -
                       the softmax-weighted mean of the unit candidates E_p[c^] (rescaled whenever
                       the running max moves). dL/da^ = (E_p[c^] - c^_0) / (tau N), so the anchor
                       gradient is finished in the same pass and added into g's gradient.
    pass 2 (only when candidates get gradients: detach_candidates=False, or NCE's weight/bias):
                       re-gathers the candidates and scatters (p_k - 1[k=0]) / N * d s_k / d c_k.

Gradients are computed in the forward pass (the loss is a scalar; backward scales them). The
normalisation x / max(|x|, 1e-8) is differentiated exactly as `F.normalize` is. Scores, norms and
log-sum-exps are fp32 whatever the dtype of g.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

#: `F.normalize(..., eps=1e-8)` as in the reference.
NORM_EPS = 1e-8
#: Elements of one [BLOCK_K, BLOCK_H] candidate tile (bounds registers per program).
MAX_TILE = 8192


@triton.jit
def _unit_scale(sq_norm, eps, NORMALIZE: tl.constexpr):
    """1 / max(|x|, eps) when normalising, else 1."""
    if NORMALIZE:
        return 1.0 / tl.maximum(tl.sqrt(sq_norm), eps)
    else:
        return sq_norm * 0.0 + 1.0


@triton.jit
def _gathered_forward_kernel(
    x_ptr, stride_x, anchor_idx_ptr,  # anchors: rows anchor_idx[n] of x (or row n)
    y_ptr, stride_y, cand_ptr, stride_cand,  # candidates: rows cand[n, k] of y, column 0 = positive
    bias_ptr,  # per-candidate-row bias (HAS_BIAS)
    loss_ptr, lse_ptr,  # [N] fp32 outputs
    dx_ptr, stride_dx,  # fp32 gradient accumulator of x (ANCHOR_GRAD)
    H, K1, scale, eps, inv_count,
    HAS_ANCHOR_IDX: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
    MASK_DUPLICATES: tl.constexpr, ANCHOR_GRAD: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    in_h = offs_h < H
    if HAS_ANCHOR_IDX:
        a_row = tl.load(anchor_idx_ptr + n)
    else:
        a_row = n
    a = tl.load(x_ptr + a_row * stride_x + offs_h, mask=in_h, other=0.0).to(tl.float32)
    a_sq = tl.sum(a * a, axis=0)
    ia = _unit_scale(a_sq, eps, NORMALIZE)
    a_hat = a * ia

    cand_row = cand_ptr + n * stride_cand
    pos_idx = tl.load(cand_row)
    c0 = tl.load(y_ptr + pos_idx * stride_y + offs_h, mask=in_h, other=0.0).to(tl.float32)
    c0_hat = c0 * _unit_scale(tl.sum(c0 * c0, axis=0), eps, NORMALIZE)
    cos0 = tl.sum(c0_hat * a_hat, axis=0)
    s0 = cos0 * scale
    if HAS_BIAS:
        s0 += tl.load(bias_ptr + pos_idx).to(tl.float32)

    m = s0  # running max (the positive is always a valid candidate)
    l_sum = s0 * 0.0
    acc = tl.zeros((BLOCK_H,), tl.float32)  # sum_k exp(s_k - m) c^_k
    acc_cos = s0 * 0.0  # sum_k exp(s_k - m) cos_k
    for k0 in range(0, K1, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K1
        idx = tl.load(cand_row + offs_k, mask=in_k, other=0)
        c = tl.load(y_ptr + idx[:, None] * stride_y + offs_h[None, :], mask=in_k[:, None] & in_h[None, :], other=0.0)
        c = c.to(tl.float32)
        ic = _unit_scale(tl.sum(c * c, axis=1), eps, NORMALIZE)
        cos = tl.sum(c * a_hat[None, :], axis=1) * ic
        s = cos * scale
        if HAS_BIAS:
            s += tl.load(bias_ptr + idx, mask=in_k, other=0.0).to(tl.float32)
        keep = in_k
        if MASK_DUPLICATES:  # a negative equal to the positive is the positive itself
            keep = keep & ((offs_k == 0) | (idx != pos_idx))
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        if ANCHOR_GRAD:
            acc = acc * alpha + tl.sum((p * ic)[:, None] * c, axis=0)
            acc_cos = acc_cos * alpha + tl.sum(p * cos, axis=0)
        m = m_new
    lse = m + tl.log(l_sum)
    tl.store(loss_ptr + n, lse - s0)
    tl.store(lse_ptr + n, lse)

    if ANCHOR_GRAD:
        coef = scale * inv_count
        g_hat = coef * (acc / l_sum - c0_hat)  # dL/da^
        if NORMALIZE:
            # d(x / max(|x|, eps)): project out the radial part unless |x| <= eps.
            proj = coef * (acc_cos / l_sum - cos0)  # = g_hat . a^
            proj = tl.where(tl.sqrt(a_sq) > eps, proj, 0.0)
            g = ia * (g_hat - proj * a_hat)
        else:
            g = g_hat
        tl.atomic_add(dx_ptr + a_row * stride_dx + offs_h, g, mask=in_h)


@triton.jit
def _gathered_candidate_grad_kernel(
    x_ptr, stride_x, anchor_idx_ptr,
    y_ptr, stride_y, cand_ptr, stride_cand,
    bias_ptr, lse_ptr,
    dy_ptr, stride_dy, dbias_ptr,  # fp32 accumulators (CAND_GRAD / BIAS_GRAD)
    H, K1, scale, eps, inv_count,
    HAS_ANCHOR_IDX: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
    MASK_DUPLICATES: tl.constexpr, CAND_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    in_h = offs_h < H
    if HAS_ANCHOR_IDX:
        a_row = tl.load(anchor_idx_ptr + n)
    else:
        a_row = n
    a = tl.load(x_ptr + a_row * stride_x + offs_h, mask=in_h, other=0.0).to(tl.float32)
    a_hat = a * _unit_scale(tl.sum(a * a, axis=0), eps, NORMALIZE)
    lse = tl.load(lse_ptr + n)
    cand_row = cand_ptr + n * stride_cand
    pos_idx = tl.load(cand_row)
    for k0 in range(0, K1, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K1
        idx = tl.load(cand_row + offs_k, mask=in_k, other=0)
        tile_mask = in_k[:, None] & in_h[None, :]
        c = tl.load(y_ptr + idx[:, None] * stride_y + offs_h[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        c_sq = tl.sum(c * c, axis=1)
        ic = _unit_scale(c_sq, eps, NORMALIZE)
        cos = tl.sum(c * a_hat[None, :], axis=1) * ic
        s = cos * scale
        if HAS_BIAS:
            s += tl.load(bias_ptr + idx, mask=in_k, other=0.0).to(tl.float32)
        keep = in_k
        if MASK_DUPLICATES:
            keep = keep & ((offs_k == 0) | (idx != pos_idx))
        w = tl.exp(s - lse) - tl.where(offs_k == 0, 1.0, 0.0)
        w = tl.where(keep, w * inv_count, 0.0)  # dL/ds_k
        if CAND_GRAD:
            # d s_k / d c_k = scale * ic_k * (a^ - cos_k c^_k)   (no projection if |c_k| <= eps)
            radial = cos * ic
            if NORMALIZE:
                radial = tl.where(tl.sqrt(c_sq) > eps, radial, 0.0)
            else:
                radial = radial * 0.0
            dc = (w * scale * ic)[:, None] * (a_hat[None, :] - radial[:, None] * c)
            tl.atomic_add(dy_ptr + idx[:, None] * stride_dy + offs_h[None, :], dc, mask=tile_mask & keep[:, None])
        if BIAS_GRAD:
            tl.atomic_add(dbias_ptr + idx, w, mask=keep)


def _blocks(hidden: int, k1: int) -> tuple[int, int, int]:
    block_h = triton.next_power_of_2(hidden)
    block_k = max(1, min(triton.next_power_of_2(k1), MAX_TILE // block_h))
    return block_k, block_h, 4 if block_k * block_h <= 4096 else 8


class _GatheredInfoNCE(torch.autograd.Function):
    """mean_n [logsumexp_k s_nk - s_n0] with s_nk = scale * <x^_{a_n}, y^_{c_nk}> + bias_{c_nk}."""

    @staticmethod
    def forward(ctx, x, y, bias, anchor_idx, candidates, scale, normalize, mask_duplicates, candidate_grad, grad_enabled):
        shared = x is y
        # needs_input_grad stays True under torch.no_grad(); grad_enabled (taken by the caller) does not.
        needs = [grad_enabled and n for n in ctx.needs_input_grad]
        want_x = needs[0] or (shared and needs[1])
        want_y = candidate_grad and (needs[0] if shared else needs[1])
        want_b = candidate_grad and bias is not None and needs[2]
        x_c, y_c = x.contiguous(), y.contiguous()
        cand = candidates.contiguous()
        rows, k1 = cand.shape
        hid = x.shape[1]
        device = x.device
        inv_count = 1.0 / max(rows, 1)
        loss_rows = torch.empty(rows, device=device, dtype=torch.float32)
        lse = torch.empty(rows, device=device, dtype=torch.float32)
        dx = torch.zeros(x.shape, device=device, dtype=torch.float32) if want_x or (shared and want_y) else None
        dy = dx if shared else (torch.zeros(y.shape, device=device, dtype=torch.float32) if want_y else None)
        db = torch.zeros(bias.shape, device=device, dtype=torch.float32) if want_b else None
        block_k, block_h, warps = _blocks(hid, k1)
        common = dict(
            HAS_ANCHOR_IDX=anchor_idx is not None, HAS_BIAS=bias is not None, NORMALIZE=normalize,
            MASK_DUPLICATES=mask_duplicates, BLOCK_K=block_k, BLOCK_H=block_h, num_warps=warps,
        )
        a_idx = anchor_idx.contiguous() if anchor_idx is not None else cand
        b_arg = bias.contiguous() if bias is not None else x_c
        if rows > 0:
            _gathered_forward_kernel[(rows,)](
                x_c, x_c.stride(0), a_idx, y_c, y_c.stride(0), cand, cand.stride(0), b_arg,
                loss_rows, lse, dx if want_x else loss_rows, hid if dx is None else dx.stride(0),
                hid, k1, scale, NORM_EPS, inv_count, ANCHOR_GRAD=want_x, **common,
            )
            if want_y or want_b:
                _gathered_candidate_grad_kernel[(rows,)](
                    x_c, x_c.stride(0), a_idx, y_c, y_c.stride(0), cand, cand.stride(0), b_arg, lse,
                    dy if want_y else loss_rows, hid if dy is None else dy.stride(0), db if want_b else loss_rows,
                    hid, k1, scale, NORM_EPS, inv_count, CAND_GRAD=want_y, BIAS_GRAD=want_b, **common,
                )
        ctx.shared = shared
        ctx.dtypes = (x.dtype, y.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(dx, None if shared else dy, db)  # shared: dx already holds both parts
        return (loss_rows.sum() * inv_count).reshape(())

    @staticmethod
    def backward(ctx, grad_loss):
        dx, dy, db = ctx.saved_tensors
        out = [None if g is None else (g * grad_loss).to(dt) for g, dt in zip((dx, dy, db), ctx.dtypes)]
        return out[0], out[1], out[2], None, None, None, None, None, None, None


def gathered_infonce(
    x: Tensor,
    anchor_idx: Optional[Tensor],
    y: Tensor,
    candidates: Tensor,
    bias: Optional[Tensor],
    scale: float,
    normalize: bool,
    mask_duplicates: bool,
    candidate_grad: bool,
) -> Tensor:
    """InfoNCE over index-gathered candidates, never materialising the gathered rows.

    Anchor n is row `anchor_idx[n]` of x (row n when anchor_idx is None); its candidates are rows
    `candidates[n, :]` of y, column 0 the positive. Score = scale * <x^, y^> + bias[candidate]
    (x^ = unit vector when `normalize`, else x). `mask_duplicates` drops candidates k > 0 equal
    to the positive. Gradients reach y and bias only when `candidate_grad`. Pass the same tensor as
    x and y when anchors and candidates are rows of one matrix (TACO's g).
    """
    if candidates.dim() != 2 or (anchor_idx is not None and anchor_idx.shape[0] != candidates.shape[0]):
        raise ValueError(f"candidates must be [N, K+1] with N = len(anchor_idx), got {tuple(candidates.shape)}")
    if anchor_idx is None and x.shape[0] != candidates.shape[0]:
        raise ValueError(f"without anchor_idx, x needs one row per anchor: {x.shape[0]} != {candidates.shape[0]}")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"anchor rows have {x.shape[1]} features, candidate rows {y.shape[1]}")
    return _GatheredInfoNCE.apply(
        x, y, bias, anchor_idx, candidates, float(scale), normalize, mask_duplicates, candidate_grad,
        torch.is_grad_enabled(),
    )


def token_contrastive_loss(
    g: Tensor,
    anchor_idx: Tensor,
    positive_idx: Tensor,
    negative_idx: Tensor,
    tau: float,
    detach_candidates: bool = True,
) -> Tensor:
    """Fused `functional.token_contrastive_loss` (TACO, Fu et al. 2022, Eq. 6-8): cosine / tau
    InfoNCE of g[anchor_idx[n]] against g[positive_idx[n]] and g[negative_idx[n, :]]; with
    detach_candidates the gradient reaches g through the anchor rows only."""
    if g.dim() != 2:
        raise ValueError(f"token_contrastive_loss: g must be [T, H], got {tuple(g.shape)}")
    if positive_idx.shape[0] != anchor_idx.shape[0] or negative_idx.shape[0] != anchor_idx.shape[0]:
        raise ValueError(
            "token_contrastive_loss: anchor_idx, positive_idx and negative_idx need the same number of rows, got "
            f"{anchor_idx.shape[0]}, {positive_idx.shape[0]}, {negative_idx.shape[0]}"
        )
    candidates = torch.cat([positive_idx[:, None], negative_idx], dim=1)
    return gathered_infonce(
        g, anchor_idx, g, candidates, None, scale=1.0 / tau, normalize=True, mask_duplicates=False,
        candidate_grad=not detach_candidates,
    )
