"""No objective, alone or combined, reads device data on the host inside a micro-batch.

A read of device data on the host (`.item()`, `int(t)`, `.tolist()`, `nonzero`, `unique`,
`masked_select`, boolean-mask indexing, `bincount`, ...) makes the host wait for the device: the GPU
then idles while the host catches up. The collator builds every data-dependent index on the host
(`pipeline.data.batch`: `content_positions`, `span_widths`, the objectives' `host_plan` keys), so the step
needs none. `HostReads` counts such ops over a real collated micro-batch (forward + backward); the
counts are printed (`pytest -s`) next to those of the same batch without the collator's keys, which
is what the step had to read before the collator built them.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.data.batch import HOST_KEYS
from pipeline.data.corruption import CorruptionCollator
from pipeline.objectives.taco import PLAN_KEYS, anchor_mask, taco_candidates
from tests.objectives.conftest import SPECIAL, VOCAB, tiny_model

aten = torch.ops.aten
#: ops whose output size or value is a function of tensor data that the host must read
HOST_READS = {aten.nonzero, aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.masked_select,
              aten.bincount, aten.repeat_interleave, aten._unique, aten._unique2, aten.unique_dim,
              aten.unique_consecutive, aten.unique_dim_consecutive, aten.argwhere, aten.histc}
BOOL_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
#: ops that wrap numbers the host already has in a tensor (what `torch.from_numpy` / `torch.tensor` dispatch)
HOST_MADE = {aten.lift_fresh, aten.lift_fresh_copy}


class HostReads(TorchDispatchMode):
    """Records every op that reads tensor data back to the host, boolean-mask indexing and
    `Tensor.tolist` of device data included (`tolist` reads the data without dispatching an op, so it
    is wrapped). Device data: the batch's keys that move to the device (all but
    `pipeline.data.batch.HOST_KEYS`, which stay on the CPU in a GPU run too) and every tensor an op
    makes inside the step, except `HOST_MADE`'s: a tensor the step builds from host numbers
    (`torch.from_numpy` of the collator's `span_widths`: InfoWord's n-gram lengths) is host data, and
    reading it is no sync."""

    def __init__(self, batch=None) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.device_data = [v for k, v in (batch or {}).items() if k not in HOST_KEYS]  # held: ids stay unique
        self.device_ids = {id(t) for t in self.device_data}

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        seen, device_ids = self.seen, self.device_ids

        def tolist(t, *args, **kwargs):
            if id(t) in device_ids:
                seen.append("Tensor.tolist")
            return self._tolist(t, *args, **kwargs)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in HOST_READS:
            self.seen.append(str(packet))
        elif packet in BOOL_INDEXED and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                            for i in (args[1] or ())):
            self.seen.append(f"{packet}[bool mask]")
        out = func(*args, **(kwargs or {}))
        if packet in HOST_MADE:  # a tensor of host numbers (torch.from_numpy, torch.tensor): host data
            return out
        made = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.device_data += made
        self.device_ids.update(id(t) for t in made)
        return out


#: every objective, its options that change the sampling path, and the paper recipes' combinations
CASES = {
    "mlm": ({"mlm": 1.0}, {}),
    "mlm wwm": ({"mlm": 1.0}, {"mlm": {"view": "wwm_masked"}}),
    "mlm-nce": ({"mlm-nce": 1.0}, {}),
    "mlm-nce all": ({"mlm-nce": 1.0}, {"mlm-nce": {"num_negatives": "all"}}),
    "mlm-nce other_targets": ({"mlm-nce": 1.0}, {"mlm-nce": {"negatives": "other_targets"}}),
    "mlm-nce other_targets all": ({"mlm-nce": 1.0}, {"mlm-nce": {"negatives": "other_targets", "num_negatives": "all"}}),
    "mlm-nce batch": ({"mlm-nce": 1.0}, {"mlm-nce": {"negatives": "batch"}}),
    "mlm-nce batch all": ({"mlm-nce": 1.0}, {"mlm-nce": {"negatives": "batch", "num_negatives": "all"}}),
    "mlm-nce uniform all": ({"mlm-nce": 1.0}, {"mlm-nce": {"negatives": "uniform", "num_negatives": "all"}}),
    "taco": ({"mlm": 1.0, "taco": 1.0}, {}),
    "taco row masked anchors": ({"mlm": 1.0, "taco": 1.0}, {"taco": {"negative_unit": "row", "anchors": "masked"}}),
    "taco unmasked max_anchors": ({"mlm": 1.0, "taco": 1.0}, {"taco": {"anchors": "unmasked", "max_anchors": 7}}),
    "taco original": ({"taco": 1.0}, {"taco": {"view": "original"}}),
    "capt": ({"mlm": 1.0, "capt": 1.0}, {}),
    "cocolm": ({"cocolm": 1.0}, {}),
    "electra": ({"electra": 1.0}, {}),
    "infoword": ({"infoword": 1.0}, {}),
    "infoword all": ({"infoword": 1.0}, {"infoword": {"ngrams_per_sentence": "all", "num_negatives": "all"}}),
    # tiny-infoword's small-scale DIM (issue 29): mean-pooled, centred views
    "infoword mean centred": ({"infoword": 1.0}, {"infoword": {"ngrams_per_sentence": "all", "pool": "mean",
                                                               "center": True, "score": "cosine", "tau": 0.1}}),
    "cocolm + taco": ({"cocolm": 1.0, "taco": 0.5}, {}),
    "infoword + taco + capt": ({"infoword": 1.0, "taco": 1.0, "capt": 1.0}, {}),
    "mlm-nce span + taco wwm": ({"mlm-nce": 1.0, "taco": 1.0},
                                {"mlm-nce": {"view": "span_masked"}, "taco": {"view": "wwm_masked"}}),
}
#: host reads per micro-batch before the collator built the indices (commit f44949b, measured with this
#: module's `HostReads` and batch: benchmarks/results/fast_path/host_reads.md); the issue's TACO 10, InfoWord 8, BERT-NCE 2
BEFORE = {
    "mlm-nce": 2,
    "mlm-nce all": 3,
    "mlm-nce other_targets": 2,
    "mlm-nce other_targets all": 3,
    "mlm-nce batch": 1,
    "mlm-nce batch all": 3,
    "taco": 10,
    "taco row masked anchors": 13,
    "taco unmasked max_anchors": 10,
    "taco original": 10,
    "infoword": 8,
    "infoword all": 9,
    "cocolm + taco": 10,
    "infoword + taco + capt": 18,
    "mlm-nce span + taco wwm": 12,
}


def collated(model, batch_size=5, length=32, seed=0):
    """A real micro-batch: packed rows of several documents (inner [SEP]s), one short padded row."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(len(SPECIAL), VOCAB, size=(batch_size, length))
    ids[:, 0], ids[:, -1] = SPECIAL["cls"], SPECIAL["sep"]
    ids[:, length // 3] = SPECIAL["sep"]  # two documents per row
    ids[1, 2 * length // 3] = SPECIAL["sep"]  # three in one
    ids[-1, length // 2:] = SPECIAL["pad"]
    ids[-1, length // 2 - 1] = SPECIAL["sep"]
    collator = CorruptionCollator(model.views, SPECIAL, VOCAB, seed=1, plans=model.host_plans())
    return collator.collate(ids, rng.random((batch_size, length)) < 0.7, np.arange(batch_size))


def without_collator_keys(batch):
    """The batch as a hand-built one would be: no host index keys, no plan keys."""
    dropped = {"content_positions", "mlm_positions", "span_positions", *HOST_KEYS, *PLAN_KEYS}
    return {k: v for k, v in batch.items() if k not in dropped}


def step_reads(model, batch) -> tuple[list[str], torch.Tensor, dict]:
    with HostReads(batch) as reads:
        loss, metrics = model(batch, sampling_seed=11)
        loss.backward()
    return reads.seen, loss.detach(), metrics


@pytest.mark.parametrize("case", list(CASES))
def test_no_host_read_of_device_data_in_a_micro_batch(case):
    objectives, options = CASES[case]
    options = {**options, **({"capt": {"queue_size": 0}} if "capt" in objectives else {})}
    model = tiny_model(objectives, options)
    model.set_health_unigram(np.arange(VOCAB))  # the health metrics' unigram references, as a training run has
    batch = collated(model)
    model(batch, sampling_seed=3)  # first call: lazy initialisation is not the step
    model.zero_grad()
    reads, loss, metrics = step_reads(model, batch)
    bare_reads, _, _ = step_reads(tiny_model(objectives, options), without_collator_keys(batch))
    print(f"\n{case:28s} host reads per micro-batch: {len(reads)} with the collator's indices, "
          f"{len(bare_reads)} without ({dict(Counter(bare_reads))})"
          + (f"; {BEFORE[case]} before the collator built them (f44949b)" if case in BEFORE else ""))
    assert reads == [], reads
    assert torch.isfinite(loss)
    if "mlm_labels" in batch or "span_labels" in batch:  # the logged step's metric-only work was counted too
        assert {"health/unigram_accuracy", "health/unigram_entropy"} <= metrics.keys()
    if case in BEFORE:  # the objectives that used to read: without the collator's keys they still would
        assert len(bare_reads) > 0


@pytest.mark.parametrize("case", ["mlm-nce", "mlm-nce all", "mlm-nce other_targets", "taco", "taco row masked anchors",
                                  "taco unmasked max_anchors", "infoword", "infoword all", "infoword + taco + capt"])
def test_collator_indices_give_the_device_path_loss_and_gradients(case):
    """The host-built indices are the ones the device fallback finds: same loss, same gradients."""
    objectives, options = CASES[case]
    options = {**options, **({"capt": {"queue_size": 0}} if "capt" in objectives else {})}
    models = [tiny_model(objectives, options, dropout=0.0, attention_dropout=0.0) for _ in range(2)]
    batch = collated(models[0], seed=4)
    results = []
    for model, b in zip(models, (batch, without_collator_keys(batch))):
        loss, metrics = model(b, sampling_seed=5)
        loss.backward()
        results.append((loss.detach(), metrics, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, metrics, grads), (ref_loss, ref_metrics, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    for key in ref_metrics:
        torch.testing.assert_close(metrics[key], ref_metrics[key], rtol=1e-6, atol=1e-7, msg=key)
    assert grads.keys() == ref_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("options", [{}, {"negative_unit": "row", "anchors": "masked", "window": 7}])
def test_taco_plan_keys_equal_the_device_computation(options):
    model = tiny_model({"mlm": 1.0, "taco": 1.0}, {"taco": options})
    batch = collated(model, seed=2)
    taco = model.objectives["taco"]
    eligible, anchors = anchor_mask(batch, taco.anchor_set)
    expected = taco_candidates(eligible, anchors, taco.window, batch["document_ids"], taco.negative_unit)
    for key, value in expected.items():
        assert torch.equal(batch[key], value), key
    # an anchor is kept exactly when some eligible position of its document lies within the window
    flat = set(batch["taco_anchors"].tolist())
    length, half = eligible.shape[1], taco.window // 2
    docs = batch["document_ids"]
    for b, c in torch.nonzero(anchors).tolist():
        neighbours = [j for j in range(max(0, c - half), min(length, c + half + 1))
                      if j != c and eligible[b, j] and docs[b, j] == docs[b, c]]
        assert (b * length + c in flat) == bool(neighbours)
    assert int(batch["taco_unit_counts"].sum()) == int(eligible.sum())


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_no_device_sync_in_the_step_on_cuda(case):
    """What the CPU test infers, observed on a GPU: CUDA's sync debug mode raises on any
    synchronising call in forward + backward (fused kernels on; after one warm-up step)."""
    from pipeline.data.batch import move_batch

    objectives, options = CASES[case]
    options = {**options, **({"capt": {"queue_size": 0}} if "capt" in objectives else {})}
    model = tiny_model(objectives, options)
    model.set_health_unigram(np.arange(VOCAB))  # the health metrics' unigram references (entropy: a device gather)
    model = model.cuda()
    model.kernels = "auto"
    batch = {k: v.pin_memory() for k, v in collated(model).items()}
    model(move_batch(batch, torch.device("cuda")), sampling_seed=1)[0].backward()  # lazy init, kernel probes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _ = model(move_batch(batch, torch.device("cuda")), sampling_seed=1)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss)


def test_ngram_width_is_bucketed_and_never_wider_than_the_batch():
    from pipeline.objectives.infoword import NGRAM_WIDTH_BUCKET, ngram_width

    assert ngram_width(np.array([[3, 1], [0, 0]]), 64) == NGRAM_WIDTH_BUCKET  # 3 + 2 -> 8
    assert ngram_width(np.array([[7, 9]]), 64) == 16
    assert ngram_width(np.array([[20]]), 22) == 22  # a span filling the row: capped at the row's width
    assert ngram_width(np.zeros((2, 0), dtype=np.int64), 32) == NGRAM_WIDTH_BUCKET
