"""Fused linear + cross-entropy for the MLM / generator heads, COCO-LM's corrective LM, and BERT-NCE.

Same signatures and semantics as `pipeline.kernels.functional.{linear_cross_entropy,
linear_cross_entropy_with_accuracy, corrective_lm_loss, sampled_softmax_cross_entropy}`.

Full-vocabulary losses (`linear_cross_entropy`, `corrective_lm_loss`):

    for each chunk of `chunk_rows` tokens:                     (never all N tokens at once)
        Z   = h_chunk @ W^T                      fp32 [chunk, V] (cuBLAS; bf16/fp16 inputs with fp32 output)
        per row, one Triton program walks the vocabulary in BLOCK_V tiles with an online
        log-sum-exp, then writes dL/dZ = w_n * (softmax(Z + b) - onehot(t_n)) / count over Z
        dH_chunk  = dZ @ W ;  dW += dZ^T @ h_chunk ;  db += sum_rows dZ

The same first pass also tracks each row's argmax (first index of the maximum, like
`torch.argmax`), so MLM's accuracy metric costs no second vocabulary projection
(`linear_cross_entropy_with_accuracy`).

The gradients are computed in the forward pass (the loss is a scalar, so backward only scales them
by the incoming gradient): the [chunk, V] buffer is reused chunk after chunk and no [N, V] tensor
ever exists. The row weight w_n is 1 for cross-entropy; for the corrective LM mixture
p = 1[t == x^MLM] c + (1 - c) softmax_t with c = sg(p_copy), d(-log p)/dZ = w (softmax - onehot(t))
with w = (1 - c) softmax_t / p, so both losses share one kernel.

Trade-off: three GEMMs, like the reference, instead of the five a fully tiled Triton GEMM needs to
recompute logits in backward; the price is one fp32 [chunk, V] buffer (about 256 MiB, see
`chunk_rows_for`). With bf16/fp16 inputs the scores are exact products accumulated in fp32; the
gradient dZ is rounded to the weight dtype before the two backward GEMMs (as the weight gradient
will be anyway), while dW accumulates in fp32 across chunks.

Peak memory (issue 55: 660 MiB at 16k rows and 855 MiB at 64k with V = 30,522, H = 1,024 on the first
lease, against Cut Cross-Entropy's 92 / 189 MiB, which is its bf16 dH + dW and nothing else). What it
holds, bf16 inputs on CUDA (chunk 2,048 rows): the fp32 scores Z (238 MiB), dW's fp32 accumulator
(119 MiB), dH (N x H) and, before 2026-11-29, three buffers more: a separate bf16 dZ (119 MiB), a new
fp32 dW from every out-of-place `addmm` while the old one still lived (119 MiB) and an fp32 dH (2x the
bf16 one). Now dZ is written in the weight dtype into Z's own rows (the row kernel's pass 2 stores
row r's gradient over the first half of row r's fp32 bytes, after a barrier: every value it
overwrites has been read), dW accumulates in place (`addmm(..., out=dW)`), dH is produced in the
input dtype by the GEMM, and backward scales and casts each gradient in one op (`scaled_grads`).
What remains above CCE is the design: the [chunk, V] scores (the chunk is `CHUNK_BYTES`, a
time-memory trade the kernel rows measure) and dW's fp32 accumulator, which alone is 1.3x CCE's 92 MiB.

BERT-NCE (`sampled_softmax_cross_entropy`) gathers its K + 1 candidate rows instead and shares the
gathered-candidate kernel of `pipeline.kernels.token_contrastive`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from pipeline.kernels.token_contrastive import gathered_infonce
from pipeline.kernels.functional import COPY_PROB_MAX

#: Target size of the fp32 [chunk, V] scores buffer (`chunk_budget` changes it for a measurement).
CHUNK_BYTES = 256 * 2**20


@triton.jit
def _softmax_xent_rows_kernel(
    z_ptr, stride_z,  # [R, V] fp32 scores without bias (read)
    grad_ptr, stride_grad,  # [R, V] dL/dZ (written when WRITE_GRAD; may alias z_ptr)
    bias_ptr,  # [V] (HAS_BIAS)
    targets_ptr,  # [R] int64
    copy_prob_ptr, corrupted_ptr,  # [R] copy probability and x^MLM (CORRECTIVE)
    loss_ptr,  # [R] fp32 per-row loss (0 for ignored rows)
    correct_ptr,  # [R] fp32: 1 where the row's argmax is its target (ARGMAX)
    inv_count_ptr,  # [1] fp32: 1 / max(number of counted rows, 1)
    V, ignore_index, copy_prob_max,
    HAS_BIAS: tl.constexpr, CORRECTIVE: tl.constexpr, WRITE_GRAD: tl.constexpr, ARGMAX: tl.constexpr,
    NARROW_IN_PLACE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """NARROW_IN_PLACE: grad_ptr is z_ptr's own memory in a dtype half as wide (row r of the gradient
    over the first half of row r's bytes). Pass 2's block at v0 then overwrites the fp32 columns
    [v0 / 2, (v0 + BLOCK_V) / 2), which this program loaded in this block (v0 = 0) or an earlier one;
    a barrier between each block's load and store makes every thread's loads come first."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    safe_target = tl.where(valid, target, 0)

    # Pass 1: per-lane running max and rescaled sum of exponentials (online log-sum-exp).
    # -1e30 instead of -inf keeps exp(m_old - m_new) finite for lanes that saw nothing yet.
    # With ARGMAX each lane also keeps the first column of its maximum (strict '>' keeps the first).
    m_lane = tl.full((BLOCK_V,), -1e30, tl.float32)
    l_lane = tl.zeros((BLOCK_V,), tl.float32)
    i_lane = tl.zeros((BLOCK_V,), tl.int32) + V
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        inside = cols < V
        z = tl.load(z_row + cols, mask=inside, other=float("-inf"))
        if HAS_BIAS:
            z += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        if ARGMAX:
            i_lane = tl.where(z > m_lane, cols, i_lane)
        m_new = tl.maximum(m_lane, z)
        l_lane = l_lane * tl.exp(m_lane - m_new) + tl.exp(z - m_new)
        m_lane = m_new
    m_row = tl.max(m_lane, axis=0)
    lse = m_row + tl.log(tl.sum(l_lane * tl.exp(m_lane - m_row), axis=0))
    if ARGMAX:
        best = tl.min(tl.where(m_lane == m_row, i_lane, V), axis=0)  # first column holding the row maximum
        tl.store(correct_ptr + row, tl.where(valid & (best == target), 1.0, 0.0))

    z_target = tl.load(z_row + safe_target)
    if HAS_BIAS:
        z_target += tl.load(bias_ptr + safe_target).to(tl.float32)
    log_softmax_t = z_target - lse
    if CORRECTIVE:
        # log p = logaddexp(log c if t == x^MLM else -inf, log(1 - c) + log_softmax_t)
        c = tl.load(copy_prob_ptr + row).to(tl.float32)
        c = tl.minimum(tl.maximum(c, 0.0), copy_prob_max)
        lm_term = tl.log(1.0 - c) + log_softmax_t
        copied = tl.load(corrupted_ptr + row) == target
        copied = copied & (c > 0.0)  # log(0) = -inf either way; this avoids evaluating it
        copy_term = tl.where(copied, tl.log(tl.where(copied, c, 1.0)), float("-inf"))
        top = tl.maximum(copy_term, lm_term)
        log_p = top + tl.log(tl.exp(copy_term - top) + tl.exp(lm_term - top))
        loss = -log_p
        row_weight = tl.exp(lm_term - log_p)  # (1 - c) softmax_t / p
    else:
        loss = -log_softmax_t
        row_weight = 1.0
    loss = tl.where(valid, loss, 0.0)
    tl.store(loss_ptr + row, loss)

    if WRITE_GRAD:
        scale = tl.where(valid, row_weight * tl.load(inv_count_ptr), 0.0)
        g_row = grad_ptr + row * stride_grad
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            inside = cols < V
            z = tl.load(z_row + cols, mask=inside, other=float("-inf"))
            if HAS_BIAS:
                z += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) * scale
            g = tl.where(cols == target, g - scale, g)
            if NARROW_IN_PLACE:
                tl.debug_barrier()
            tl.store(g_row + cols, g.to(grad_ptr.dtype.element_ty), mask=inside)


def softmax_xent_rows(
    z: Tensor,
    targets: Tensor,
    loss_rows: Tensor,
    inv_count: Tensor,
    grad: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    ignore_index: int = -100,
    copy_prob: Optional[Tensor] = None,
    corrupted_ids: Optional[Tensor] = None,
    correct_rows: Optional[Tensor] = None,
) -> None:
    """Launch the row kernel: per-row loss of scores `z` [R, V] (fp32, unit column stride) into
    `loss_rows` [R]; when `grad` is given, dL/dz scaled by `inv_count` ([1] fp32) written into it
    (it may be `z` itself, or `narrow_view(z, dtype)`: z's memory in a half-width dtype); when
    `correct_rows` [R] is given, 1.0 where argmax(z + b) is the target. Entries of `z` equal to
    -inf are excluded from the softmax."""
    rows, vocab = z.shape
    if rows == 0:
        return
    corrective = copy_prob is not None
    block_v, warps = rows_launch_config(vocab)
    out = z if grad is None else grad
    narrow_in_place = grad is not None and grad.data_ptr() == z.data_ptr() and grad.dtype != z.dtype
    if narrow_in_place and (grad.element_size() * 2 != z.element_size() or grad.stride(0) != 2 * z.stride(0)):
        raise ValueError("softmax_xent_rows: a gradient in z's own memory must be narrow_view(z, dtype)")
    _softmax_xent_rows_kernel[(rows,)](
        z, z.stride(0), out, out.stride(0),
        bias if bias is not None else z,
        targets,
        copy_prob if corrective else z, corrupted_ids if corrective else targets,
        loss_rows, correct_rows if correct_rows is not None else loss_rows, inv_count,
        vocab, ignore_index, COPY_PROB_MAX,
        HAS_BIAS=bias is not None, CORRECTIVE=corrective, WRITE_GRAD=grad is not None,
        ARGMAX=correct_rows is not None, NARROW_IN_PLACE=narrow_in_place, BLOCK_V=block_v, num_warps=warps,
    )


def narrow_view(z: Tensor, dtype: torch.dtype) -> Tensor:
    """z's own memory ([R, V] fp32, contiguous) as an [R, V] tensor of a half-width `dtype` (bf16 /
    fp16) whose row r is the first half of z's row r (row stride 2V): where the row kernel writes
    dL/dZ when the backward GEMMs want it in the weight dtype, so no second [chunk, V] buffer exists."""
    if not z.is_contiguous() or z.dtype != torch.float32 or torch.empty((), dtype=dtype).element_size() != 2:
        raise ValueError(f"narrow_view: a contiguous float32 z and a 2-byte dtype, got {z.dtype} -> {dtype}")
    return z.view(dtype)[:, : z.shape[1]]


@contextlib.contextmanager
def chunk_budget(nbytes: int) -> Iterator[None]:
    """`CHUNK_BYTES` set to `nbytes` inside the block (the kernel benchmark's time-memory variants:
    a smaller scores buffer costs more passes over dW's accumulator)."""
    global CHUNK_BYTES
    before, CHUNK_BYTES = CHUNK_BYTES, nbytes
    try:
        yield
    finally:
        CHUNK_BYTES = before


def scaled_grads(saved: tuple[Optional[Tensor], ...], grad_loss: Tensor,
                 dtypes: tuple[Optional[torch.dtype], ...]) -> list[Optional[Tensor]]:
    """The gradients a fused loss computed in its forward pass, times the incoming dL/dloss, each in
    its input's dtype: one multiply that writes the target dtype (no full-size fp32 product first)."""
    return [None if g is None else torch.mul(g, grad_loss, out=torch.empty(g.shape, dtype=dt, device=g.device))
            for g, dt in zip(saved, dtypes)]


def rows_launch_config(vocab: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the row kernel: 4096-wide tiles, 16 fp32 per thread at 8 warps."""
    block_v = min(4096, triton.next_power_of_2(vocab))
    return block_v, 8 if block_v >= 2048 else 4


def chunk_rows_for(vocab: int, rows: int) -> int:
    """Tokens per chunk: a power of two near CHUNK_BYTES / (4 V), at least 16, at most all rows."""
    target = max(16, CHUNK_BYTES // (4 * max(vocab, 1)))
    return max(1, min(rows, 1 << (target.bit_length() - 1)))


_MM_OUT_DTYPE_OK: dict[str, bool] = {}


def _mm_fp32_out_supported(device: torch.device) -> bool:
    """Does `torch.mm(bf16, bf16, out_dtype=torch.float32)` exist here (cuBLAS, torch >= 2.8)?"""
    key = str(device)
    if key not in _MM_OUT_DTYPE_OK:
        try:
            probe = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
            _MM_OUT_DTYPE_OK[key] = torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE_OK[key] = False
    return _MM_OUT_DTYPE_OK[key]


def _mm(a: Tensor, b: Tensor, fp32_out: bool) -> Tensor:
    return torch.mm(a, b, out_dtype=torch.float32) if fp32_out else torch.mm(a, b)


def _add_mm_fp32(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """acc += a @ b for low-precision a, b and an fp32 acc, in place: one fused cuBLAS call where `addmm`
    takes out_dtype (C = acc read and written: no second [V, H] fp32 buffer), else a separate product
    and add."""
    key = f"addmm:{acc.device}"
    if _MM_OUT_DTYPE_OK.get(key, True):
        try:
            out = torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _MM_OUT_DTYPE_OK[key] = True
            return out
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE_OK[key] = False
    return acc.add_(torch.mm(a, b, out_dtype=torch.float32))


def _fused_forward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    ignore_index: int,
    copy_prob: Optional[Tensor],
    corrupted_ids: Optional[Tensor],
    want: tuple[bool, bool, bool],
    with_accuracy: bool = False,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Loss, fp32 gradients (dH, dW, db; None where not wanted) and, with `with_accuracy`, the
    fraction of counted rows whose argmax is the target — chunk by chunk."""
    rows, hid = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    want_h, want_w, want_b = want
    any_grad = want_h or want_w or want_b
    if copy_prob is not None:  # COCO-LM: every row counts
        count = torch.full((1,), float(max(rows, 1)), device=device)
    else:
        count = (targets != ignore_index).sum().clamp(min=1).float().reshape(1)
    inv_count = count.reciprocal()

    low_precision = (
        hidden.dtype == weight.dtype
        and weight.dtype in (torch.bfloat16, torch.float16)
        and device.type == "cuda"
        and _mm_fp32_out_supported(device)
    )
    if low_precision:
        h_all, w_mat = hidden, weight  # bf16 x bf16 products are exact in the fp32 accumulator
    else:
        h_all, w_mat = hidden.float(), weight.float()
    grad_dtype = w_mat.dtype

    loss_rows = torch.empty(rows, device=device, dtype=torch.float32)
    correct_rows = torch.zeros(rows, device=device, dtype=torch.float32) if with_accuracy else None
    # dH in the GEMM's operand dtype (cuBLAS accumulates in fp32 and rounds once, as the returned grad is)
    d_hidden = torch.empty(rows, hid, device=device, dtype=grad_dtype) if want_h else None
    d_weight = torch.zeros(vocab, hid, device=device, dtype=torch.float32) if want_w else None
    d_bias = torch.zeros(vocab, device=device, dtype=torch.float32) if want_b else None
    chunk = chunk_rows_for(vocab, rows)
    bias32 = None if bias is None else bias.float().contiguous()
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        h = h_all[start:stop]
        z = _mm(h, w_mat.t(), low_precision)  # fp32 [chunk, V]
        grad = None
        if any_grad:  # dL/dZ over Z itself: in place, or in the weight dtype in Z's own rows
            grad = z if grad_dtype == torch.float32 else narrow_view(z, grad_dtype)
        softmax_xent_rows(
            z, targets[start:stop], loss_rows[start:stop], inv_count, grad, bias32, ignore_index,
            None if copy_prob is None else copy_prob[start:stop],
            None if corrupted_ids is None else corrupted_ids[start:stop],
            None if correct_rows is None else correct_rows[start:stop],
        )
        if want_h:
            torch.mm(grad, w_mat, out=d_hidden[start:stop])
        if want_w:
            if low_precision:
                d_weight = _add_mm_fp32(d_weight, grad.t(), h)
            else:
                d_weight.addmm_(grad.t(), h)
        if want_b:
            d_bias += grad.sum(0, dtype=torch.float32)
        del z, grad
    loss = (loss_rows.sum() * inv_count).reshape(())
    accuracy = None if correct_rows is None else (correct_rows.sum() * inv_count).reshape(())
    return loss, d_hidden, d_weight, d_bias, accuracy


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """(loss, accuracy) forward; the gradients come from the forward pass and are scaled by
    grad_output. The accuracy (a metric: 0-d, no gradient) is NaN unless asked for."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, copy_prob, corrupted_ids, grad_enabled,
                with_accuracy):
        # needs_input_grad stays True under torch.no_grad(); grad_enabled (taken by the caller) does not.
        needs = [grad_enabled and n for n in ctx.needs_input_grad]
        want = (needs[0], needs[1], bias is not None and needs[2])
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            loss, dh, dw, db, accuracy = _fused_forward(
                hidden.contiguous(), weight.contiguous(), bias, targets.contiguous(), ignore_index,
                copy_prob, corrupted_ids, want, with_accuracy,
            )
        if accuracy is None:
            accuracy = torch.full((), float("nan"), device=hidden.device)
        ctx.mark_non_differentiable(accuracy)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(dh, dw, db)
        return loss, accuracy

    @staticmethod
    def backward(ctx, grad_loss, _grad_accuracy):
        dh, dw, db = scaled_grads(ctx.saved_tensors, grad_loss, ctx.dtypes)
        return dh, dw, db, None, None, None, None, None, None


def _check_rows(name: str, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], **per_row: Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: hidden [N, H] and weight [V, H] expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"{name}: bias must be [V]={weight.shape[0]}, got {tuple(bias.shape)}")
    for key, t in per_row.items():
        if t.shape[0] != hidden.shape[0]:
            raise ValueError(f"{name}: {key} has {t.shape[0]} rows, hidden has {hidden.shape[0]}")


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, ignore_index: int = -100
) -> Tensor:
    """Fused `functional.linear_cross_entropy`: mean over non-ignored rows of
    -log softmax(W h_n + b)_{t_n}, 0 when every row is ignored. Targets must lie in [0, V)."""
    _check_rows("linear_cross_entropy", hidden, weight, bias, targets=targets)
    return _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, ignore_index, None, None,
                                          torch.is_grad_enabled(), False)[0]


def linear_cross_entropy_with_accuracy(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, ignore_index: int = -100
) -> tuple[Tensor, Tensor]:
    """Fused `functional.linear_cross_entropy_with_accuracy`: the loss above and, from the same
    pass over the scores, the fraction of non-ignored rows whose argmax is the target."""
    _check_rows("linear_cross_entropy_with_accuracy", hidden, weight, bias, targets=targets)
    loss, accuracy = _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, ignore_index, None, None,
                                                    torch.is_grad_enabled(), True)
    return loss, accuracy


def corrective_lm_loss(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], copy_prob: Tensor, corrupted_ids: Tensor, targets: Tensor
) -> Tensor:
    """Fused `functional.corrective_lm_loss` (COCO-LM):
    mean_n -log(1[t_n == x^MLM_n] sg(c_n) + (1 - sg(c_n)) softmax(W h_n + b)_{t_n}), c clamped to
    [0, COPY_PROB_MAX]; copy_prob gets no gradient."""
    _check_rows("corrective_lm_loss", hidden, weight, bias, copy_prob=copy_prob, corrupted_ids=corrupted_ids, targets=targets)
    return _FusedLinearCrossEntropy.apply(
        hidden, weight, bias, targets.contiguous(), -1, copy_prob.detach().contiguous(), corrupted_ids.contiguous(),
        torch.is_grad_enabled(), False,
    )[0]


def sampled_softmax_cross_entropy(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, negative_ids: Tensor
) -> Tensor:
    """`functional.sampled_softmax_cross_entropy` (BERT-NCE) without the gathered [N, K + 1, H]
    weight rows: candidates = [target, negatives], negatives equal to the target excluded."""
    _check_rows("sampled_softmax_cross_entropy", hidden, weight, bias, targets=targets, negative_ids=negative_ids)
    candidates = torch.cat([targets[:, None], negative_ids], dim=1)
    return gathered_infonce(
        hidden, None, weight, candidates, bias, scale=1.0, normalize=False, mask_duplicates=True, candidate_grad=True
    )
