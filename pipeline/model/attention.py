"""How an encoder pass attends: no mask, an additive mask, or unpadded (variable-length) attention.

Which path a pass takes is decided on the host, from what the collator knows, so the decision
never costs a device sync:

* `seqlens` ([B] int64 **CPU** tensor: real tokens per row, rows right-padded; batch keys named by
  `pipeline.data.batch.seqlens_key`) says every row is full -> **dense**: SDPA gets no mask and can run
  the flash kernel (packed shards never pad, so this is the common case);
* some row is shorter and `model.attention` allows it -> **varlen**: the layer stack runs on the
  T = sum(seqlens) real tokens only (QKV, FFN and LayerNorm on [T, H], not [B*L, H]), attention
  is one variable-length kernel over the cumulative sequence offsets `cu_seqlens`;
* otherwise (no `seqlens`, i.e. a layout nobody vouched for; or `model.attention=masked`) ->
  **masked**: the reference path, SDPA with an additive [B, 1, 1, L] bias of -inf at padding.

Variable-length attention on CUDA is `torch.ops.aten._flash_attention_forward` with the
cumulative offsets — the kernel behind PyTorch's own `torch.nn.attention.varlen.varlen_attn` and
behind SDPA on jagged nested tensors, differentiable through its registered backward. It is called
directly rather than through `varlen_attn` because the latter fixes dropout to 0 in torch 2.11 and
BERT trains with attention dropout. Elsewhere (CPU, fp32) `repadded_attention` computes the same
thing by scattering the tokens back to [B, L] and running masked SDPA: the plumbing (unpad, offsets,
re-pad) is then exercised and tested on the CPU against the masked reference path.

FLOPs: `AttentionPlan.tokens` / `.sum_sq` are what the layers really process (B*L and B*L^2 for
the dense and masked paths, T and sum_b s_b^2 for varlen); `pipeline.train.metrics` counts those.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

ATTENTION_MODES = ("auto", "varlen", "masked")
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class VarlenLayout:
    """Where the real tokens of a right-padded [B, L] batch are, for unpadded attention."""

    indices: Tensor  # [T] int64: flat positions (row-major into B*L) of the real tokens, on device
    cu_seqlens: Tensor  # [B + 1] int32: cumulative lengths, on device
    max_seqlen: int  # longest row (host)
    batch: int
    length: int

    @property
    def tokens(self) -> int:
        return int(self.indices.shape[0])


@dataclass(frozen=True)
class AttentionPlan:
    """One encoder pass's attention path (see the module docstring) and its real work."""

    kind: str  # "dense" | "masked" | "varlen"
    bias: Optional[Tensor] = None  # masked: [B, 1, 1, L] additive bias
    layout: Optional[VarlenLayout] = None  # varlen
    tokens: int = 0  # tokens the layers process
    sum_sq: int = 0  # sum over sequences of (attended length)^2
    static: bool = True  # shapes come from the collator's fixed layout (compiled layers may run it)


def attention_bias(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, L] 1/0 mask -> additive [B, 1, 1, L] bias for SDPA (finfo.min at padding)."""
    keep = attention_mask[:, None, None, :].to(torch.bool)
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def varlen_layout(lengths: Sequence[int], length: int, device: torch.device) -> VarlenLayout:
    """Layout of right-padded rows of `length` columns from their host-side lengths. The index
    tensors are built on the host (numpy: no tensor op reads anything) and copied without blocking."""
    rows = np.asarray(lengths, dtype=np.int64)
    starts = np.arange(len(rows), dtype=np.int64) * length
    indices = torch.from_numpy(np.concatenate([np.arange(s, s + n) for s, n in zip(starts, rows)] or [np.zeros(0, np.int64)]))
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(rows)]).astype(np.int32))
    if device.type == "cuda":  # page-locked sources make the copies asynchronous
        indices, cu = indices.pin_memory(), cu.pin_memory()
    return VarlenLayout(indices.to(device, non_blocking=True), cu.to(device, non_blocking=True),
                        int(rows.max()) if len(rows) else 0, len(rows), length)


def flash_varlen_usable(x: Tensor, head_dim: int) -> bool:
    """Can the flash kernel take this pass (CUDA, half precision activations or autocast, head dim)?"""
    if not x.is_cuda or head_dim % 8 or head_dim > 256:
        return False
    if x.dtype in _HALF:
        return True
    return torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") in _HALF


def plan_attention(x: Tensor, attention_mask: Optional[Tensor], seqlens: Optional[Tensor], mode: str,
                   head_dim: int) -> AttentionPlan:
    """The path of one pass over `x` [B, L, H] (see the module docstring); host-side only."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"model.attention={mode!r}: choose one of {ATTENTION_MODES}")
    batch, length = int(x.shape[0]), int(x.shape[1])
    full = batch * length, batch * length * length
    if attention_mask is None:
        return AttentionPlan("dense", tokens=full[0], sum_sq=full[1])
    if seqlens is None or mode == "masked":
        return AttentionPlan("masked", bias=attention_bias(attention_mask, x.dtype), tokens=full[0],
                             sum_sq=full[1], static=seqlens is not None)
    lengths = [int(n) for n in seqlens.tolist()]  # host data: a list, so that no tensor op reads it
    if len(lengths) != batch or any(n < 0 or n > length for n in lengths):
        raise ValueError(f"seqlens {lengths[:8]} (of {len(lengths)}) do not describe a [{batch}, {length}] batch")
    if all(n == length for n in lengths):
        return AttentionPlan("dense", tokens=full[0], sum_sq=full[1])
    if mode == "varlen" or flash_varlen_usable(x, head_dim):
        layout = varlen_layout(lengths, length, x.device)
        return AttentionPlan("varlen", layout=layout, tokens=layout.tokens, sum_sq=sum(n * n for n in lengths),
                             static=False)
    return AttentionPlan("masked", bias=attention_bias(attention_mask, x.dtype), tokens=full[0], sum_sq=full[1])


#: The SDPA backends a masked pass whose shape changes every micro-batch may use: every one but cuDNN's.
#: torch (>= 2.9, with its bundled cuDNN >= 9.15) tries cuDNN's attention first on sm90 / sm100, and
#: cuDNN builds and caches an execution graph per distinct input shape (batch, length, mask shape), which
#: costs host time each time a shape is new: InfoWord's n-gram rows (count and bucketed width set by the
#: batch) would pay it nearly every micro-batch. Flash / memory-efficient attention are compiled ahead.
SHAPE_FREE_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def attention_backends(plan: AttentionPlan) -> ContextManager:
    """Where SDPA may look for a kernel during the layers of a pass planned as `plan`: anywhere (the
    default order) unless the pass is masked with a shape nobody fixed (`plan.static` False); then
    `SHAPE_FREE_BACKENDS` only (`torch.nn.attention.sdpa_kernel`, restored after the pass)."""
    if plan.kind != "masked" or plan.static:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in SHAPE_FREE_BACKENDS])


def window_bias(length: int, window: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[L, L] additive bias: 0 where |i - j| <= window, the dtype's minimum elsewhere (ModernBERT's local
    attention layers)."""
    pos = torch.arange(length, device=device)
    far = (pos[:, None] - pos[None, :]).abs() > window
    return torch.zeros(length, length, dtype=dtype, device=device).masked_fill(far, torch.finfo(dtype).min)


def flash_usable(q: Tensor) -> bool:
    """Can the flash kernel take q [T, heads, D] (CUDA, fp16/bf16, head size a multiple of 8 up to 256)?"""
    return q.is_cuda and q.dtype in _HALF and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, layout: VarlenLayout, dropout_p: float,
                     window: Optional[int] = None) -> Tensor:
    """Attention within each sequence of the unpadded tokens, optionally limited to |i - j| <= window.
    q, k, v [T, heads, D] -> [T, heads, D].

    Flash kernel on CUDA (fp16 / bf16; the window as its `window_size_left/right`); `repadded_attention`
    elsewhere.
    """
    if flash_usable(q):
        q, k, v = (t.contiguous() for t in (q, k, v))  # the kernel wants dense [T, heads, D] rows
        extra = {} if window is None else {"window_size_left": window, "window_size_right": window}
        return torch.ops.aten._flash_attention_forward(
            q, k, v, layout.cu_seqlens, layout.cu_seqlens, layout.max_seqlen, layout.max_seqlen,
            dropout_p, False, False, **extra)[0]
    return repadded_attention(q, k, v, layout, dropout_p, window)


def repadded_attention(q: Tensor, k: Tensor, v: Tensor, layout: VarlenLayout, dropout_p: float,
                       window: Optional[int] = None) -> Tensor:
    """The varlen contract computed with padded SDPA: tokens scattered back to [B, L], key padding
    (and, with `window`, keys farther than it) masked, real rows gathered again. Used where no
    variable-length kernel exists (CPU, fp32)."""
    tokens, heads, dim = q.shape
    b, length = layout.batch, layout.length

    def padded(t: Tensor) -> Tensor:
        out = t.new_zeros(b * length, heads, dim).index_copy(0, layout.indices, t)
        return out.view(b, length, heads, dim).transpose(1, 2)

    keep = torch.zeros(b * length, dtype=torch.bool, device=q.device)
    keep[layout.indices] = True
    bias = attention_bias(keep.view(b, length), q.dtype)
    if window is not None:  # clamped: two minima added would overflow to -inf
        bias = torch.clamp_min(bias + window_bias(length, window, q.dtype, q.device), torch.finfo(q.dtype).min)
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=bias, dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(b * length, heads, dim)[layout.indices]
