"""Fused Triton kernels for the losses, and the switch that picks them.

`get_op(name, mode)` returns the callable for a loss op: the torch reference from
`pipeline.kernels.functional` or the Triton kernel registered under the same name. Each kernel
module registers itself in `TRITON_OPS`; the signature and semantics are the reference's.

mode: "torch" always the reference; "triton" the kernel (error if unavailable); "auto" the kernel
when the inputs live on CUDA and Triton is importable, the reference otherwise (the choice is made
per call from the first tensor argument's device, so CPU tests and GPU runs share one code path).
"""
from __future__ import annotations

import importlib
from typing import Callable

from pipeline.capabilities import triton_usable

KERNEL_MODES = ("auto", "triton", "torch")

#: op name -> "module:function" of the Triton implementation (imported lazily).
TRITON_OPS: dict[str, str] = {
    "linear_cross_entropy": "pipeline.kernels.linear_cross_entropy:linear_cross_entropy",
    "linear_cross_entropy_with_accuracy": "pipeline.kernels.linear_cross_entropy:linear_cross_entropy_with_accuracy",
    "corrective_lm_loss": "pipeline.kernels.linear_cross_entropy:corrective_lm_loss",
    "sampled_softmax_cross_entropy": "pipeline.kernels.shared_negatives:sampled_softmax_cross_entropy",
    "token_contrastive_loss": "pipeline.kernels.token_contrastive:token_contrastive_loss",
    "sequence_contrastive_loss": "pipeline.kernels.sequence_contrastive:sequence_contrastive_loss",
}


def _reference(name: str) -> Callable:
    from pipeline.kernels import functional

    try:
        return getattr(functional, name)
    except AttributeError:
        raise KeyError(f"no loss op named {name!r} in pipeline.kernels.functional") from None


def _triton(name: str) -> Callable:
    if name not in TRITON_OPS:
        raise KeyError(f"no Triton kernel registered for {name!r}; registered: {sorted(TRITON_OPS)}")
    module, attr = TRITON_OPS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def get_op(name: str, mode: str = "auto") -> Callable:
    """Callable for loss op `name` under kernel `mode` (see module docstring)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {mode!r}")
    ref = _reference(name)
    if mode == "torch" or name not in TRITON_OPS:
        if mode == "triton":
            raise KeyError(f"kernels=triton but no Triton kernel exists for {name!r}")
        return ref
    if mode == "triton":
        return _triton(name)

    def dispatch(*args, **kwargs):
        import torch

        first = next(a for a in args if isinstance(a, torch.Tensor))
        if first.device.type == "cuda" and triton_usable("cuda"):
            return _triton(name)(*args, **kwargs)
        return ref(*args, **kwargs)

    dispatch.__name__ = f"auto_{name}"
    return dispatch
