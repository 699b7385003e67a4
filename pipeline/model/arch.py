"""`model.arch`: which encoder family a config describes, and the one place that dispatches on it.

Two families: `bert` (`pipeline.model.encoder`, the 2018 architecture) and `modernbert`
(`pipeline.model.modernbert`). Both expose the same interface to the objectives (an encoder called
as `encoder(ids, mask, seqlens=...)` returning `EncoderOutput(h, e)`, its `embeddings(ids)`, a head
called as `head(hidden, fn, *args)` with a tied `predictions.decoder`, and a layer stack
`stack(e, mask, seqlens)` for generators), so no objective has per-architecture code: they ask this
module for what differs. A checkpoint's `pipeline_meta.json` stores the config as a dict; the
`arch` key (absent in BERT runs, which predate it) says which dataclass it is.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Union

from torch import nn

from pipeline.model.encoder import BertEncoder, BertLayerStack, EncoderConfig, configure_layer_stacks, init_bert_weights
from pipeline.model.heads import MLMHead
from pipeline.model.modernbert import (ARCH as MODERNBERT, ModernBertConfig, ModernBertEncoder, ModernBertLayerStack,
                                       ModernBertMLMHead, init_modernbert_weights,
                                       is_modernbert)

ARCHS = ("bert", MODERNBERT)
AnyEncoderConfig = Union[EncoderConfig, ModernBertConfig]
#: What each family is called in cards and READMEs, and the Hugging Face class it converts to (and
#: warm-starts from): the one table every text about a converted family reads.
FAMILY_TITLES = {"bert": "BERT", MODERNBERT: "ModernBERT-style"}
HF_MASKED_LM = {"bert": "BertForMaskedLM", MODERNBERT: "ModernBertForMaskedLM"}


def arch_of_fields(fields: Mapping[str, Any]) -> str:
    """The family of a stored config dict (`RunMeta.encoder_config`): BERT runs predate the `arch` key."""
    return fields.get("arch", "bert")


def encoder_config_from_dict(fields: Mapping[str, Any]) -> AnyEncoderConfig:
    """The config dataclass a stored dict (`RunMeta.encoder_config`, objective-heads info) describes."""
    fields = dict(fields)
    if arch_of_fields(fields) == MODERNBERT:
        return ModernBertConfig(**fields)
    fields.pop("arch", None)
    return EncoderConfig(**fields)


def arch_of(config: Any) -> str:
    return MODERNBERT if is_modernbert(config) else "bert"


def build_encoder_and_head(config: AnyEncoderConfig) -> tuple[nn.Module, nn.Module]:
    """(encoder, MLM head with the projection tied to the encoder's token embeddings)."""
    if is_modernbert(config):
        encoder = ModernBertEncoder(config)
        return encoder, ModernBertMLMHead(config, encoder.embeddings.tok_embeddings)
    bert = BertEncoder(config)
    return bert, MLMHead(config, bert.embeddings.word_embeddings)


def layer_stack(config: AnyEncoderConfig, num_layers: Optional[int] = None) -> nn.Module:
    """A stack of `num_layers` layers of the config's family (COCO-LM's generator), called as
    `stack(embedding_output, attention_mask, seqlens)` -> final hidden states."""
    if is_modernbert(config):
        return ModernBertLayerStack(config, num_layers=num_layers)
    return BertLayerStack(config, num_layers=num_layers)


def init_weights(model: nn.Module, config: AnyEncoderConfig) -> None:
    """The family's initialisation of every module of `model` (encoder, head, objective heads)."""
    if is_modernbert(config):
        init_modernbert_weights(model, config)
    else:
        init_bert_weights(model, config.initializer_range)


def configure_stacks(model: nn.Module, config: AnyEncoderConfig, attention: str, compile_layers: bool,
                     checkpoint_period: int = 0) -> int:
    """`model.attention` / `model.compile` / `model.activation_checkpointing` (a period k, 0: none;
    `pipeline.model.checkpointing`) on every layer stack of the family in `model`."""
    return configure_layer_stacks(model, attention, compile_layers, checkpoint_period,
                                  stack_type=ModernBertLayerStack if is_modernbert(config) else BertLayerStack)
