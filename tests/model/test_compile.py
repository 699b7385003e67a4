"""`model.compile=true`: every layer stack's layers run through `torch.compile` (regional) and give
the eager values and gradients (shape classes and recompiles: `test_compile_shapes.py`)."""
from __future__ import annotations

import numpy as np
import torch
from torch._dynamo.utils import counters

from pipeline.data.corruption import CorruptionCollator
from pipeline.pretrain.build import build_pretrain_model
from pipeline.model.encoder import build_encoder_config

SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
VOCAB = 71


def model(compile_layers: bool):
    cfg = build_encoder_config("tiny", vocab_size=VOCAB, max_position=16, dropout=0.0, attention_dropout=0.0)
    return build_pretrain_model(cfg, {"cocolm": 1.0}, SPECIAL, {"cocolm": {"generator_layers": 1}}, seed=3,
                                kernels="torch", compile_layers=compile_layers)


def collated(views):
    rng = np.random.default_rng(0)
    ids = rng.integers(5, VOCAB, size=(4, 16))
    ids[:, 0], ids[:, -1] = SPECIAL["cls"], SPECIAL["sep"]
    return CorruptionCollator(views, SPECIAL, VOCAB, seed=1).collate(ids, rng.random((4, 16)) < 0.7, np.arange(4))


def test_compiled_layers_equal_eager_values_and_gradients():
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = model(False), model(True)
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), compiled.state_dict().values()))
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # compiling renames nothing
    batch = collated(eager.views)
    results = []
    for m in (eager, compiled):
        loss, metrics = m(batch, sampling_seed=5)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    assert counters["stats"]["unique_graphs"] >= 1  # the compiled layers really ran
    (loss_e, grads_e), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads_e.keys()
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-4, atol=1e-6, msg=name)
