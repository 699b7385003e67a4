"""The shared-negatives kernel path with the objectives' static "all" layout — every vocabulary id,
most with count 0 — matches the reference without a `unique` (a device sync)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.kernels import shared_negatives as fused_nce
from pipeline.kernels import functional as ref
from tests.kernels.helpers import assert_matches

ROWS, HIDDEN, VOCAB = 37, 32, 301


class Uniques(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._unique2, torch.ops.aten._unique, torch.ops.aten.unique_dim):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_whole_vocabulary_layout_matches_the_reference_without_unique(device):
    g = torch.Generator().manual_seed(3)
    h, w, b = torch.randn(ROWS, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g), torch.randn(VOCAB, generator=g)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=g)
    counts = torch.randint(0, 3, (4, VOCAB), generator=g) * (torch.rand(4, VOCAB, generator=g) < 0.2)  # mostly 0
    groups = torch.randint(0, 4, (ROWS,), generator=g)
    ids = torch.arange(VOCAB)
    args = [t.to(device) for t in (h, w, b, targets, ids, counts, groups)]
    with Uniques() as seen:
        fused_nce.sampled_softmax_cross_entropy(*args)
    assert seen.count == 0
    assert_matches(ref.sampled_softmax_cross_entropy, fused_nce.sampled_softmax_cross_entropy, args, [0, 1, 2])
