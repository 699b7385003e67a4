"""The two-way adapter between a `model.arch=modernbert` `PretrainModel` and Hugging Face `ModernBertForMaskedLM`.

Names (ours -> HF; `pipeline.model.modernbert` keeps HF's module names below the prefixes):

    bert.embeddings.*                 -> model.embeddings.*        (tok_embeddings, norm)
    bert.encoder.layers.N.*           -> model.layers.N.*          (attn_norm, attn.Wqkv, attn.Wo, mlp_norm, mlp.Wi, mlp.Wo)
    bert.encoder.final_norm.*         -> model.final_norm.*
    cls.predictions.transform.*       -> head.*                    (dense, norm)
    cls.predictions.decoder.bias      -> decoder.bias
    cls.predictions.decoder.weight    -  (tied to model.embeddings.tok_embeddings.weight; not written)

`from_modernbert_hf` is the inverse and also takes a bare `ModernBertModel` state dict (`embeddings.*`,
`layers.*`, `final_norm.*`; no head). `modernbert_hf_config` writes the config (no remote code: the
class ships with transformers), `modernbert_fields_from_hf` reads one back for warm starts, refusing
what the encoder does not implement (other activations, an untied or bias-free decoder, RoPE
scaling, a layer pattern that is not "global every n").

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

from pipeline.export.hf_adapter import ExportError, GeneratorExport, HFExport, head_bias_correction
from pipeline.model.heads import PredictionHeadTransform
from pipeline.model.modernbert import ModernBertConfig, ModernBertLayerStack
from pipeline.model.pretrainer import PretrainModel

#: (our prefix, HF prefix), most specific first.
_RENAMES = (
    ("bert.encoder.final_norm.", "model.final_norm."),
    ("bert.encoder.layers.", "model.layers."),
    ("bert.embeddings.", "model.embeddings."),
    ("cls.predictions.transform.", "head."),
    ("cls.predictions.decoder.bias", "decoder.bias"),
)
_OUR_TIED = "cls.predictions.decoder.weight"
_HF_TIED = "decoder.weight"
_OUR_EMBEDDINGS = "bert.embeddings.tok_embeddings.weight"
HF_DECODER_BIAS = "decoder.bias"
#: `ModernBertConfig` field -> HF config.json field, for the fields read back at a warm start.
HF_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads", "ffn_size": "intermediate_size", "max_position": "max_position_embeddings",
    "layer_norm_eps": "norm_eps", "initializer_range": "initializer_range",
    "initializer_cutoff_factor": "initializer_cutoff_factor", "local_attention": "local_attention",
    "norm_bias": "norm_bias", "attention_bias": "attention_bias", "mlp_bias": "mlp_bias",
    "classifier_bias": "classifier_bias",
}


def _rename(key: str, pairs) -> str | None:
    for src, dst in pairs:
        if key.startswith(src):
            return dst + key[len(src):]
    return None


def to_modernbert_hf(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Our `bert.*` / `cls.*` tensors under `ModernBertForMaskedLM`'s names (the tied decoder weight left out)."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        name = _rename(key, _RENAMES)
        if name is not None:
            out[name] = value
        elif key.startswith(("bert.", "cls.")) and key != _OUR_TIED:
            raise ExportError(f"{key}: no place in ModernBertForMaskedLM")
    return out


def from_modernbert_hf(hf_state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """A `ModernBertForMaskedLM` (or bare `ModernBertModel`) state dict under our names: (tensors, HF keys
    not used). An untied decoder weight is an error (the head here projects with the token embeddings)."""
    bare = not any(k.startswith(("model.", "head.", "decoder.")) for k in hf_state)
    back = tuple((dst, src) for src, dst in _RENAMES)
    out: dict[str, Tensor] = {}
    unused: list[str] = []
    for key, value in hf_state.items():
        name = _rename(f"model.{key}" if bare else key, back)
        if name is None:
            unused.append(key)
        else:
            out[name] = value
    if _HF_TIED in hf_state and _OUR_EMBEDDINGS in out and not (
            hf_state[_HF_TIED].device.type == "meta" or torch.equal(hf_state[_HF_TIED], out[_OUR_EMBEDDINGS])):
        raise ValueError(f"{_HF_TIED} differs from model.embeddings.tok_embeddings.weight: an untied decoder "
                         "is not supported (the MLM head projects with the token embeddings)")
    if _OUR_EMBEDDINGS in out:  # our decoder weight *is* the embedding Parameter: name it too
        out[_OUR_TIED] = out[_OUR_EMBEDDINGS]
    return out, unused


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
    gen[HF_DECODER_BIAS] = state[head_prefix + "bias"]
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
        main[HF_DECODER_BIAS] = main[HF_DECODER_BIAS] + head_bias.log_proposal.to(main[HF_DECODER_BIAS].dtype)
    first_name: dict[int, str] = {}
    for key, p in params.items():
        first_name.setdefault(id(p), key)
    generator, used = _generator_export(model, state, main, params)
    heads = {k: state[k] for k in params if first_name[id(params[k])] == k and k not in used
             and not k.startswith(("bert.", "cls."))}
    unknown = sorted(k for k in heads if not k.startswith("objectives."))
    if unknown:
        raise ExportError(f"parameters outside bert.*, cls.* and objectives.*: {unknown}")
    folded = set(head_bias.buffers) if head_bias is not None and head_bias.corrected else set()
    dropped = sorted(k for k in dict(model.named_buffers()) if k not in folded)
    return HFExport(main=main, generator=generator, objective_heads=heads, dropped_buffers=dropped, head_bias=head_bias)


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


def _global_period(layer_types: list, where: str) -> int:
    """n such that layer l is "full_attention" exactly when l % n == 0 (HF's `global_attn_every_n_layers`)."""
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    n = full[1] if len(full) > 1 else max(len(layer_types), 1)
    wanted = ["full_attention" if i % n == 0 else "sliding_attention" for i in range(len(layer_types))]
    if list(layer_types) != wanted:
        raise ValueError(f"{where}: layer_types {layer_types} is not 'full_attention every n layers from layer 0', "
                         "the only pattern implemented")
    return n


def modernbert_fields_from_hf(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`ModernBertConfig` fields of a ModernBERT config.json (dropout and the pad id stay the run's);
    a ValueError naming `where` and the field for anything the encoder does not implement."""
    for key, wanted in (("hidden_activation", "gelu"), ("classifier_activation", "gelu"), ("decoder_bias", True),
                        ("tie_word_embeddings", True)):
        if raw.get(key, wanted) != wanted:
            raise ValueError(f"{where}: {key}={raw[key]!r} is not supported (implemented: {wanted!r})")
    fields = {ours: raw[theirs] for ours, theirs in HF_FIELDS.items() if theirs in raw}
    rope = raw.get("rope_parameters") or {}
    thetas = {"full_attention": raw.get("global_rope_theta", 160000.0), "sliding_attention": raw.get("local_rope_theta", 10000.0)}
    for kind, ours in (("full_attention", "global_rope_theta"), ("sliding_attention", "local_rope_theta")):
        params = rope.get(kind) or {}
        if params.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
            raise ValueError(f"{where}: rope_parameters.{kind}={params} (RoPE scaling) is not supported")
        fields[ours] = float(params.get("rope_theta", thetas[kind]))
    layers = int(raw.get("num_hidden_layers", 22))
    if raw.get("layer_types"):
        if len(raw["layer_types"]) != layers:
            raise ValueError(f"{where}: {len(raw['layer_types'])} layer_types for num_hidden_layers={layers}")
        fields["global_attn_every_n_layers"] = _global_period(raw["layer_types"], where)
    else:
        fields["global_attn_every_n_layers"] = int(raw.get("global_attn_every_n_layers", 3))
    return fields
