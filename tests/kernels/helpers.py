"""Run a loss twice (torch reference, Triton kernel) on cloned inputs and compare value and grads."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

FP32_TOL = dict(rtol=1e-4, atol=1e-6)


def run_with_grads(fn: Callable[..., Tensor], inputs: Sequence, grad_positions: Sequence[int]):
    """fn(*clones) -> (loss, [grad of each input in grad_positions])."""
    args = [
        x.detach().clone().requires_grad_(i in grad_positions) if isinstance(x, Tensor) and x.is_floating_point() else x
        for i, x in enumerate(inputs)
    ]
    loss = fn(*args)
    loss.backward()
    return loss.detach(), [args[i].grad for i in grad_positions]


def assert_matches(reference: Callable, kernel: Callable, inputs: Sequence, grad_positions: Sequence[int],
                   rtol: float = FP32_TOL["rtol"], atol: float = FP32_TOL["atol"]) -> tuple[Tensor, list[Tensor]]:
    """Forward value and every requested gradient of `kernel` equal the reference's; returns the reference's."""
    ref_loss, ref_grads = run_with_grads(reference, inputs, grad_positions)
    loss, grads = run_with_grads(kernel, inputs, grad_positions)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    for pos, g, ref in zip(grad_positions, grads, ref_grads):
        assert (g is None) == (ref is None), f"input {pos}: gradient presence differs"
        if ref is not None:
            assert g.dtype == ref.dtype and g.shape == ref.shape
            torch.testing.assert_close(g, ref, rtol=rtol, atol=atol, msg=lambda m: f"grad of input {pos}: {m}")
    return ref_loss, ref_grads
