"""Bounds for compiled-vs-eager comparisons derived from float32 rounding, not from one machine's numbers."""
from __future__ import annotations

import math

import torch

#: float32's unit roundoff (2^-24): one rounding's relative error
UNIT_ROUNDOFF = float(torch.finfo(torch.float32).eps) / 2


def gradient_bound(eager: torch.Tensor, reference: torch.Tensor, terms: int) -> float:
    """How far a compiled float32 gradient may lie from the eager one, from rounding alone.

    Both are float32 evaluations of the same sums in different orders (inductor fuses and reorders
    the reductions). The eager result's own rounding is measured against the same model in float64:
    `err = max |g_32 - g_64|`. The compiled result is another evaluation of the same kind, so its own
    error is of that size too, and `|g_c - g_e| <= |g_c - g_64| + |g_e - g_64|`; a factor 4 leaves the
    compiled order room for three times the eager error. Where the eager sums happened to round
    well (`err` near 0 by luck), the floor is a reordered sum's expected error, `u * sqrt(n) * max|g|`
    (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., Sec. 4.2: random rounding
    errors over an `n`-term sum grow like `sqrt(n) u`), with `n` the reduction's size (the
    micro-batch's tokens) and a factor 8 for the tail of that distribution.
    """
    err = float((eager.double() - reference).abs().max())
    floor = UNIT_ROUNDOFF * math.sqrt(terms) * float(reference.abs().max())
    return 4 * err + 8 * floor
