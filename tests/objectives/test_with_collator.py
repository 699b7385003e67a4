"""Every objective (and the paper recipes) on batches made by the real `CorruptionCollator` for the
views the model asks for — the batch contract between data and objectives, end to end."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.data.batch import move_batch
from pipeline.data.corruption import CorruptionCollator
from tests.objectives.conftest import SPECIAL, VOCAB, tiny_model

RECIPES = [
    {"mlm": 1.0},
    {"mlm-nce": 1.0},
    {"mlm": 1.0, "taco": 1.0},
    {"mlm": 1.0, "capt": 1.0},
    {"cocolm": 1.0},
    {"infoword": 1.0},
    {"cocolm": 1.0, "taco": 1.0},
    {"electra": 1.0},
    {"electra": 1.0, "taco": 1.0},
]


def packed_rows(batch_size: int, length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(len(SPECIAL), VOCAB, size=(batch_size, length))
    ids[:, 0], ids[:, -1] = SPECIAL["cls"], SPECIAL["sep"]
    ids[-1, length // 2 :] = SPECIAL["pad"]  # a short last sequence
    ids[-1, length // 2 - 1] = SPECIAL["sep"]
    word_starts = rng.random((batch_size, length)) < 0.6
    return ids, word_starts


@pytest.mark.parametrize("objectives", RECIPES, ids=lambda o: "+".join(o))
def test_objectives_run_on_collator_batches(objectives):
    model = tiny_model(objectives)
    collator = CorruptionCollator(model.views, SPECIAL, VOCAB, seed=7)
    ids, starts = packed_rows(4, 32, seed=len(objectives))
    batch = collator.collate(ids, starts, np.arange(4) + 100)
    loss, metrics = model(batch)
    assert torch.isfinite(loss)
    loss.backward()
    for name in objectives:
        assert torch.isfinite(metrics[f"{name}/loss"])
    # the same batch and sample indices reproduce the same sampled indices, hence the same loss
    model.eval()
    again = [model(batch)[0].item() for _ in range(2)]
    assert again[0] == again[1]


@pytest.mark.gpu
@pytest.mark.parametrize("objectives", RECIPES, ids=lambda o: "+".join(o))
def test_objectives_on_cuda_under_bf16_autocast(objectives):
    """Same recipes on the GPU path: CUDA sampling generator, bf16 autocast, fp32 losses. The batch moves
    as the training loop moves it (`move_batch`: host keys such as `span_widths` stay on the CPU; the
    first lease's version moved every key and InfoWord failed reading `span_widths` on the host, which
    `test_infoword_shapes.py` covers)."""
    model = tiny_model(objectives).cuda()
    collator = CorruptionCollator(model.views, SPECIAL, VOCAB, seed=7)
    ids, starts = packed_rows(8, 32, seed=3)
    batch = move_batch(collator.collate(ids, starts, np.arange(8)), torch.device("cuda"))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, metrics = model(batch)
    assert loss.dtype == torch.float32 and torch.isfinite(loss), metrics
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
