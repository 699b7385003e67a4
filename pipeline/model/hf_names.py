"""Parameter and config names, ours <-> Hugging Face's, for both encoder families: the name maps alone.

They live with the model, not with `pipeline.export`, because both directions need them: a warm start
(`pipeline.model.warm_start`, `model.config`'s base-model checks) reads a Hugging Face checkpoint and its
config.json into our names, and conversion (`pipeline.export.hf_adapter`, `pipeline.export.modernbert_adapter`)
writes ours out under theirs. Nothing here knows `PretrainModel` or the objectives; sorting a training state
dict into model / generator / objective heads is the export's.

BERT (`BertForMaskedLM`): our names are HF's apart from the fused `attention.self.qkv` projection
(`pipeline.model.encoder.split_qkv` / `fuse_qkv`) and the decoder bias (ours `cls.predictions.decoder.bias`,
HF's `cls.predictions.bias`); the tied decoder weight is never written.

ModernBERT (`ModernBertForMaskedLM`; `pipeline.model.modernbert` keeps HF's module names below the prefixes):

    bert.embeddings.*                 -> model.embeddings.*        (tok_embeddings, norm)
    bert.encoder.layers.N.*           -> model.layers.N.*          (attn_norm, attn.Wqkv, attn.Wo, mlp_norm, mlp.Wi, mlp.Wo)
    bert.encoder.final_norm.*         -> model.final_norm.*
    cls.predictions.transform.*       -> head.*                    (dense, norm)
    cls.predictions.decoder.bias      -> decoder.bias
    cls.predictions.decoder.weight    -  (tied to model.embeddings.tok_embeddings.weight; not written)
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from pipeline.model.encoder import fuse_qkv, split_qkv

# --- BERT (`BertForMaskedLM`, `BertForPreTraining`, `BertModel`) ---

#: HF ties these to other tensors; they are never written (safetensors refuses shared storage).
_HF_TIED = ("cls.predictions.decoder.weight",)
_OUR_DECODER_BIAS = "cls.predictions.decoder.bias"
HF_DECODER_BIAS = "cls.predictions.bias"
_WORD_EMBEDDINGS = "bert.embeddings.word_embeddings.weight"
#: Hugging Face tensors that have no counterpart in `PretrainModel` (buffers, the pooler, and the
#: next-sentence head of `BertForPreTraining` checkpoints such as the original `bert-base-*`).
_HF_NOT_OURS = ("bert.embeddings.position_ids", "bert.pooler.", "cls.seq_relationship.")
#: LayerNorm parameter names of checkpoints converted from the original TensorFlow BERT.
_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}


class ExportError(ValueError):
    """The checkpoint's weights cannot be mapped to Hugging Face's names (names the keys at fault); raised
    here by `to_modernbert_hf` and by the conversion in `pipeline.export`."""


def to_hf(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Our encoder + MLM head tensors (`bert.*`, `cls.*`) under `BertForMaskedLM`'s names.

    A key copy plus two renames (fused QKV -> query / key / value; `cls.predictions.decoder.bias` ->
    `cls.predictions.bias`); the tied decoder weight is left out (HF re-ties it to the word
    embeddings). Other keys are ignored.
    """
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.startswith("bert.") or (key.startswith("cls.") and key not in _HF_TIED):
            out[HF_DECODER_BIAS if key == _OUR_DECODER_BIAS else key] = value
    return split_qkv(out)


def from_hf(hf_state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """A Hugging Face BERT state dict under our names: (tensors, HF keys that have no counterpart).

    Accepts `BertForMaskedLM` / `BertForPreTraining` (`bert.*`, `cls.*`) and `BertModel`
    (`embeddings.*`, `encoder.*`, `pooler.*`, no head) state dicts, with the legacy LayerNorm names
    `gamma`/`beta` read as `weight`/`bias`. The inverse of `to_hf`: query / key / value become the
    fused QKV projection, `cls.predictions.bias` becomes the decoder bias, the tied decoder weight is
    the word embeddings (so `load_state_dict(strict=True)` works), and the position-id buffer, the
    pooler and the next-sentence head (not part of pretraining here) are returned unused.
    """
    bare = not any(k.startswith(("bert.", "cls.")) for k in hf_state)  # BertModel: no "bert." prefix
    out: dict[str, Tensor] = {}
    unused: list[str] = []
    for key, value in hf_state.items():
        name = f"bert.{key}" if bare else key
        if "LayerNorm." in name:
            stem, dot, last = name.rpartition(".")
            name = stem + _LEGACY_SUFFIXES.get(dot + last, dot + last)
        alias = name == _OUR_DECODER_BIAS and HF_DECODER_BIAS in hf_state  # HF ties the two biases
        if name.startswith(_HF_NOT_OURS) or name in _HF_TIED or alias:
            unused.append(key)
        elif name == HF_DECODER_BIAS:
            out[_OUR_DECODER_BIAS] = value
        elif name.startswith(("bert.", "cls.")):
            out[name] = value
        else:
            unused.append(key)
    if _WORD_EMBEDDINGS in out:  # our decoder weight *is* the word-embedding Parameter: name it too
        out[_HF_TIED[0]] = out[_WORD_EMBEDDINGS]
    return fuse_qkv(out), unused


#: `EncoderConfig` field -> `BertConfig` (config.json) field: the shape part of `bert_config`, read back.
HF_CONFIG_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "ffn_size": "intermediate_size",
    "max_position": "max_position_embeddings",
    "type_vocab_size": "type_vocab_size",
    "layer_norm_eps": "layer_norm_eps",
    "initializer_range": "initializer_range",
}


def encoder_fields_from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    """`EncoderConfig` fields from a BERT `config.json` (the inverse of `pipeline.export.hf_adapter.bert_config`;
    dropout and the pad id stay the run's). Fields the file does not set are left out."""
    return {ours: config[theirs] for ours, theirs in HF_CONFIG_FIELDS.items() if theirs in config}


# --- ModernBERT (`ModernBertForMaskedLM`, `ModernBertModel`) ---

#: (our prefix, HF prefix), most specific first.
_MB_RENAMES = (
    ("bert.encoder.final_norm.", "model.final_norm."),
    ("bert.encoder.layers.", "model.layers."),
    ("bert.embeddings.", "model.embeddings."),
    ("cls.predictions.transform.", "head."),
    ("cls.predictions.decoder.bias", "decoder.bias"),
)
_MB_OUR_TIED = "cls.predictions.decoder.weight"
_MB_HF_TIED = "decoder.weight"
_MB_OUR_EMBEDDINGS = "bert.embeddings.tok_embeddings.weight"
MODERNBERT_DECODER_BIAS = "decoder.bias"
#: `ModernBertConfig` field -> HF config.json field, for the fields read back at a warm start.
MODERNBERT_HF_FIELDS = {
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
        name = _rename(key, _MB_RENAMES)
        if name is not None:
            out[name] = value
        elif key.startswith(("bert.", "cls.")) and key != _MB_OUR_TIED:
            raise ExportError(f"{key}: no place in ModernBertForMaskedLM")
    return out


def from_modernbert_hf(hf_state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """A `ModernBertForMaskedLM` (or bare `ModernBertModel`) state dict under our names: (tensors, HF keys
    not used). An untied decoder weight is an error (the head here projects with the token embeddings)."""
    bare = not any(k.startswith(("model.", "head.", "decoder.")) for k in hf_state)
    back = tuple((dst, src) for src, dst in _MB_RENAMES)
    out: dict[str, Tensor] = {}
    unused: list[str] = []
    for key, value in hf_state.items():
        name = _rename(f"model.{key}" if bare else key, back)
        if name is None:
            unused.append(key)
        else:
            out[name] = value
    if _MB_HF_TIED in hf_state and _MB_OUR_EMBEDDINGS in out and not (
            hf_state[_MB_HF_TIED].device.type == "meta" or torch.equal(hf_state[_MB_HF_TIED], out[_MB_OUR_EMBEDDINGS])):
        raise ValueError(f"{_MB_HF_TIED} differs from model.embeddings.tok_embeddings.weight: an untied decoder "
                         "is not supported (the MLM head projects with the token embeddings)")
    if _MB_OUR_EMBEDDINGS in out:  # our decoder weight *is* the embedding Parameter: name it too
        out[_MB_OUR_TIED] = out[_MB_OUR_EMBEDDINGS]
    return out, unused


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
    fields = {ours: raw[theirs] for ours, theirs in MODERNBERT_HF_FIELDS.items() if theirs in raw}
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

