"""`model.compile=true` compiles every pass — dense, masked (padded views, InfoWord's n-gram rows)
and varlen — with each shape class in its own dynamo cache, gives the eager values and gradients,
and recompiles no function more than twice over a run whose batches change shape (a padded row
every few batches, so the crop width and the padded/varlen passes vary); a function dynamo gives
up on is reported as a warning in the run's log."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import pipeline.model.encoder as encoder
from pipeline.data.corruption import CorruptionCollator
from pipeline.model import compile_watch
from pipeline.pretrain.build import build_pretrain_model
from pipeline.model.encoder import build_encoder_config
from tests.model.rounding import gradient_bound

SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
VOCAB, LENGTH = 71, 32
OPTIONS = {"cocolm": {"generator_layers": 1}, "capt": {"queue_size": 0}, "infoword": {"num_negatives": 8},
           "taco": {"num_negatives": 8}}
STEPS = {"dense": encoder._dense_step, "masked": encoder._masked_step, "varlen": encoder._varlen_step}


def make_model(objectives, compile_layers, attention="auto"):
    cfg = build_encoder_config("tiny", vocab_size=VOCAB, max_position=LENGTH, dropout=0.0, attention_dropout=0.0)
    return build_pretrain_model(cfg, objectives, SPECIAL, {k: v for k, v in OPTIONS.items() if k in objectives},
                                seed=3, kernels="torch", compile_layers=compile_layers, attention=attention)


def batches(model, count, seed=0):
    """Real collated micro-batches; every third has a padded last row of a random length."""
    rng = np.random.default_rng(seed)
    collator = CorruptionCollator(model.views, SPECIAL, VOCAB, seed=1, plans=model.host_plans())
    for step in range(count):
        ids = rng.integers(5, VOCAB, size=(4, LENGTH))
        ids[:, 0], ids[:, -1] = SPECIAL["cls"], SPECIAL["sep"]
        if step % 3 == 1:
            n = int(rng.integers(8, LENGTH - 2))
            ids[-1, n:] = SPECIAL["pad"]
            ids[-1, n - 1] = SPECIAL["sep"]
        yield collator.collate(ids, rng.random((4, LENGTH)) < 0.7, np.arange(4) + 4 * step)


def cache_entries() -> dict[str, int]:
    return {name: len(_debug_get_cache_entry_list(fn.__code__)) for name, fn in STEPS.items()}


@pytest.mark.parametrize("objectives, attention, steps", [
    ({"mlm": 1.0, "taco": 1.0}, "auto", 30),
    ({"cocolm": 1.0}, "auto", 200),  # the run length: COCO-LM used to recompile 5 times in 20 steps
    ({"cocolm": 1.0}, "varlen", 30),
    ({"electra": 1.0}, "varlen", 30),
    ({"mlm": 1.0, "capt": 1.0}, "varlen", 30),
    ({"infoword": 1.0}, "auto", 30),
    ({"mlm-nce": 1.0}, "auto", 30),
])
def test_no_compiled_function_recompiles_more_than_twice(objectives, attention, steps, caplog):
    torch._dynamo.reset()
    compile_watch.eager_fallbacks.clear()
    model = make_model(objectives, True, attention)
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        for step, batch in enumerate(batches(model, steps)):
            loss, _ = model(batch, sampling_seed=step)
            loss.backward()
    entries = cache_entries()
    print(f"\n{sorted(objectives)} attention={attention}: compiled graphs per shape class {entries}")
    assert sum(entries.values()) >= 1  # something was compiled
    assert all(n <= 3 for n in entries.values()), entries  # <= 2 recompiles per function
    assert compile_watch.eager_fallbacks == {} and "gave up" not in caplog.text


@pytest.mark.parametrize("objectives, attention", [({"infoword": 1.0}, "auto"), ({"cocolm": 1.0}, "varlen"),
                                                   ({"electra": 1.0}, "varlen")])
def test_compiled_masked_and_varlen_passes_equal_eager(objectives, attention):
    torch._dynamo.reset()
    eager, compiled = make_model(objectives, False, attention), make_model(objectives, True, attention)
    reference = make_model(objectives, False, attention).double()  # the same init (seed 3), float64 weights
    for step, batch in enumerate(batches(eager, 3, seed=5)):
        results = []
        for model in (eager, compiled, reference):
            model.zero_grad()
            loss, _ = model(batch, sampling_seed=step)
            loss.backward()
            results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        (loss_e, grads_e), (loss_c, grads_c), (_, grads_64) = results
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
        tokens = int(batch["attention_mask"].numel())  # the reduction behind every weight's gradient
        for name, grad in grads_e.items():
            bound = gradient_bound(grad, grads_64[name], tokens)
            # Normwise floor (Higham Sec. 3.5): on a 2-core CPU host, inductor's fused LayerNorm backward of
            # the last layer's output norm lies 2.4e-3 (relative, in norm) from float64 where eager lies 2.6e-4
            # (measured: infoword, masked path, seed 5); elementwise that exceeds the rounding bound, which
            # assumes terms of the result's size, while this sum cancels. 5e-3 still fails a wrong gradient.
            normwise = float((grads_c[name] - grad).norm()) <= 5e-3 * float(grads_64[name].norm())
            assert float((grads_c[name] - grad).abs().max()) <= bound or normwise, (name, bound)
    entries = cache_entries()
    assert entries["masked" if attention == "auto" else "varlen"] >= 1  # those passes really ran compiled


def test_a_function_dynamo_gives_up_on_is_a_warning_in_the_run_log(caplog):
    torch._dynamo.reset()
    compile_watch.eager_fallbacks.clear()
    model = make_model({"cocolm": 1.0}, True)
    # dynamo's own patcher, not monkeypatch: pytest 9's undo deletes the attribute from torch's config
    # module, leaving `recompile_limit` unreadable for every later compiled test (issue 42);
    # automatic_dynamic_shapes off: every width is a new graph
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False), \
            caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        for step, batch in enumerate(batches(model, 6)):
            model(batch, sampling_seed=step)[0].backward()
    torch._dynamo.reset()  # the graphs compiled under the patch hold its guards
    assert compile_watch.eager_fallbacks, "dynamo never hit the limit: the test did not test anything"
    assert "model.compile: torch.compile gave up on '_dense_step'" in caplog.text
    assert caplog.text.count("gave up on '_dense_step'") == 1  # once per function
