"""InfoWord's n-gram pass on the GPU path, checked on the CPU (issue 55's InfoWord rows: 0.44x MLM's
MFU at L=128 with a 233% step-time spread on the first lease; the failing `pytest -m gpu` case).

* Every span taken (`ngrams_per_sentence: all`, the presets'): the host knows each n-gram row's
  length from the collator's `span_widths`, so the pass goes to the encoder with `seqlens` and runs
  unpadded (varlen) where flash attention exists - the same values as the padded masked pass, and
  its FLOPs count only the real tokens.
* Fewer spans taken (sampled on the device): a masked pass whose shape changes every micro-batch;
  SDPA may not use cuDNN's attention there (a graph per new shape), and gets the same values.
* `span_widths` that is not a host tensor (a batch moved to the device key by key, as the GPU test
  did) is computed again from `span_index` instead of failing on `.numpy()`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import pipeline.model.encoder as encoder_module
from pipeline.data.corruption import CorruptionCollator
from pipeline.model.encoder import configure_layer_stacks
from tests.objectives.conftest import SPECIAL, VOCAB, tiny_model

ALL = {"infoword": {"ngrams_per_sentence": "all", "num_negatives": 16}}
ONE = {"infoword": {"ngrams_per_sentence": 1, "num_negatives": 16}}


def collated(model, batch_size=6, length=32, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(len(SPECIAL), VOCAB, size=(batch_size, length))
    ids[:, 0], ids[:, -1] = SPECIAL["cls"], SPECIAL["sep"]
    collator = CorruptionCollator(model.views, SPECIAL, VOCAB, seed=1, span_mean=2.0, span_max_words=4)
    return collator.collate(ids, rng.random((batch_size, length)) < 0.7, np.arange(batch_size))


def recorded_plans(monkeypatch) -> list:
    """Every attention plan the BERT layer stack makes, in call order."""
    plans = []
    plan = encoder_module.plan_attention

    def recording(*args, **kwargs):
        plans.append(plan(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(encoder_module, "plan_attention", recording)
    return plans


def loss_and_grads(model, batch):
    model.zero_grad()
    loss, metrics = model(batch, sampling_seed=3)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, metrics


def test_every_span_taken_runs_the_ngram_pass_unpadded_with_the_padded_pass_values(monkeypatch):
    model = tiny_model({"infoword": 1.0}, ALL, dropout=0.0, attention_dropout=0.0)
    batch = collated(model)
    widths = batch["span_widths"].numpy()
    plans = recorded_plans(monkeypatch)
    configure_layer_stacks(model, attention="varlen")  # the CPU's stand-in for flash varlen: same contract
    varlen_loss, varlen_grads, metrics = loss_and_grads(model, batch)
    sentence, ngram = plans
    assert sentence.kind == "dense" and ngram.kind == "varlen"
    assert ngram.tokens == int((widths[widths > 0] + 2).sum()) == model.bert.encoder.last_work[0]  # real tokens only
    assert metrics["infoword/dim_pairs"].item() == int((widths > 0).sum())
    configure_layer_stacks(model, attention="masked")  # the padded reference path
    masked_loss, masked_grads, _ = loss_and_grads(model, batch)
    assert plans[-1].kind == "masked" and plans[-1].tokens > ngram.tokens
    torch.testing.assert_close(varlen_loss, masked_loss, rtol=1e-5, atol=1e-6)
    assert varlen_grads.keys() == masked_grads.keys()
    for name, grad in varlen_grads.items():
        torch.testing.assert_close(grad, masked_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_sampled_ngram_pass_keeps_cudnn_attention_out_and_its_values(monkeypatch):
    """ngrams_per_sentence 1: the device picks the spans, so the host knows no lengths; the masked pass's
    shape is not fixed: cuDNN's SDPA is off inside it (and only there), the values do not change."""
    model = tiny_model({"infoword": 1.0}, ONE, dropout=0.0, attention_dropout=0.0)
    batch = collated(model, seed=1)
    plans = recorded_plans(monkeypatch)
    flags = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        flags.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    loss, grads, _ = loss_and_grads(model, batch)
    layers = len(model.bert.encoder.layer)
    assert [p.kind for p in plans] == ["dense", "masked"] and plans[1].static is False
    assert flags == [True] * layers + [False] * layers
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the pass
    monkeypatch.setattr(encoder_module, "attention_backends", lambda plan: torch.enable_grad())  # no backend choice
    again, again_grads, _ = loss_and_grads(model, batch)
    torch.testing.assert_close(again, loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(again_grads[name], grad, rtol=0, atol=0)


@pytest.mark.parametrize("options", [ALL, ONE], ids=["all", "one"])
def test_span_widths_off_the_host_are_computed_again_from_span_index(options):
    """A batch moved to the device key by key (host keys included) has `span_widths` on the device;
    `.numpy()` of it fails there (the GPU test's failure on the first lease). The meta device stands in
    for CUDA: its tensors cannot be read on the host either."""
    model = tiny_model({"infoword": 1.0}, options, dropout=0.0, attention_dropout=0.0)
    batch = collated(model, seed=2)
    expected, _, expected_metrics = loss_and_grads(model, batch)
    moved = {**batch, "span_widths": batch["span_widths"].to("meta")}
    loss, _, metrics = loss_and_grads(model, moved)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    assert metrics["infoword/dim_pairs"].item() == expected_metrics["infoword/dim_pairs"].item() > 0


@pytest.mark.gpu
def test_the_unpadded_ngram_pass_on_cuda_under_bf16_matches_the_padded_one():
    """On the GPU the n-gram pass of `all` takes flash varlen attention (auto), the padded masked pass
    the memory-efficient kernel; under bf16 autocast their losses agree to bf16 rounding."""
    from pipeline.data.batch import move_batch

    model = tiny_model({"infoword": 1.0}, ALL, dropout=0.0, attention_dropout=0.0).cuda()
    batch = move_batch(collated(model, seed=4), torch.device("cuda"))
    losses = {}
    for mode in ("auto", "masked"):
        configure_layer_stacks(model, attention=mode)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, grads, _ = loss_and_grads(model, batch)
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
        losses[mode] = loss
    torch.testing.assert_close(losses["auto"], losses["masked"], rtol=2e-2, atol=2e-2)
