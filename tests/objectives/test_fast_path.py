"""The GPU fast path's objective-side promises, checked on the CPU: MLM's accuracy comes from the
loss's own logits (one vocabulary projection), COCO-LM samples its replacements exactly and in
vocabulary chunks, and neither objective reads device data on the host (no `nonzero`, `.item()`,
...: each would make the host wait for the device inside the step)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.data.corruption import CorruptionCollator
from pipeline.model.encoder import configure_layer_stacks
from pipeline.kernels import functional
from pipeline.objectives.base import StepProgress
from pipeline.objectives.cocolm import gumbel_max_sample
from tests.objectives.conftest import SPECIAL, VOCAB, tiny_model

aten = torch.ops.aten
#: ops whose result size or value the host must read from the tensor's data
HOST_READS = {aten.nonzero, aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.masked_select,
              aten.bincount, aten.repeat_interleave, aten._unique2, aten.unique_consecutive, aten.argwhere}


class HostReads(TorchDispatchMode):
    """Records every op that reads tensor data back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in HOST_READS:
            self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def collated(model, batch_size=4, length=24, seed=0, short_last_row=False):
    rng = np.random.default_rng(seed)
    ids = rng.integers(len(SPECIAL), VOCAB, size=(batch_size, length))
    ids[:, 0], ids[:, -1] = SPECIAL["cls"], SPECIAL["sep"]
    if short_last_row:  # the end of a shard set: the one padded row packed data can have
        ids[-1, length // 2:] = SPECIAL["pad"]
        ids[-1, length // 2 - 1] = SPECIAL["sep"]
    collator = CorruptionCollator(model.views, SPECIAL, VOCAB, seed=1)
    return collator.collate(ids, rng.random((batch_size, length)) < 0.7, np.arange(batch_size))


@pytest.mark.parametrize("name", ["mlm", "cocolm", "electra"])
def test_no_host_reads_of_device_data_in_the_step(name):
    model = tiny_model({name: 1.0})
    batch = collated(model)
    with HostReads() as reads:
        loss, metrics = model(batch, sampling_seed=11)
        loss.backward()
    assert reads.seen == [], reads.seen
    assert torch.isfinite(loss)
    # without the collator's host-side keys the same step has to look at device data
    bare = {k: v for k, v in batch.items() if not k.endswith(("_positions", "seqlens"))}
    with HostReads() as reads:
        model(bare, sampling_seed=11)
    assert "aten.nonzero" in reads.seen


@pytest.mark.parametrize("name", ["mlm", "taco", "capt", "cocolm", "electra", "infoword"])
def test_unpadded_attention_gives_every_objective_the_reference_loss_and_gradients(name):
    """A padded batch through every objective: `model.attention=varlen` (layers on the real tokens
    only, the CPU stand-in for the flash varlen kernel) against the masked reference."""
    options = {"capt": {"queue_size": 0}, "infoword": {"num_negatives": 16}}
    models = [tiny_model({name: 1.0}, options, dropout=0.0, attention_dropout=0.0) for _ in range(2)]
    configure_layer_stacks(models[0], "masked")
    configure_layer_stacks(models[1], "varlen")
    batch = collated(models[0], batch_size=5, seed=6, short_last_row=True)
    assert batch["seqlens"].tolist() == [24, 24, 24, 24, 12]
    passes = []
    models[1].bert.encoder.register_forward_hook(lambda stack, args, out: passes.append(stack.last_work[0]))
    results = []
    for model in models:
        loss, _ = model(batch, sampling_seed=3)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[key], rtol=1e-4, atol=1e-6, msg=key)
    assert 4 * 24 + 12 in passes  # a pass of the original-length views ran on the real tokens only


def test_mlm_accuracy_comes_from_the_loss_logits(monkeypatch):
    model = tiny_model({"mlm": 1.0})
    batch = collated(model, seed=2)
    projections = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: (w.shape[0] == VOCAB and projections.append(x.shape[0]))
                        or real(x, w, b))
    _, metrics = model(batch, sampling_seed=1)
    selected = int((batch["mlm_labels"] != -100).sum())
    assert projections == [selected]  # one projection of the selected rows: loss and accuracy share it
    with torch.no_grad():
        hidden = model.bert(batch["masked_ids"], batch["attention_mask"]).last_hidden
        keep = batch["mlm_labels"] != -100
        logits = model.cls(hidden[keep])
    expected = (logits.argmax(-1) == batch["mlm_labels"][keep]).float().mean()
    assert metrics["mlm/accuracy"] == pytest.approx(float(expected))


def test_reference_accuracy_op_counts_ignored_rows_out_and_takes_the_first_maximum():
    h = torch.eye(4)
    w = torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.0]])
    targets = torch.tensor([1, 2, 3, -100])  # row 0 ties columns 0 and 1: argmax is 0, so wrong
    loss, acc = functional.linear_cross_entropy_with_accuracy(h, w, None, targets)
    assert acc.item() == pytest.approx(2 / 3)
    assert loss.item() == pytest.approx(functional.linear_cross_entropy(h, w, None, targets).item())
    _, none = functional.linear_cross_entropy_with_accuracy(h, w, None, torch.full((4,), -100))
    assert none.item() == 0.0


def test_gumbel_max_sampling_is_an_exact_softmax_sample_in_chunks():
    """Chi-square goodness of fit of 60k draws from chunks of 3 columns against softmax(z)."""
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = torch.randn(1, 6, generator=g), torch.randn(10, 6, generator=g), torch.randn(10, generator=g)
    rows = 60_000
    samples, top = gumbel_max_sample(hidden.expand(rows, 6), weight, bias, torch.Generator().manual_seed(1), chunk=3)
    probs = torch.softmax(F.linear(hidden, weight, bias)[0].double(), -1)
    counts = torch.bincount(samples, minlength=10).double()
    chi2 = float(((counts - rows * probs) ** 2 / (rows * probs)).sum())
    assert chi2 < 27.9, chi2  # 9 degrees of freedom: p = 0.001
    assert (top == F.linear(hidden, weight, bias).argmax(-1)).all()
    again, _ = gumbel_max_sample(hidden.expand(rows, 6), weight, bias, torch.Generator().manual_seed(1), chunk=3)
    assert torch.equal(samples, again)  # the same stream gives the same draws
    other, _ = gumbel_max_sample(hidden.expand(rows, 6), weight, bias, torch.Generator().manual_seed(2), chunk=3)
    assert not torch.equal(samples, other)


def test_gumbel_max_sampling_at_a_temperature_samples_softmax_of_z_over_t():
    """T = 2 (COCO-LM's `sample_temperature`): the draws fit softmax(z / 2), not softmax(z); the
    returned argmax is still that of z."""
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = torch.randn(1, 6, generator=g), torch.randn(10, 6, generator=g) * 2, torch.randn(10, generator=g)
    rows = 60_000
    z = F.linear(hidden, weight, bias)[0].double()
    samples, top = gumbel_max_sample(hidden.expand(rows, 6), weight, bias, torch.Generator().manual_seed(1), chunk=3,
                                     temperature=2.0)
    counts = torch.bincount(samples, minlength=10).double()

    def chi2(probs):
        return float(((counts - rows * probs) ** 2 / (rows * probs)).sum())

    assert chi2(torch.softmax(z / 2, -1)) < 27.9  # 9 degrees of freedom: p = 0.001
    assert chi2(torch.softmax(z, -1)) > 1000  # and clearly not the T = 1 distribution
    assert (top == z.argmax()).all()


def test_cocolm_sampling_never_holds_more_than_a_chunk_of_logits(monkeypatch):
    import pipeline.objectives.cocolm as cocolm

    monkeypatch.setattr(cocolm, "SAMPLE_CHUNK", 40)  # the 97-word vocabulary in chunks of 40, 40, 17
    widths = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: widths.append(w.shape[0]) or real_linear(x, w, b))
    model = tiny_model({"cocolm": 1.0})
    batch = collated(model, seed=3)
    model(batch, StepProgress(record_metrics=False), sampling_seed=4)
    assert [w for w in widths if w in (40, 17)] == [40, 40, 17]
    assert widths.count(VOCAB) == 2  # only the generator's and the main model's losses see every column
    widths.clear()
    model(batch, StepProgress(record_metrics=True), sampling_seed=4)
    # a logged step adds one no-grad pass over the masked positions: `clm_softmax_ce`, the corrective
    # LM's softmax alone (a learning signal); the sampling still holds one chunk at a time
    assert [w for w in widths if w in (40, 17)] == [40, 40, 17] and widths.count(VOCAB) == 3


def test_copy_loss_mask_equals_the_gathered_mean():
    g = torch.Generator().manual_seed(5)
    logits, original = torch.randn(30, generator=g), torch.rand(30, generator=g) < 0.8
    keep = torch.rand(30, generator=g) < 0.6
    masked = functional.copy_loss(logits, original, keep)
    gathered = functional.copy_loss(logits[keep], original[keep])
    assert masked.item() == pytest.approx(gathered.item(), rel=1e-6)
    assert math.isclose(functional.copy_loss(logits, original, torch.zeros(30)).item(), 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mlm", "cocolm", "electra"])
def test_no_device_sync_in_the_step_on_cuda(name):
    """What the CPU test above infers, observed: CUDA's sync debug mode raises on any synchronising
    call during a forward + backward with the fused kernels (after one warm-up step)."""
    from pipeline.data.batch import move_batch

    model = tiny_model({name: 1.0}).cuda()
    model.kernels = "auto"
    batch = move_batch(collated(model), torch.device("cuda"))
    model(batch, sampling_seed=1)[0].backward()  # lazy initialisation, allocator, kernel probes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _ = model(batch, sampling_seed=1)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss)
