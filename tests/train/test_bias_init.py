"""`model.mlm_bias_init=unigram`: the vocabulary output biases start at the shards' log unigram frequencies."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.config.checks import ConfigError
from pipeline.config.run import check_run, load_config
from pipeline.data.reader import ShardDataset
from pipeline.eval.health import unigram_counts
from pipeline.model.build import unigram_bias
from pipeline.train.loop import build_run_model


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
