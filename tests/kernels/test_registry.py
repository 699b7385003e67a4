"""Every Triton kernel is registered under its reference's name, with the reference's signature,
and the `auto` switch keeps CPU tensors on the torch reference even under the interpreter."""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import pipeline.kernels as kernels
from pipeline.kernels import functional

EXPECTED = {
    "linear_cross_entropy", "linear_cross_entropy_with_accuracy", "corrective_lm_loss", "sampled_softmax_cross_entropy",
    "token_contrastive_loss", "sequence_contrastive_loss",
}


def test_registered_kernels_have_the_reference_signature():
    assert set(kernels.TRITON_OPS) == EXPECTED
    for name, target in kernels.TRITON_OPS.items():
        module, attr = target.split(":")
        kernel = getattr(importlib.import_module(module), attr)
        assert kernels.get_op(name, "triton") is kernel
        assert kernels.get_op(name, "torch") is getattr(functional, name)
        ref_params = inspect.signature(getattr(functional, name)).parameters
        params = inspect.signature(kernel).parameters
        assert list(params) == list(ref_params), name
        assert [p.default for p in params.values()] == [p.default for p in ref_params.values()], name


def test_auto_uses_the_reference_for_cpu_tensors(monkeypatch):
    def no_triton(name):
        raise AssertionError(f"auto mode picked the Triton kernel for {name} on CPU tensors")

    monkeypatch.setattr(kernels, "_triton", no_triton)
    op = kernels.get_op("sequence_contrastive_loss", "auto")
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.equal(op(a, b, 0.1), functional.sequence_contrastive_loss(a, b, 0.1))


def test_unknown_mode_and_missing_kernel_are_refused():
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernels.get_op("linear_cross_entropy", "cuda")
    with pytest.raises(KeyError, match="no Triton kernel exists for 'copy_loss'"):
        kernels.get_op("copy_loss", "triton")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_no_grad_calls_give_the_same_loss(name, device):
    from benchmarks.kernels.bench_kernels import SHAPES, build_case

    case = name.removesuffix("_with_accuracy")  # the accuracy variant takes the plain op's inputs
    args, _, kwargs = build_case(case, SHAPES["small"], device, torch.float32)
    args = [a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() == 2 else a for a in args]
    kernel = kernels.get_op(name, "triton")
    with torch.no_grad():
        out = kernel(*args, **kwargs)
        expected = getattr(functional, name)(*args, **kwargs)
    outs, expected = (out, expected) if isinstance(out, tuple) else ((out,), (expected,))
    for got, want in zip(outs, expected):
        assert got.grad_fn is None
        torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-6)
