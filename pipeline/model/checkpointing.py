"""Activation checkpointing of the encoder layers (`model.activation_checkpointing`), both families.

A checkpointed layer keeps only its input for backward; its activations are recomputed when the
gradient reaches it (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"). With every
layer checkpointed the saved activations of an L-layer stack drop from ~L x (one layer's
activations) to L x (one [B, L, H] input) + one layer's activations, at the price of a second forward
pass through the layers (~1/3 more compute per step).

`torch.utils.checkpoint.checkpoint(..., use_reentrant=False, preserve_rng_state=True)`: the
non-reentrant variant works with keyword / non-tensor arguments (a `VarlenLayout`), with inputs that
need no gradient, and with DeepSpeed ZeRO-3 (whose module hooks gather the parameters again for the
recomputation); `preserve_rng_state` restores the CPU and CUDA generator states for the recompute,
so dropout draws the same masks and the gradients equal those of the run without checkpointing
(bitwise on the CPU: the same kernels on the same inputs; `tests/model/test_activation_checkpointing.py`).
The recomputation forks the generators, so the RNG state after the step is the one without it too.
"""
from __future__ import annotations

from typing import Any, Callable, Union

import torch
from torch.utils.checkpoint import checkpoint

#: The accepted words of `model.activation_checkpointing` (besides a positive integer k).
NONE, ALL = "none", "all"


def checkpoint_period(value: Union[str, int], num_layers: int, where: str = "model.activation_checkpointing") -> int:
    """`model.activation_checkpointing` -> the period k (0: none): `none` -> 0, `all` -> 1, an integer
    k in [1, num_layers] -> k (layers 0, k, 2k, ... are checkpointed). Anything else: `ValueError`
    naming `where`."""
    text = str(value).strip().lower()
    if text == NONE:
        return 0
    if text == ALL:
        return 1
    try:
        period = int(text)
    except ValueError:
        raise ValueError(f"{where}={value!r}: must be 'none', 'all' or a positive integer k (every k-th layer)") from None
    if period < 1:
        raise ValueError(f"{where}={value!r}: k must be >= 1 (every k-th layer); use 'none' for no checkpointing")
    if period > num_layers:
        raise ValueError(f"{where}={value!r}: k is above the model's {num_layers} layers (every k-th layer, "
                         f"k in 1..{num_layers}); use 'none' for no checkpointing")
    return period


def is_checkpointed(index: int, period: int) -> bool:
    """Is layer `index` (0-based) checkpointed with period k: index % k == 0 (k = 0: none)."""
    return period > 0 and index % period == 0


def run_layer(fn: Callable[..., Any], *args: Any, checkpointed: bool) -> Any:
    """`fn(*args)`, through `torch.utils.checkpoint` when `checkpointed` and autograd is recording
    (under `no_grad` / evaluation nothing is saved anyway, so nothing would be gained)."""
    if checkpointed and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    return fn(*args)


def describe(model: torch.nn.Module) -> str:
    """The start-up line of a model with checkpointed layers: per layer stack (the encoder, a COCO-LM
    generator), how many of its layers recompute their activations in backward; '' when none does."""
    parts = []
    for name, module in model.named_modules():
        period = getattr(module, "checkpoint_period", 0)
        layers = getattr(module, "layers", None) or getattr(module, "layer", None)
        if not period or not isinstance(layers, torch.nn.ModuleList):
            continue
        chosen = sum(is_checkpointed(i, period) for i in range(len(layers)))
        which = "every layer" if period == 1 else f"one in {period}: layers 0, {period}, {2 * period}, ..."
        parts.append(f"{name or 'model'}: {chosen} of {len(layers)} layers ({which})")
    if not parts:
        return ""
    return ("activation checkpointing on (model.activation_checkpointing): " + "; ".join(parts)
            + " recompute their activations in backward: less activation memory, about one more forward pass "
              "of those layers per step")

