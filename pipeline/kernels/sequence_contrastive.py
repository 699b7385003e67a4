"""Two-view sequence InfoNCE with a memory queue (CAPT, COCO-LM SCL, InfoWord DIM) in Triton.

Same signature and semantics as `pipeline.kernels.functional.sequence_contrastive_loss`.
Rows X = [a; b] (2B); anchors are the first R rows (R = 2B when symmetric, else B); the
candidates of anchor r are all 2B batch rows (itself excluded, its own view excluded when
same_view_negatives is off, the other pairs of its group excluded when `groups` is given) and
every queue row; its positive is its partner (r + B) mod 2B. `reduction` "sum" scales the row
gradients by 1 instead of 1 / R.

    1. norms of X and the queue rows (fp32), one row-wise kernel;
    2. scores S[r, c] = <x_r, y_c> / (|x_r| |y_c| tau) for the batch columns and the queue
       columns, tiled tl.dot over (rows, columns, features) on the raw inputs (bf16 products are
       exact in the fp32 accumulator, so nothing is rounded before the scores) - excluded pairs
       are written as -inf;
    3. the row kernel of `linear_cross_entropy` walks each row with an online log-sum-exp and
       overwrites S with dL/dS = (softmax - onehot(partner)) / R;
    4. dL/dx^_r = sum_c dS[r, c] y^_c / tau (anchor side) and dL/dy^_c = sum_r dS[r, c] x^_r / tau
       (batch rows as candidates) as tiled, split-K matmuls accumulated into one fp32 [2B, D]
       buffer; queue rows get nothing;
    5. the normalisation backward x / max(|x|, eps) per row gives da, db.

The [R, 2B + Q] fp32 score buffer is the only quadratic intermediate (8.6 MB at B = 128,
Q = 8192), written once and reused for its own gradient; the reference holds several such
matrices plus normalised fp32 copies of the queue. Gradients are computed in the forward pass
(the loss is a scalar; backward scales them).

One compiled variant per (dtype, flags), whatever B and Q are. Triton specialises a kernel on
every integer argument that is 1 or divisible by 16 and on every pointer's 16-byte alignment, and
compiles it again (a second or more of host time on the GPU) for each new combination. InfoWord's
DIM has a B (its n-gram pairs) and, with global negatives, a Q that change every micro-batch, so
(i) the score buffer's batch block and its total width are padded to multiples of `COLUMN_ALIGN`
with -inf (excluded pairs: they add nothing to the softmax, get a zero gradient and are never read
by the gradient matmuls), which keeps the row stride, the row kernel's V and the queue block's
pointer in one class, and (ii) the sizes that remain (rows, columns, pairs, the queue block's
offset, the matmuls' M and K) are `do_not_specialize`d: they only bound masks, so nothing is lost
that a fixed B (CAPT, COCO-LM) used. `tests/kernels/test_specialisation.py` checks the classes.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from pipeline.kernels.linear_cross_entropy import softmax_xent_rows
from pipeline.kernels.token_contrastive import NORM_EPS
from pipeline.kernels.functional import REDUCTIONS

_LOW_PRECISION = (torch.bfloat16, torch.float16)
#: (BLOCK_M, BLOCK_N, BLOCK_D, num_warps) of the score tiles and (BLOCK_M, BLOCK_K, BLOCK_D, num_warps)
#: of the gradient matmuls. Chosen from ptxas reports for sm_90 (no register spills) - not tuned by
#: timing, which needs a GPU. Score tiles: 8 warps share the 64 x 64 tile, so a thread holds half
#: the accumulator: bf16 76-80 registers (114 with groups; Triton 3.6, the GPU image's; 76-80 and
#: 111-115 with 3.9) instead of 168 with 4 warps, i.e. 24 resident warps per SM instead of 12 for
#: the same tiles (65,536 registers / SM). fp32 inputs (3-pass tf32x3 dots) stay at 163-168 (3.6;
#: 154 with 3.9): fp32 contrastive runs are the reference precision, not the fast path. No variant
#: spills. Measured 2026-11-25 by `tests/kernels/test_compile_sm90.py` (both Tritons; CI fetches
#: 3.6 with `scripts/fetch_gpu_image_triton.sh`); every variant's count: docs/kernels.md.
SCORE_BLOCKS = (64, 64, 32, 8)
MATMUL_BLOCKS = (64, 32, 64, 4)
#: The score buffer's column blocks (batch, then queue) start and end on multiples of this (Triton's
#: divisibility specialisation: 16 elements), whatever the batch and queue sizes are.
COLUMN_ALIGN = 16


@triton.jit
def _row_norms_kernel(x_ptr, stride_x, out_ptr, D, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        v = tl.load(x_ptr + row * stride_x + offs, mask=offs < D, other=0.0).to(tl.float32)
        acc += v * v
    tl.store(out_ptr + row, tl.sqrt(tl.sum(acc, axis=0)))


@triton.jit
def _inv_norm(norm, eps, NORMALIZE: tl.constexpr):
    if NORMALIZE:
        return 1.0 / tl.maximum(norm, eps)
    else:
        return norm * 0.0 + 1.0


@triton.jit(do_not_specialize=["col_offset", "R", "NC", "B"])
def _scores_kernel(
    x_ptr, stride_x, x_norm_ptr,  # anchor rows [R, D] and their norms
    y_ptr, stride_y, y_norm_ptr,  # candidate rows [NC, D] and their norms
    s_ptr, stride_s, col_offset,  # scores [R, *] fp32; this launch fills columns col_offset + [0, NC)
    groups_ptr,  # [B] int64 group of each pair (HAS_GROUPS)
    R, NC, D, B, inv_tau, eps,
    BATCH_COLS: tl.constexpr, SAME_VIEW: tl.constexpr, NORMALIZE: tl.constexpr, HAS_GROUPS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = offs_m < R, offs_n < NC
    offs_d = tl.arange(0, BLOCK_D)
    x_tile = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_d[None, :]
    y_tile = y_ptr + offs_n[None, :].to(tl.int64) * stride_y + offs_d[:, None]  # [BLOCK_D, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        xa = tl.load(x_tile, mask=in_m[:, None] & (offs_d[None, :] < D - d0), other=0.0)
        yb = tl.load(y_tile, mask=in_n[None, :] & (offs_d[:, None] < D - d0), other=0.0)
        acc = tl.dot(xa, yb, acc, input_precision=PRECISION)
        x_tile += BLOCK_D
        y_tile += BLOCK_D
    ix = _inv_norm(tl.load(x_norm_ptr + offs_m, mask=in_m, other=1.0), eps, NORMALIZE)
    iy = _inv_norm(tl.load(y_norm_ptr + offs_n, mask=in_n, other=1.0), eps, NORMALIZE)
    s = acc * (ix * inv_tau)[:, None] * iy[None, :]
    if BATCH_COLS:
        excluded = offs_m[:, None] == offs_n[None, :]
        if not SAME_VIEW:
            excluded = excluded | ((offs_m // B)[:, None] == (offs_n // B)[None, :])
        if HAS_GROUPS:  # two pairs of one group are neither positives nor negatives of each other
            pair_m, pair_n = offs_m % B, offs_n % B
            g_m = tl.load(groups_ptr + pair_m, mask=in_m, other=-1)
            g_n = tl.load(groups_ptr + pair_n, mask=in_n, other=-2)
            excluded = excluded | ((g_m[:, None] == g_n[None, :]) & (pair_m[:, None] != pair_n[None, :]))
        s = tl.where(excluded, float("-inf"), s)
    out = s_ptr + offs_m[:, None].to(tl.int64) * stride_s + col_offset + offs_n[None, :]
    tl.store(out, s, mask=in_m[:, None] & in_n[None, :])


@triton.jit(do_not_specialize=["M", "K"])
def _scaled_matmul_kernel(
    a_ptr, stride_am, stride_ak,  # A [M, K] fp32 (any strides)
    k_norm_ptr,  # [K] norms: A[:, k] is scaled by inv_tau / max(norm_k, eps) (or inv_tau)
    b_ptr, stride_bk,  # B [K, D] (row stride, unit column stride)
    out_ptr, stride_om,  # out [M, D] fp32, accumulated atomically (split over K)
    M, K, D, k_per_split, inv_tau, eps,
    NORMALIZE: tl.constexpr, SPLIT_HI_LO: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out += (A * scale_k) @ B. With bf16/fp16 B, fp32 A is split into hi + lo halves of B's dtype
    so two tensor-core products keep ~16 mantissa bits of A."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_m, in_d = offs_m < M, offs_d < D
    k_start = tl.program_id(2) * k_per_split
    k_stop = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_stop
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :].to(tl.int64) * stride_ak,
                    mask=in_m[:, None] & in_k[None, :], other=0.0)
        scale_k = _inv_norm(tl.load(k_norm_ptr + offs_k, mask=in_k, other=1.0), eps, NORMALIZE) * inv_tau
        a = a * scale_k[None, :]
        b = tl.load(b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + offs_d[None, :], mask=in_k[:, None] & in_d[None, :], other=0.0)
        if SPLIT_HI_LO:
            a_hi = a.to(b.dtype)
            a_lo = (a - a_hi.to(tl.float32)).to(b.dtype)
            acc = tl.dot(a_hi, b, acc)
            acc = tl.dot(a_lo, b, acc)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    tl.atomic_add(out, acc, mask=in_m[:, None] & in_d[None, :])


@triton.jit
def _normalize_backward_kernel(x_ptr, stride_x, norm_ptr, g_ptr, stride_g, D, eps,
                               NORMALIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """In place: g <- d(x / max(|x|, eps))^T g = (g - (g . x^) x^) / |x|  (no projection if |x| <= eps)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    in_d = offs < D
    g = tl.load(g_ptr + row * stride_g + offs, mask=in_d, other=0.0)
    if NORMALIZE:
        norm = tl.load(norm_ptr + row)
        inv = 1.0 / tl.maximum(norm, eps)
        x_hat = tl.load(x_ptr + row * stride_x + offs, mask=in_d, other=0.0).to(tl.float32) * inv
        radial = tl.where(norm > eps, tl.sum(g * x_hat, axis=0), 0.0)
        g = inv * (g - radial * x_hat)
        tl.store(g_ptr + row * stride_g + offs, g, mask=in_d)


def _row_norms(x: Tensor) -> Tensor:
    out = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
    if x.shape[0]:
        _row_norms_kernel[(x.shape[0],)](x, x.stride(0), out, x.shape[1], BLOCK_D=min(1024, triton.next_power_of_2(x.shape[1])))
    return out


def _precision(dtype: torch.dtype, device: torch.device) -> str:
    """tl.dot precision for fp32 operands: three TF32 products (~fp32 accuracy on tensor cores) on
    GPU, plain fp32 in the interpreter; bf16/fp16 operands always accumulate in fp32."""
    if dtype in _LOW_PRECISION:
        return "tf32"
    return "tf32x3" if device.type == "cuda" else "ieee"


def _split_k(k: int, programs_mn: int, block_k: int) -> tuple[int, int]:
    """(k_per_split, splits): enough programs to fill a GPU (about 2 per SM of a 132-SM H100)."""
    splits = max(1, min(triton.cdiv(k, block_k), triton.cdiv(264, max(programs_mn, 1))))
    per = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    return per, triton.cdiv(k, per)


def _accumulate(out: Tensor, a: Tensor, stride_am: int, stride_ak: int, m: int, k: int,
                k_norms: Tensor, b: Tensor, inv_tau: float, normalize: bool) -> None:
    """out[:m] += (A * inv_tau / max(k_norms, eps)) @ b[:k] with A = a viewed through the strides."""
    if m == 0 or k == 0:
        return
    d = out.shape[1]
    block_m, block_k, block_d, warps = MATMUL_BLOCKS
    grid_mn = triton.cdiv(m, block_m) * triton.cdiv(d, block_d)
    per, splits = _split_k(k, grid_mn, block_k)
    _scaled_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(d, block_d), splits)](
        a, stride_am, stride_ak, k_norms, b, b.stride(0), out, out.stride(0),
        m, k, d, per, inv_tau, NORM_EPS,
        NORMALIZE=normalize, SPLIT_HI_LO=b.dtype in _LOW_PRECISION, PRECISION=_precision(b.dtype, b.device),
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_D=block_d, num_warps=warps,
    )


def _fill_scores(scores: Tensor, x: Tensor, x_norms: Tensor, rows: int, y: Tensor, y_norms: Tensor,
                 col_offset: int, batch: int, inv_tau: float, batch_cols: bool, same_view: bool, normalize: bool,
                 groups: Optional[Tensor] = None) -> None:
    if y.shape[0] == 0 or rows == 0:
        return
    block_m, block_n, block_d, warps = SCORE_BLOCKS
    _scores_kernel[(triton.cdiv(rows, block_m), triton.cdiv(y.shape[0], block_n))](
        x, x.stride(0), x_norms, y, y.stride(0), y_norms, scores, scores.stride(0), col_offset,
        x_norms if groups is None else groups,
        rows, y.shape[0], x.shape[1], batch, inv_tau, NORM_EPS,
        BATCH_COLS=batch_cols, SAME_VIEW=same_view, NORMALIZE=normalize, HAS_GROUPS=groups is not None,
        PRECISION=_precision(x.dtype, x.device),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps, num_stages=3,
    )


def _aligned(n: int) -> int:
    """n rounded up to a multiple of `COLUMN_ALIGN`."""
    return -(-n // COLUMN_ALIGN) * COLUMN_ALIGN


def _forward_and_grads(a: Tensor, b: Tensor, tau: float, queue: Optional[Tensor], normalize: bool,
                       symmetric: bool, same_view: bool, want_grad: bool, groups: Optional[Tensor] = None,
                       reduction: str = "mean") -> tuple[Tensor, Optional[Tensor]]:
    """Loss and the fp32 gradient with respect to X = [a; b] (None unless want_grad)."""
    batch, dim = a.shape
    dtype = torch.promote_types(a.dtype, b.dtype)
    if queue is not None:
        dtype = torch.promote_types(dtype, queue.dtype)  # a bf16 batch against CAPT's fp32 queue: fp32
    x = torch.cat([a, b]).to(dtype).contiguous()
    q = None if queue is None else queue.detach().to(dtype).contiguous()
    rows = 2 * batch if symmetric else batch
    queue_start = _aligned(2 * batch)  # the batch block, padded (see the module docstring)
    cols = _aligned(queue_start + (0 if q is None else q.shape[0]))
    inv_tau = 1.0 / tau
    x_norms = _row_norms(x)
    q_norms = None if q is None else _row_norms(q)

    scores = torch.empty(rows, cols, device=a.device, dtype=torch.float32)
    scores[:, 2 * batch:queue_start].fill_(float("-inf"))  # padding columns: excluded, like a pair with itself
    scores[:, queue_start + (0 if q is None else q.shape[0]):].fill_(float("-inf"))
    _fill_scores(scores, x, x_norms, rows, x, x_norms, 0, batch, inv_tau, True, same_view, normalize, groups)
    if q is not None:
        _fill_scores(scores, x, x_norms, rows, q, q_norms, queue_start, batch, inv_tau, False, same_view, normalize)
    partners = (torch.arange(rows, device=a.device) + batch) % (2 * batch)
    scale = 1.0 if reduction == "sum" else 1.0 / rows
    inv_count = torch.full((1,), scale, device=a.device)
    loss_rows = torch.empty(rows, device=a.device, dtype=torch.float32)
    softmax_xent_rows(scores, partners, loss_rows, inv_count, grad=scores if want_grad else None)
    loss = (loss_rows.sum() * scale).reshape(())
    if not want_grad:
        return loss, None

    d_x = torch.zeros(2 * batch, dim, device=a.device, dtype=torch.float32)
    stride_s = scores.stride(0)
    # anchors: dL/dx^_r += sum_c dS[r, c] y^_c / tau, batch columns then queue columns
    _accumulate(d_x, scores, stride_s, 1, rows, 2 * batch, x_norms, x, inv_tau, normalize)
    if q is not None:
        _accumulate(d_x, scores[:, queue_start:], stride_s, 1, rows, q.shape[0], q_norms, q, inv_tau, normalize)
    # batch rows as candidates: dL/dy^_c += sum_r dS[r, c] x^_r / tau  (A = dS[:, :2B]^T)
    _accumulate(d_x, scores, 1, stride_s, 2 * batch, rows, x_norms, x, inv_tau, normalize)
    if normalize:
        _normalize_backward_kernel[(2 * batch,)](
            x, x.stride(0), x_norms, d_x, d_x.stride(0), dim, NORM_EPS,
            NORMALIZE=True, BLOCK_D=triton.next_power_of_2(dim), num_warps=4,
        )
    return loss, d_x


class _SequenceInfoNCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, tau, queue, normalize, symmetric, same_view_negatives, grad_enabled, groups, reduction):
        # needs_input_grad stays True under torch.no_grad(); grad_enabled (taken by the caller) does not.
        want = grad_enabled and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        loss, d_x = _forward_and_grads(a, b, tau, queue, normalize, symmetric, same_view_negatives, want,
                                       groups, reduction)
        ctx.dtypes = (a.dtype, b.dtype)
        ctx.batch = a.shape[0]
        ctx.save_for_backward(d_x)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (d_x,) = ctx.saved_tensors
        if d_x is None:
            return (None,) * 10
        d_x = d_x * grad_loss
        da, db = d_x[: ctx.batch].to(ctx.dtypes[0]), d_x[ctx.batch:].to(ctx.dtypes[1])
        return da, db, None, None, None, None, None, None, None, None


def sequence_contrastive_loss(
    a: Tensor,
    b: Tensor,
    tau: float,
    queue: Optional[Tensor] = None,
    normalize: bool = True,
    symmetric: bool = True,
    same_view_negatives: bool = True,
    groups: Optional[Tensor] = None,
    reduction: str = "mean",
) -> Tensor:
    """Fused `functional.sequence_contrastive_loss`: InfoNCE of a_i against positive b_i, negatives
    b_j (j != i, groups[j] != groups[i]), a_j (the same, if same_view_negatives) and the queue rows
    (no gradient); `symmetric` adds the b-anchored direction; `reduction` "mean" or "sum" over the
    B (2B) terms."""
    if a.dim() != 2 or a.shape != b.shape:
        raise ValueError(f"sequence_contrastive_loss: a and b must both be [B, D], got {tuple(a.shape)} and {tuple(b.shape)}")
    if queue is not None and (queue.dim() != 2 or queue.shape[1] != a.shape[1]):
        raise ValueError(f"sequence_contrastive_loss: queue must be [Q, {a.shape[1]}], got {tuple(queue.shape)}")
    if not tau > 0:
        raise ValueError(f"sequence_contrastive_loss: tau must be positive, got {tau}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"sequence_contrastive_loss: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if groups is not None and groups.shape != (a.shape[0],):
        raise ValueError(f"sequence_contrastive_loss: groups must be [{a.shape[0]}], got {tuple(groups.shape)}")
    if a.shape[0] == 0:  # nothing to contrast: a graph-connected zero, like the reference
        return (a.sum() + b.sum()).float() * 0.0
    return _SequenceInfoNCE.apply(a, b, float(tau), queue, normalize, symmetric, same_view_negatives,
                                  torch.is_grad_enabled(), None if groups is None else groups.long().contiguous(),
                                  reduction)
