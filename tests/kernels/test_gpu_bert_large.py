"""Kernels against the torch reference at BERT-large shapes on a GPU, in fp32 and bf16.

Skipped without CUDA (marker `gpu`). Errors are measured as ||kernel - reference|| / ||reference||
on the loss and on every gradient; the reference upcasts bf16 inputs to fp32 itself, so both sides
see the same input values. Tolerances: fp32 1e-4 on the loss, 1e-3 on gradients (the kernels use
3xTF32 or fp32 products, summed in another order); bf16 gradients 2e-2 (the fused cross-entropy
rounds dL/dlogits to bf16 before the backward GEMMs, and every gradient is returned in bf16).
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.kernels.bench_kernels import SHAPES, build_case
from pipeline.kernels import get_op
from pipeline.kernels import functional

pytestmark = pytest.mark.gpu

OPS = ("linear_cross_entropy", "corrective_lm_loss", "sampled_softmax_cross_entropy",
       "token_contrastive_loss", "sequence_contrastive_loss")
#: TACO's reference gathers [N, K, H] fp32 candidates: 64k anchors need ~27 GB, so test on a quarter of the batch.
SHAPE = {**SHAPES["full"], "batch": 32}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def loss_and_grads(fn, args, grad_positions):
    leaves = [a.detach().clone().requires_grad_() if i in grad_positions else a for i, a in enumerate(args)]
    loss = fn(*leaves)
    loss.backward()
    return loss.detach(), [leaves[i].grad for i in grad_positions]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", OPS)
def test_kernel_matches_reference_at_bert_large_shapes(op, dtype):
    shape = SHAPE if op == "token_contrastive_loss" else SHAPES["full"]
    args, grad_positions, _ = build_case(op, shape, torch.device("cuda"), dtype, seed=1)
    ref_loss, ref_grads = loss_and_grads(getattr(functional, op), args, grad_positions)
    loss, grads = loss_and_grads(get_op(op, "triton"), args, grad_positions)
    assert torch.isfinite(loss)
    assert rel_err(loss, ref_loss) < (1e-4 if dtype == torch.float32 else 1e-3), (loss.item(), ref_loss.item())
    grad_tol = 1e-3 if dtype == torch.float32 else 2e-2
    for pos, g, ref in zip(grad_positions, grads, ref_grads):
        assert g.dtype == ref.dtype == dtype
        assert rel_err(g, ref) < grad_tol, f"input {pos}: relative error {rel_err(g, ref):.2e}"


def test_auto_mode_picks_the_kernel_on_cuda():
    args, grad_positions, _ = build_case("sequence_contrastive_loss", SHAPES["small"], torch.device("cuda"), torch.float32)
    auto, _ = loss_and_grads(get_op("sequence_contrastive_loss", "auto"), args, grad_positions)
    kernel, _ = loss_and_grads(get_op("sequence_contrastive_loss", "triton"), args, grad_positions)
    assert torch.equal(auto, kernel)
