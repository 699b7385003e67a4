"""An ELECTRA run exported as the ecosystem expects an ELECTRA: the discriminator as `transformers`'
`ElectraForPreTraining`, the generator (`--with-generator`) as `ElectraForMaskedLM`.

The discriminator is the main model (`bert.*`, the `model.arch=bert` family: HF's ELECTRA layers are BERT's)
plus the objective's `discriminator_predictions`; the names, ours -> HF's:

    bert.embeddings.*                                   -> electra.embeddings.*
    bert.embeddings_project.*                           -> electra.embeddings_project.*   (E != H only)
    bert.encoder.layer.N.* (fused Q/K/V split)          -> electra.encoder.layer.N.*
    objectives.electra.discriminator_predictions.*      -> discriminator_predictions.{dense, dense_prediction}.*
    cls.*                                               -  (no objective of an ELECTRA run trains it: left out)

The generator shares the main model's embeddings (copied), and its width H_G sits behind ELECTRA's
projection (`ElectraConfig.embedding_size` = E, `hidden_size` = H_G; E = `model.embedding_size`, the
hidden size H unless the embeddings are factorised):

    bert.embeddings.*                                   -> electra.embeddings.*
    objectives.electra.embeddings_project.*             -> electra.embeddings_project.*   (H_G != E only)
    objectives.electra.generator.layer.N.*              -> electra.encoder.layer.N.*
    objectives.electra.generator_head.transform.*       -> generator_predictions.{dense, LayerNorm}.*
    objectives.electra.generator_head.bias              -> generator_lm_head.bias  (its weight: the tied embeddings)

A `model.arch=modernbert` ELECTRA has no Hugging Face ELECTRA class (rotary, GeGLU, pre-LN): its
discriminator body is exported as a `ModernBertModel` (the family's names, `pipeline.model.hf_names`)
and every objective parameter (generator, discriminator head) goes to `objective_heads.safetensors`; the
untrained MLM head is left out there too.

The main model's MLM head is refused rather than dropped when an objective beside `electra` trains it
(`mlm`, `mlm-nce`, ...): `ElectraForPreTraining` has no place for it.

A masked-LM run (no `electra`) with factorised embeddings (`model.embedding_size` E != H: ELECTRA's BERT-Small
baseline, `mlm-electra-small`) does not fit `BertForMaskedLM` (one width throughout); it is exported as
`ElectraForMaskedLM`, the class with exactly that shape (`masked_lm_as_electra`): BERT's names from
`pipeline.model.hf_names.to_hf`, ours -> HF's:

    bert.*                                              -> electra.*  (embeddings, embeddings_project, layers)
    cls.predictions.transform.*                         -> generator_predictions.{dense, LayerNorm}.*  (H -> E)
    cls.predictions.bias                                -> generator_lm_head.bias  (its weight: the tied embeddings)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional

from torch import Tensor

from pipeline.export.hf_adapter import GeneratorExport, HFExport, assemble_export
from pipeline.model.hf_names import HF_DECODER_BIAS
from pipeline.model.encoder import EncoderConfig, split_qkv
from pipeline.model.hf_names import ExportError, to_modernbert_hf
from pipeline.model.modernbert import is_modernbert
from pipeline.objectives.registry import mlm_head_beside_electra
from pipeline.pretrain.pretrainer import PretrainModel

OBJECTIVE = "electra"
DISCRIMINATOR_CLASS = "ElectraForPreTraining"
GENERATOR_CLASS = "ElectraForMaskedLM"
MODERNBERT_BODY_CLASS = "ModernBertModel"
_PREFIX = f"objectives.{OBJECTIVE}."
_DISC = _PREFIX + "discriminator_predictions."
_GEN_STACK = _PREFIX + "generator.layer."
_GEN_PROJECT = _PREFIX + "embeddings_project."
_GEN_TRANSFORM = _PREFIX + "generator_head.transform."
_GEN_BIAS = _PREFIX + "generator_head.bias"


def is_electra_run(objectives: Mapping[str, Any]) -> bool:
    """The run trains `electra` (its export is ELECTRA's, this module's)."""
    return OBJECTIVE in objectives


def to_electra_hf(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The discriminator's tensors (`bert.*` and the objective's `discriminator_predictions.*`) under
    `ElectraForPreTraining`'s names; other keys are ignored."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.startswith("bert."):
            out["electra." + key[len("bert."):]] = value
        elif key.startswith(_DISC):
            out["discriminator_predictions." + key[len(_DISC):]] = value
    return split_qkv(out)


def generator_to_electra_hf(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The generator's tensors (the shared `bert.embeddings.*`, the objective's projection, layers and head)
    under `ElectraForMaskedLM`'s names; the tied output weight is left out (HF ties it to the embeddings)."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.startswith("bert.embeddings."):
            out["electra." + key[len("bert."):]] = value
        elif key.startswith(_GEN_PROJECT):
            out["electra.embeddings_project." + key[len(_GEN_PROJECT):]] = value
        elif key.startswith(_GEN_STACK):
            out["electra.encoder.layer." + key[len(_GEN_STACK):]] = value
        elif key.startswith(_GEN_TRANSFORM):
            out["generator_predictions." + key[len(_GEN_TRANSFORM):]] = value
        elif key == _GEN_BIAS:
            out["generator_lm_head.bias"] = value
    return split_qkv(out)


_BERT_TRANSFORM = "cls.predictions.transform."


def masked_lm_as_electra(export: HFExport, encoder: EncoderConfig, special_tokens: Mapping[str, int]) -> HFExport:
    """A `BertForMaskedLM`-named export (`hf_adapter.split_for_hf`) of a factorised model (E != H) renamed to
    `ElectraForMaskedLM` (module docstring), with its config (`embedding_size` E); the head's bias keeps any
    log q correction `split_for_hf` folded in. A generator (COCO-LM's) cannot be there: cocolm refuses E != H."""
    if export.generator is not None:
        raise ExportError(f"objective {export.generator.objective!r}: a generator beside factorised embeddings "
                          "(model.embedding_size) has no export")
    main: dict[str, Tensor] = {}
    for key, value in export.main.items():
        if key.startswith("bert."):
            main["electra." + key[len("bert."):]] = value
        elif key.startswith(_BERT_TRANSFORM):
            main["generator_predictions." + key[len(_BERT_TRANSFORM):]] = value
        elif key == HF_DECODER_BIAS:
            main["generator_lm_head.bias"] = value
        else:
            raise ExportError(f"{key}: no place for it in {GENERATOR_CLASS}")
    config = electra_hf_config(encoder, special_tokens)
    config.architectures = [GENERATOR_CLASS]
    return replace(export, main=main, hf_config=config, hf_class=GENERATOR_CLASS)


def electra_hf_config(encoder: EncoderConfig, special_tokens: Mapping[str, int], generator: Optional[EncoderConfig] = None,
                      generator_layers: Optional[int] = None):
    """`transformers.ElectraConfig`: the discriminator's (`generator` None; architectures
    `ElectraForPreTraining`), or the generator's (`generator`: its shape; architectures `ElectraForMaskedLM`).
    `embedding_size` is the main model's embedding width E for both (`EncoderConfig.embedding_width`).
    GELU: ours is exact, HF's "gelu" the same."""
    from transformers import ElectraConfig

    body = generator or encoder
    return ElectraConfig(
        vocab_size=encoder.vocab_size, embedding_size=encoder.embedding_width, hidden_size=body.hidden_size,
        num_hidden_layers=generator_layers or body.num_layers, num_attention_heads=body.num_heads,
        intermediate_size=body.ffn_size, hidden_act="gelu", hidden_dropout_prob=encoder.dropout,
        attention_probs_dropout_prob=encoder.attention_dropout, max_position_embeddings=encoder.max_position,
        type_vocab_size=encoder.type_vocab_size, initializer_range=encoder.initializer_range,
        layer_norm_eps=encoder.layer_norm_eps, pad_token_id=special_tokens.get("pad", encoder.pad_token_id),
        architectures=[GENERATOR_CLASS if generator is not None else DISCRIMINATOR_CLASS], tie_word_embeddings=True,
    )


#: Why a `model.arch=modernbert` ELECTRA run converts without its generator (`--with-generator` is refused).
MODERNBERT_GENERATOR_NOTE = ("the ELECTRA generator of a model.arch=modernbert run has no Hugging Face class "
                             "(ELECTRA's classes are BERT-family); its weights are in objective_heads.safetensors "
                             "under objectives.electra.*")


def export_refusal(objectives: Mapping[str, float], arch: str, with_generator: bool = False) -> str:
    """'' when a run of `objectives` (name -> weight) and `model.arch` `arch` converts (with its generator when
    `with_generator`); else the one line `cpt-convert` refuses it with. Decided by the config alone, so a
    tool that will convert a run it trains (`cpt-study`) refuses a run it could never convert before
    training it, instead of after: an MLM head trained beside `electra` (no place in `ElectraForPreTraining`),
    or a ModernBERT ELECTRA's generator (no Hugging Face class). Not an ELECTRA run: ''."""
    if not is_electra_run(objectives):
        return ""
    trained = mlm_head_beside_electra(objectives)
    if trained:
        return (f"objectives {trained} train the MLM head cls.predictions beside electra; an ELECTRA export "
                f"({DISCRIMINATOR_CLASS}) has no place for it: train electra alone, or with objectives that "
                "do not use the MLM head (e.g. taco)")
    if with_generator and arch == "modernbert":
        return f"--with-generator: {MODERNBERT_GENERATOR_NOTE}"
    return ""


def _check_head_untrained(model: PretrainModel) -> None:
    refusal = export_refusal({n: model.weights.get(n, 1.0) for n in model.objectives}, "bert")
    if refusal:
        raise ExportError(refusal)


def split_electra_for_hf(model: PretrainModel, state: dict[str, Tensor]) -> HFExport:
    """Sort an ELECTRA run's consolidated state dict: the discriminator (`ElectraForPreTraining`; a
    `ModernBertModel` body for `model.arch=modernbert`), the generator (`ElectraForMaskedLM`, BERT family) and
    the other objectives' heads."""
    _check_head_untrained(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    first_name: dict[int, str] = {}
    for key, p in params.items():
        first_name.setdefault(id(p), key)
    owned = {k: state[k] for k in params if first_name[id(params[k])] == k}  # aliases (the tied decoder) once
    objective = model.objectives[OBJECTIVE]
    special = model.special_tokens
    if is_modernbert(model.config):
        main = {k: v for k, v in to_modernbert_hf(owned).items() if k.startswith("model.")}  # the body, no MLM head
        config = _modernbert_body_config(model.config, special)
        heads = {k: v for k, v in owned.items() if k.startswith("objectives.")}
        return replace(assemble_export(model, main, None, heads, None), hf_config=config,
                       hf_class=MODERNBERT_BODY_CLASS,
                       generator_note=MODERNBERT_GENERATOR_NOTE)
    main = to_electra_hf(owned)
    gen_config = objective.generator_config
    generator = GeneratorExport(OBJECTIVE, gen_config, generator_to_electra_hf(owned),
                                hf_config=electra_hf_config(model.config, special, gen_config,
                                                            len(objective.generator.layer)),
                                hf_class=GENERATOR_CLASS)
    used = {k for k in owned if k.startswith(("bert.", "cls.", _DISC, _GEN_STACK, _GEN_PROJECT, _GEN_TRANSFORM))
            or k == _GEN_BIAS}
    heads = {k: v for k, v in owned.items() if k not in used}
    return replace(assemble_export(model, main, generator, heads, None), hf_config=electra_hf_config(model.config, special),
                   hf_class=DISCRIMINATOR_CLASS)


def _modernbert_body_config(encoder: Any, special_tokens: Mapping[str, int]):
    from pipeline.export.modernbert_adapter import modernbert_hf_config

    config = modernbert_hf_config(encoder, special_tokens)
    config.architectures = [MODERNBERT_BODY_CLASS]
    return config
