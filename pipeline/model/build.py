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

from pipeline.model.encoder import EncoderConfig
from pipeline.model.pretrainer import PretrainModel
from pipeline.seeding import seed_init


def build_pretrain_model(encoder_config: EncoderConfig, objectives: Mapping[str, float],
                         special_tokens: Mapping[str, int], objective_options: Mapping[str, Mapping[str, Any]],
                         seed: int = 0, kernels: str = "auto", init_from: Optional[str] = None,
                         attention: str = "auto", compile_layers: bool = False) -> PretrainModel:
    """A freshly initialised `PretrainModel` (initial weights from the `init` stream of `seed`); with
    `init_from`, its `bert.*` (and MLM head, when the checkpoint has one) then come from that Hugging
    Face BERT directory. `attention` / `compile_layers` are `model.attention` / `model.compile` (they
    change how the layers run, never the weights)."""
    seed_init(seed)
    model = PretrainModel(encoder_config, objectives, special_tokens, objective_options, seed=seed, kernels=kernels,
                          attention=attention, compile_layers=compile_layers)
    if init_from:
        from pipeline.model.warm_start import load_base_weights

        load_base_weights(model, init_from)
    return model


def model_from_meta(meta: Any) -> PretrainModel:
    """The training model a checkpoint's `RunMeta` describes (randomly initialised, on CPU).

    Conversion uses it to learn names, shapes and module structure before loading the weights;
    built on CPU rather than the `meta` device because objectives may compute real tensors in
    their constructors (e.g. sampling tables).
    """
    return build_pretrain_model(EncoderConfig(**meta.encoder_config), meta.objectives, meta.special_tokens,
                                meta.objective_options, seed=int(meta.config.get("train", {}).get("seed", 0)))
