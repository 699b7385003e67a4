"""The two-way adapter between a `model.arch=modernbert` `PretrainModel` and Hugging Face `ModernBertForMaskedLM`.

The names, ours <-> HF's (`to_modernbert_hf`, and its inverse `from_modernbert_hf`, which also takes a
bare `ModernBertModel` state dict), and `modernbert_fields_from_hf` (a config.json read back for warm
starts, refusing what the encoder does not implement: other activations, an untied or bias-free decoder,
RoPE scaling, a layer pattern that is not "global every n") live in `pipeline.model.hf_names`, beside
BERT's. Here: `modernbert_hf_config` writes the config (no remote code: the class ships with
transformers) and `split_modernbert_for_hf` sorts a training state dict.

Conversion sorts objective parameters exactly as for BERT (`pipeline.export.hf_adapter`): the MLM head
goes to the model, the objectives' own heads to `objective_heads.safetensors`, and the NCE head
correction (`head_bias_correction`) is applied to `decoder.bias`. A COCO-LM generator of this family
becomes a second `ModernBertForMaskedLM` (`--with-generator`; `_generator_export`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from pipeline.export.hf_adapter import GeneratorExport, HFExport, assemble_export, head_bias_correction
from pipeline.model.heads import PredictionHeadTransform
from pipeline.model.hf_names import MODERNBERT_DECODER_BIAS, ExportError, to_modernbert_hf
from pipeline.model.modernbert import ModernBertConfig, ModernBertLayerStack
from pipeline.pretrain.pretrainer import PretrainModel


def _generator_export(model: PretrainModel, state: Mapping[str, Tensor], main: Mapping[str, Tensor],
                      params: Mapping[str, Any]) -> tuple[Optional[GeneratorExport], set[str]]:
    """A generator of this family inside an objective (COCO-LM: a `ModernBertLayerStack` and a head with a
    `PredictionHeadTransform` and its own bias) as a second `ModernBertForMaskedLM`, and the keys it used.

    It shares the main model's embeddings (copied). Its head transform has biases (the objective's BERT-style
    head): exported with `classifier_bias` and `norm_bias` true, the bias-free norms of its layers and of the
    embeddings getting zero biases — the same function."""
    found = []
    for obj_name, objective in model.objectives.items():
        stacks = [n for n, m in objective.named_modules() if isinstance(m, ModernBertLayerStack)]
        transforms = [n for n, m in objective.named_modules() if isinstance(m, PredictionHeadTransform)]
        if stacks:
            if len(stacks) > 1 or len(transforms) != 1 or not transforms[0].endswith(".transform"):
                raise ExportError(f"objective {obj_name!r}: {len(stacks)} layer stacks and {len(transforms)} MLM head "
                                  "transforms; cannot tell the generator")
            found.append((obj_name, stacks[0], transforms[0][: -len(".transform")]))
    if not found:
        return None, set()
    if len(found) > 1:
        raise ExportError(f"objectives {[f[0] for f in found]} both hold a generator")
    obj_name, stack_name, head_name = found[0]
    stack_prefix, head_prefix = f"objectives.{obj_name}.{stack_name}.", f"objectives.{obj_name}.{head_name}."
    used = {k for k in params if k.startswith((stack_prefix, head_prefix))}
    gen = {k: v for k, v in main.items() if k.startswith("model.embeddings.")}
    gen.update({"model." + k[len(stack_prefix):]: state[k] for k in params if k.startswith(stack_prefix)})
    for key in [k for k in gen if k.endswith("norm.weight")]:
        gen[key[: -len("weight")] + "bias"] = gen.get(key[: -len("weight")] + "bias", torch.zeros_like(gen[key]))
    transform = head_prefix + "transform."
    gen.update({"head." + k[len(transform):].replace("LayerNorm.", "norm."): state[k]
                for k in params if k.startswith(transform)})
    if head_prefix + "bias" not in state:
        raise ExportError(f"generator head {head_prefix[:-1]}: no output bias")
    gen[MODERNBERT_DECODER_BIAS] = state[head_prefix + "bias"]
    stack = model.objectives[obj_name].get_submodule(stack_name)
    config = replace(model.config, num_layers=len(stack.layers), norm_bias=True, classifier_bias=True)
    return GeneratorExport(obj_name, config, gen), used


def split_modernbert_for_hf(model: PretrainModel, state: dict[str, Tensor]) -> HFExport:
    """Sort a consolidated training state dict into the `ModernBertForMaskedLM` tensors, the generator
    (a second `ModernBertForMaskedLM`, if an objective holds one) and the objective heads."""
    params = dict(model.named_parameters(remove_duplicate=False))
    main = to_modernbert_hf({k: state[k] for k in params if k in state})
    head_bias = head_bias_correction(model, state)
    if head_bias is not None and head_bias.corrected:
        assert head_bias.log_proposal is not None
        main[MODERNBERT_DECODER_BIAS] = main[MODERNBERT_DECODER_BIAS] + head_bias.log_proposal.to(main[MODERNBERT_DECODER_BIAS].dtype)
    first_name: dict[int, str] = {}
    for key, p in params.items():
        first_name.setdefault(id(p), key)
    generator, used = _generator_export(model, state, main, params)
    heads = {k: state[k] for k in params if first_name[id(params[k])] == k and k not in used
             and not k.startswith(("bert.", "cls."))}
    return assemble_export(model, main, generator, heads, head_bias)


def modernbert_hf_config(encoder: ModernBertConfig, special_tokens: Mapping[str, int]):
    """`transformers.ModernBertConfig` of `encoder` (exact GELU everywhere, tied decoder with a bias)."""
    from transformers import ModernBertConfig as HFConfig

    layer_types = ["full_attention" if encoder.is_global(i) else "sliding_attention" for i in range(encoder.num_layers)]
    return HFConfig(
        vocab_size=encoder.vocab_size, hidden_size=encoder.hidden_size, intermediate_size=encoder.ffn_size,
        num_hidden_layers=encoder.num_layers, num_attention_heads=encoder.num_heads, hidden_activation="gelu",
        max_position_embeddings=encoder.max_position, initializer_range=encoder.initializer_range,
        initializer_cutoff_factor=encoder.initializer_cutoff_factor, norm_eps=encoder.layer_norm_eps,
        norm_bias=encoder.norm_bias, attention_bias=encoder.attention_bias, mlp_bias=encoder.mlp_bias,
        classifier_bias=encoder.classifier_bias, classifier_activation="gelu", decoder_bias=True,
        attention_dropout=encoder.attention_dropout, embedding_dropout=encoder.dropout, mlp_dropout=encoder.dropout,
        local_attention=encoder.local_attention, layer_types=layer_types,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": encoder.global_rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": encoder.local_rope_theta}},
        pad_token_id=special_tokens.get("pad", encoder.pad_token_id),
        bos_token_id=special_tokens.get("cls"), cls_token_id=special_tokens.get("cls"),
        eos_token_id=special_tokens.get("sep"), sep_token_id=special_tokens.get("sep"),
        architectures=["ModernBertForMaskedLM"], tie_word_embeddings=True,
    )


