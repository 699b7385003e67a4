"""Building a `PretrainModel`: the one place it is constructed, for training and for conversion.

The training loop builds from the run config (`ModelConfig.encoder_config` decides the shape from
the preset, the overrides and the shards); conversion rebuilds the same model from a checkpoint's
`pipeline_meta.json`. Both go through `build_pretrain_model`, so the two can never disagree on
structure, initialisation order or objective options. A warm start (`model.init_from`) is the same
construction followed by copying the base model's BERT weights in (`pipeline.model.warm_start`), so
the objective heads get exactly the initial weights a run without it gives them.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np
import torch

from pipeline.monitor.health import unigram_log_probs
from pipeline.model.arch import AnyEncoderConfig, encoder_config_from_dict
from pipeline.pretrain.pretrainer import PretrainModel
from pipeline.objectives.base import SAMPLED_SOFTMAX
from pipeline.objectives.mlm_nce import LOG_PROPOSAL, log_proposal_samplers
from pipeline.objectives.registry import mlm_head_training
from pipeline.seeding import seed_init


def build_pretrain_model(encoder_config: AnyEncoderConfig, objectives: Mapping[str, float],
                         special_tokens: Mapping[str, int], objective_options: Mapping[str, Mapping[str, Any]],
                         seed: int = 0, kernels: str = "auto", init_from: Optional[str] = None,
                         attention: str = "auto", compile_layers: bool = False,
                         unigram_counts: Optional[np.ndarray] = None, mlm_bias_init: str = "zero",
                         activation_checkpointing: str = "none") -> PretrainModel:
    """A freshly initialised `PretrainModel` (initial weights from the `init` stream of `seed`); with
    `unigram_counts` [V] (the shards' token counts), its unigram-derived tensors are filled
    (`fill_unigram_tensors`: the NCE samplers' log q, and with `mlm_bias_init="unigram"`, i.e.
    `model.mlm_bias_init=unigram`, the vocabulary output biases); with `init_from`, its `bert.*` (and MLM
    head, when the checkpoint has one) then come from that Hugging Face BERT directory. `attention` /
    `compile_layers` / `activation_checkpointing` are `model.attention` / `model.compile` /
    `model.activation_checkpointing` (they change how the layers run, never the weights)."""
    if mlm_bias_init == "unigram" and unigram_counts is None:
        raise ValueError("mlm_bias_init='unigram' needs the shards' unigram_counts")
    seed_init(seed)
    model = PretrainModel(encoder_config, objectives, special_tokens, objective_options, seed=seed, kernels=kernels,
                          attention=attention, compile_layers=compile_layers,
                          activation_checkpointing=activation_checkpointing)
    if unigram_counts is not None:
        fill_unigram_tensors(model, unigram_counts, output_biases=mlm_bias_init == "unigram")
    if init_from:
        from pipeline.model.warm_start import load_base_weights

        load_base_weights(model, init_from)
    return model


def unigram_bias(counts: np.ndarray) -> torch.Tensor:
    """b_v = log p_v - mean_u log p_u with p_v = (c_v + 1) / sum_u (c_u + 1): the output bias whose
    softmax (with zero hidden contribution) is the add-one smoothed unigram distribution."""
    logp = unigram_log_probs(counts).numpy()
    return torch.from_numpy(logp - logp.mean()).float()


@torch.no_grad()
def set_output_biases(model: PretrainModel, bias: torch.Tensor) -> list[str]:
    """Copy `bias` [V] into every vocabulary output bias: the MLM head's (`cls.predictions.decoder.bias`)
    and any objective's own 1-D vocabulary-sized bias (COCO-LM's generator head). Returns their names."""
    vocab = model.config.vocab_size
    if bias.shape != (vocab,):
        raise ValueError(f"output bias of shape {tuple(bias.shape)} for a vocabulary of {vocab}")
    names = []
    for name, param in model.named_parameters():
        if name == "cls.predictions.decoder.bias" or (name.startswith("objectives.") and name.endswith(".bias")
                                                      and param.shape == (vocab,)):
            param.copy_(bias.to(param.dtype))
            names.append(name)
    return names


def context_free_head_bias(model: PretrainModel, log_p: torch.Tensor) -> torch.Tensor:
    """The MLM head's bias that is optimal when the hidden state says nothing: `log_p` (the shards'
    centred log unigram frequencies) for a head trained by a full softmax; log p - log q when every
    objective training the head (`Objective.mlm_head`, non-zero weight) uses sampled negatives from a
    proposal q and their samplers agree on it: the InfoNCE optimum s(v, c) = log p(v | c) - log q(v)
    + const(c) (Oord et al. 2018, Sec. 2.3; `mlm_nce`), i.e. 0 for the unigram pools (q = p) and
    log p for "uniform" negatives.

    Why it matters (issue 29): started at log p, a BERT-NCE head whose negatives follow the unigram
    counts every frequent token twice; its loss starts at 4.39 instead of the chance 2.83 (16
    negatives, the time-to-quality study's size) and the run spends its first ~60 steps unlearning the
    bias, mostly by turning every hidden state towards one direction that cancels it (held-out token
    cosine 0.26 at step 300 vs 0.12 started at the optimum, InfoWord with SpanBERT span replacement)."""
    training = [name for name, how in mlm_head_training(model.objectives).items() if model.weights.get(name, 1.0)]
    if not training or any(model.objectives[n].mlm_head != SAMPLED_SOFTMAX for n in training):
        return log_p
    log_q = [s.log_proposal for n in training for s in log_proposal_samplers(model.objectives[n]).values()]
    if not log_q or any(not torch.equal(q, log_q[0]) for q in log_q[1:]):
        return log_p  # no single proposal: no single optimum (export does not correct such a head either)
    return log_p - log_q[0]


@torch.no_grad()
def fill_unigram_tensors(model: PretrainModel, counts: np.ndarray, output_biases: bool) -> list[str]:
    """The one home for filling the model's tensors derived from the training shards' token counts
    (`pipeline.monitor.health.unigram_counts`), all from b = `unigram_bias(counts)`: every NCE sampler's
    `log_proposal` (log q: b for the unigram pools, zeros for "uniform"; `mlm_nce`) and, with
    `output_biases`, every vocabulary output bias (`set_output_biases`), each at its context-free
    optimum: b, except the MLM head when only sampled negatives train it (`context_free_head_bias`:
    b - log q). Returns the names filled."""
    bias = unigram_bias(counts)
    names = []
    for name, sampler in log_proposal_samplers(model).items():  # first: the head's optimum reads log q
        sampler.set_log_proposal(bias)
        names.append(f"{name}.{LOG_PROPOSAL}")
    if output_biases:
        names = set_output_biases(model, bias) + names
        model.cls.predictions.decoder.bias.copy_(context_free_head_bias(model, bias))
    return names


def model_from_meta(meta: Any) -> PretrainModel:
    """The training model a checkpoint's `RunMeta` describes (randomly initialised, on CPU).

    Conversion uses it to learn names, shapes and module structure before loading the weights;
    built on CPU rather than the `meta` device because objectives may compute real tensors in
    their constructors (e.g. sampling tables).
    """
    return build_pretrain_model(encoder_config_from_dict(meta.encoder_config), meta.objectives, meta.special_tokens,
                                meta.objective_options, seed=int(meta.config.get("train", {}).get("seed", 0)))
