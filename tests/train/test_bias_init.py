"""The model's unigram-derived tensors (`pipeline.pretrain.build.fill_unigram_tensors`):
`model.mlm_bias_init=unigram` starts the vocabulary output biases at the shards' log unigram frequencies,
and the NCE objectives' log q (`log_proposal`) holds the same values for the whole run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.config.checks import ConfigError
from pipeline.train.run_config import check_run, load_config
from pipeline.data.reader import ShardDataset
from pipeline.monitor.health import unigram_counts
from pipeline.pretrain.build import unigram_bias
from pipeline.train.loop import build_run_model
from tests.train.runs import metric_rows, module_state, run_inprocess, tag_dir


def test_unigram_bias_is_the_centred_log_of_the_smoothed_frequencies():
    counts = np.array([0, 3, 1, 0, 6])
    bias = unigram_bias(counts)
    assert float(bias.mean()) == pytest.approx(0.0, abs=1e-6)
    expected = (counts + 1) / (counts + 1).sum()
    assert torch.softmax(bias, 0).numpy() == pytest.approx(expected, rel=1e-6)


def _cfg(shards, value: str):
    return load_config("tiny-cocolm", [f"data.shards_dir={shards}", f"model.mlm_bias_init={value}"])


def test_a_fresh_start_sets_every_vocabulary_bias_and_a_resume_does_not(tiny_shards_dir):
    cfg = _cfg(tiny_shards_dir, "unigram")
    plan = check_run(cfg, 1, False)
    expected = unigram_bias(unigram_counts(ShardDataset(tiny_shards_dir)))
    model = build_run_model(cfg, plan)
    assert torch.equal(model.cls.predictions.decoder.bias.detach(), expected)
    assert torch.equal(model.objectives["cocolm"].generator_head.bias.detach(), expected)  # COCO-LM's generator
    assert expected.std() > 1.0  # frequent and rare tokens far apart: not a no-op
    resumed = build_run_model(cfg, plan, warm_start=False)  # weights come from the checkpoint then
    assert not resumed.cls.predictions.decoder.bias.detach().any()
    default = build_run_model(_cfg(tiny_shards_dir, "zero"), plan)
    assert not default.cls.predictions.decoder.bias.detach().any()
    # everything else is the same initialisation (same init stream)
    assert torch.equal(default.bert.embeddings.word_embeddings.weight, model.bert.embeddings.word_embeddings.weight)


def test_an_unknown_value_is_a_config_error(tiny_shards_dir):
    with pytest.raises(ConfigError, match="model.mlm_bias_init='log'"):
        _cfg(tiny_shards_dir, "log")


def test_nce_log_q_is_the_shards_log_unigram_frequency_and_no_output_bias(tiny_shards_dir):
    expected = unigram_bias(unigram_counts(ShardDataset(tiny_shards_dir)))
    cfg = load_config("tiny-infoword", [f"data.shards_dir={tiny_shards_dir}"])
    plan = check_run(cfg, 1, False)
    for warm_start in (True, False):  # resuming, the checkpoint's value replaces it (below); older ones have none
        model = build_run_model(cfg, plan, warm_start=warm_start)
        assert torch.equal(model.objectives["infoword"].sampler.log_proposal, expected)
        assert not model.cls.predictions.decoder.bias.detach().any()  # model.mlm_bias_init=zero still holds


def test_nce_log_q_is_set_at_a_fresh_start_and_the_same_after_a_resume(tiny_shards_dir, tmp_path):
    """A fresh 2-step `mlm-nce` run checkpoints log q = unigram_bias(unigram_counts(shards)); a run
    resumed from its step 1 writes the same at step 2 (and repeats step 2 bit for bit)."""
    steps = ["train.total_steps=2", "optim.warmup_steps=1", "train.checkpoint_every=1", "train.keep_last=2"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert run_inprocess("tiny-mlm-nce", tiny_shards_dir, full, *steps) == 0
    assert run_inprocess("tiny-mlm-nce", tiny_shards_dir, resumed, *steps, f"train.resume={tag_dir(full, 1)}") == 0
    expected = unigram_bias(unigram_counts(ShardDataset(tiny_shards_dir)))
    key = "objectives.mlm-nce.sampler.log_proposal"
    for tag in (tag_dir(full, 1), tag_dir(full, 2), tag_dir(resumed, 2)):
        saved = module_state(tag)[key]
        assert saved.dtype == torch.float32 and torch.equal(saved, expected), tag
    assert metric_rows(resumed)[2] == metric_rows(full)[2]


@pytest.mark.parametrize("preset, extra, expect", [
    ("tiny-mlm-nce", [], "zero"),  # unigram negatives: q = p, log p - log q = 0
    ("tiny-infoword", [], "zero"),
    ("tiny-mlm-nce", ["objective_options.mlm-nce.negatives=uniform"], "log_p"),  # log q = 0
    ("tiny-mlm-nce", ["objectives.mlm=1.0"], "log_p"),  # a full softmax trains the head too: its optimum
])
def test_unigram_init_of_a_sampled_softmax_head_is_its_context_free_optimum(tiny_shards_dir, preset, extra, expect):
    """`model.mlm_bias_init=unigram` starts the MLM head where its loss is least with no context: log p for a
    full softmax, log p - log q for a head only sampled negatives train (`context_free_head_bias`)."""
    cfg = load_config(preset, [f"data.shards_dir={tiny_shards_dir}", "model.mlm_bias_init=unigram", *extra])
    model = build_run_model(cfg, check_run(cfg, 1, False))
    log_p = unigram_bias(unigram_counts(ShardDataset(tiny_shards_dir)))
    head = model.cls.predictions.decoder.bias.detach()
    assert torch.equal(head, torch.zeros_like(log_p) if expect == "zero" else log_p)
    for sampler in (o.sampler for o in model.objectives.values() if hasattr(o, "sampler")):
        assert torch.equal(sampler.log_proposal, log_p if sampler.proposal == "unigram" else torch.zeros_like(log_p))
