"""FLOPs formula against torch's own FLOP counter, the MFU peak table, and the metrics files."""
from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pipeline.train.metrics import (FlopCounter, MetricsWriter, layer_forward_flops, mlm_step_flops, peak_flops,
                                    read_jsonl)
from pipeline.model.encoder import build_encoder_config
from pipeline.pretrain.pretrainer import PretrainModel
from tests.fixtures_data import make_batch
from tests.train.runs import run_inprocess


def tiny_model(shards_dir, objectives, options=None):
    manifest = json.loads((shards_dir / "manifest.json").read_text())
    cfg = build_encoder_config("tiny", vocab_size=manifest["vocab_size"], max_position=manifest["seq_len"])
    torch.manual_seed(0)
    return PretrainModel(cfg, objectives, manifest["special_tokens"], options or {})


def test_layer_formula():
    # Megatron: 24 B s h^2 + 4 B s^2 h for f = 4h.
    assert layer_forward_flops(2, 16, 64, 256) == 24 * 2 * 16 * 64**2 + 4 * 2 * 16**2 * 64


@pytest.mark.parametrize("objectives, options, views", [
    ({"mlm": 1.0}, {"mlm": {"track_accuracy": False}}, ("masked",)),
    ({"mlm": 1.0}, {"mlm": {"track_accuracy": True}}, ("masked",)),  # accuracy costs no extra projection
    ({"mlm-nce": 1.0}, {"mlm-nce": {"track_accuracy": False, "num_negatives": 16}}, ("masked",)),
])
def test_counted_forward_flops_match_torch(tiny_shards_dir, objectives, options, views):
    """No-grad forward: the hooks' formula equals torch's count of every matmul that ran (MLM head
    on the selected rows only, its accuracy from the same logits; a sampled softmax scores K+1 rows
    of the vocabulary)."""
    model = tiny_model(tiny_shards_dir, objectives, options)
    batch = make_batch(tiny_shards_dir, views=views, batch_size=4)
    counter = FlopCounter(model)
    with torch.no_grad(), FlopCounterMode(display=False) as reference:
        model(batch)
    assert counter.pop() == pytest.approx(reference.get_total_flops(), rel=1e-9)
    model(batch)  # with gradients: every counted pass costs 3x its forward
    with torch.no_grad():
        model(batch)
    assert counter.pop() == pytest.approx(4 * reference.get_total_flops(), rel=1e-9)
    counter.remove()


def test_mlm_step_formula_is_what_the_counter_counts(tiny_shards_dir):
    """`mlm_step_flops` (the formula printed next to the benchmark table, applied to the Hugging
    Face baseline) equals the counter's training count of one MLM micro-batch of our model."""
    model = tiny_model(tiny_shards_dir, {"mlm": 1.0})
    batch = make_batch(tiny_shards_dir, views=("masked",), batch_size=4)
    counter = FlopCounter(model)
    model(batch)[0].backward()
    b, s = batch["input_ids"].shape
    predicted = int((batch["mlm_labels"] != -100).sum())
    vocab = model.config.vocab_size
    assert counter.pop() == pytest.approx(mlm_step_flops(b, s, 64, 128, 2, predicted, vocab), rel=1e-12)


def test_extra_passes_are_counted(tiny_shards_dir):
    """CAPT encodes the original and the masked view: twice MLM's encoder FLOPs."""
    batch = make_batch(tiny_shards_dir, views=("masked",), batch_size=4)
    flops = {}
    for name, objectives in {"mlm": {"mlm": 1.0}, "capt": {"mlm": 1.0, "capt": 1.0}}.items():
        model = tiny_model(tiny_shards_dir, objectives)
        counter = FlopCounter(model)
        with torch.no_grad():
            model(batch)
        flops[name] = counter.pop()
    b, s = batch["input_ids"].shape
    encoder = 2 * layer_forward_flops(b, s, 64, 128)
    assert flops["capt"] - flops["mlm"] == pytest.approx(encoder)


def test_peak_table():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32", tf32=True) == 156e12
    assert peak_flops("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 on V100
    assert peak_flops("cpu", "fp32") is None


def test_metrics_file_is_cut_back_on_resume(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=True, resume_step=0, tensorboard=False)
    for step in range(1, 6):
        writer.write(step, {"loss": float(step)})
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 6, "lo')  # killed mid-line
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    MetricsWriter(tmp_path, enabled=True, resume_step=3, tensorboard=False).close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_logged_keys_and_tensorboard(tiny_shards_dir, tmp_path):
    out = tmp_path / "run"
    assert run_inprocess("tiny-capt", tiny_shards_dir, out, "train.total_steps=3", "train.tensorboard=true") == 0
    record = read_jsonl(out / "metrics.jsonl")[-1]
    expected = {"step", "loss", "mlm/loss", "capt/loss", "capt/tau", "lr", "grad_norm", "tokens_per_s",
                "samples_per_s", "step_time_s", "tflops_per_device", "peak_rss_gb", "consumed_samples",
                "tokens_seen", "skipped_steps", "nonfinite_steps", "capt/positive_cosine", "health/token_cosine",
                "health/unigram_accuracy", "health/collapsed"}
    assert expected <= set(record)
    assert 0.0 < record["health/token_cosine"] < 1.0 and 0.0 <= record["health/unigram_accuracy"] < 1.0
    assert record["health/collapsed"] in (0.0, 1.0)
    assert "mfu" not in record  # no peak FLOPs on CPU
    assert record["consumed_samples"] == 24 and record["tokens_seen"] > 0 and record["tflops_per_device"] > 0
    # the total is the weighted sum of the logged (unweighted) terms: tiny-capt weighs CAPT 0.1
    assert record["loss"] == pytest.approx(record["mlm/loss"] + 0.1 * record["capt/loss"], rel=1e-6)
    assert list((out / "tb").glob("events.out.tfevents.*"))
