"""The two-way state-dict adapter between `PretrainModel` and Hugging Face BERT.

`PretrainModel` already uses `BertForMaskedLM` parameter names (`bert.*`, `cls.*`), so the main
model is a key copy plus two renames: our fused `attention.self.qkv` projection is split into HF's
`query` / `key` / `value` (`pipeline.model.encoder.split_qkv`; `fuse_qkv` on the way in), and our
`cls.predictions.decoder.bias` is HF's `cls.predictions.bias` (HF ties `decoder.bias` to it, and
`decoder.weight` to the word embeddings, so neither tied tensor is written). What is not part of
`BertForMaskedLM` is sorted as follows:

* a generator inside an objective (COCO-LM): found by structure, not by name — an objective
  submodule that is a `BertLayerStack`, plus the module owning the objective's MLM head transform
  (its output bias beside it). It becomes a second `BertForMaskedLM` whose embeddings and tied
  output projection are the main model's (the generator shares them);
* every other objective parameter (CAPT aggregation MLP, COCO-LM copy / SCL heads, ...) goes to
  `objective_heads.safetensors` under its training name (`objectives.<name>.*`);
* buffers are training state, not weights: listed in the model card, not exported (CAPT's memory
  queue is not even a buffer; it lives in the checkpoint's extra state) — except the NCE samplers'
  log q (`log_proposal`), which is folded into the MLM head's bias when only sampled-softmax
  objectives trained that head (`head_bias_correction`: the exported softmax is then the masked LM
  p(v | c) ∝ q(v) exp s(v, c) those objectives imply).

The expected keys and shapes come from a `PretrainModel` rebuilt from `pipeline_meta.json`
(`pipeline.pretrain.build.model_from_meta`), so a checkpoint that disagrees with its own meta is
rejected with the offending names instead of producing a silently broken model.

The name maps themselves, both directions (`to_hf`, and `from_hf` that lets a `PretrainModel` start
from a `BertForMaskedLM` or `BertModel` checkpoint), live in `pipeline.model.hf_names`: a warm start
reads them from below the export.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn

from pipeline.model.encoder import BertLayerStack, EncoderConfig, split_qkv
from pipeline.model.heads import PredictionHeadTransform
from pipeline.model.hf_names import HF_DECODER_BIAS, ExportError, to_hf
from pipeline.pretrain.pretrainer import PretrainModel
from pipeline.objectives.base import SAMPLED_SOFTMAX
from pipeline.objectives.mlm_nce import LOG_PROPOSAL, log_proposal_samplers
from pipeline.objectives.registry import mlm_head_training


@dataclass
class GeneratorExport:
    """A generator found inside an objective, as a stand-alone masked LM (`BertForMaskedLM` /
    `ModernBertForMaskedLM`, or the class an objective's own adapter names: ELECTRA's `ElectraForMaskedLM`)."""

    objective: str
    config: Any  # its shape (`EncoderConfig` / `ModernBertConfig`)
    state: dict[str, Tensor]
    hf_config: Any = None  # the `transformers` config to write; None: the family's masked-LM config of `config`
    hf_class: str = ""  # the Hugging Face class it loads as; "": the family's masked LM


#: The masked LM a corrected head computes (card and `pipeline_meta.json`).
CORRECTED_HEAD_FORMULA = ("p(v | c) ∝ q(v) exp s(v, c), i.e. cls.predictions.bias = trained bias + log q(v), "
                          "q = the NCE negatives' distribution (add-one smoothed unigram frequencies of the "
                          "training shards, centred; zero for a uniform pool)")


@dataclass
class HeadBiasCorrection:
    """What conversion did to the MLM head's output bias (`cls.predictions.bias`), and why.

    Sampled negatives from q make the head learn s(v, c) = log p(v | c) - log q(v) + const(c) (CPC,
    Oord et al. 2018, Sec. 2.3; `pipeline.objectives.mlm_nce`): its softmax is not a masked LM.
    The masked LM it implies is p(v | c) ∝ q(v) exp s(v, c): the trained bias plus log q."""

    corrected: bool
    note: str  # one sentence for the card, the summary and `pipeline_meta.json`
    objectives: dict[str, str]  # the objectives that trained the head -> `Objective.mlm_head`
    buffers: list[str] = field(default_factory=list)  # the `log_proposal` keys read from the checkpoint
    log_proposal: Optional[Tensor] = None  # added to the bias (when `corrected`)

    def record(self) -> dict[str, Any]:
        """The JSON form written to the export's `pipeline_meta.json` (`conversion.mlm_head_bias`)."""
        out: dict[str, Any] = {"corrected": self.corrected, "note": self.note, "objectives": dict(self.objectives),
                               "log_proposal_buffers": list(self.buffers)}
        if self.corrected:
            out["formula"] = CORRECTED_HEAD_FORMULA
        return out


@dataclass
class HFExport:
    """Everything the converter writes, already in Hugging Face naming."""

    main: dict[str, Tensor]
    generator: Optional[GeneratorExport]
    objective_heads: dict[str, Tensor]
    dropped_buffers: list[str] = field(default_factory=list)
    head_bias: Optional[HeadBiasCorrection] = None  # None: no objective trained the head with sampled negatives
    hf_config: Any = None  # the main model's `transformers` config; None: the family's masked-LM config
    hf_class: str = ""  # the Hugging Face class the main model loads as; "": the family's masked LM
    generator_note: str = ""  # why there is no generator to export, when an objective has one that cannot be


def check_state_dict(model: nn.Module, state: dict[str, Tensor], source: str) -> None:
    """Every parameter of `model` is in `state` with the right shape, nothing unknown, all finite."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    missing = sorted(k for k in params if k not in state)
    unexpected = sorted(k for k in state if k not in params and k not in buffers)
    if missing or unexpected:
        raise ExportError(
            f"{source}: weights do not match the model in pipeline_meta.json; "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    for name, p in params.items():
        if tuple(state[name].shape) != tuple(p.shape):
            raise ExportError(f"{source}: {name} has shape {tuple(state[name].shape)}, expected {tuple(p.shape)}")
    for name in params:
        t = state[name]
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ExportError(f"{source}: {name} contains NaN or Inf; refusing to export a broken model")


def _generator_parts(objective: nn.Module) -> Optional[tuple[str, BertLayerStack, str]]:
    """(layer-stack prefix, layer stack, head prefix) of a generator inside `objective`, if any.

    The head is the module owning the one `PredictionHeadTransform` of the objective (an
    `MLMPredictionHead`, or a head with its own `bias` that projects through the main model's tied
    decoder, like COCO-LM's `GeneratorHead`).
    """
    stacks = [(n, m) for n, m in objective.named_modules() if isinstance(m, BertLayerStack)]
    if not stacks:
        return None
    if len(stacks) > 1:
        raise ExportError(f"objective {objective.name!r} holds {len(stacks)} layer stacks; cannot tell the generator")
    transforms = [n for n, m in objective.named_modules() if isinstance(m, PredictionHeadTransform)]
    if len(transforms) != 1 or not transforms[0].endswith(".transform"):
        raise ExportError(
            f"objective {objective.name!r} has a generator layer stack but {len(transforms)} MLM head transforms"
        )
    return stacks[0][0], stacks[0][1], transforms[0][: -len(".transform")]


def _generator_config(main: EncoderConfig, stack: BertLayerStack) -> EncoderConfig:
    """The generator's shape, read off its modules (it shares the main model's embeddings)."""
    first = stack.layer[0]
    return replace(
        main,
        num_layers=len(stack.layer),
        num_heads=first.attention.self.num_heads,
        ffn_size=first.intermediate.dense.out_features,
    )


def _head_state(state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """HF `cls.predictions.*` tensors (transform + output bias) of the head at `prefix`."""
    out = {
        "cls.predictions." + key[len(prefix) + 1 :]: value
        for key, value in state.items()
        if key.startswith(prefix + ".transform.")
    }
    for bias in (f"{prefix}.bias", f"{prefix}.decoder.bias"):
        if bias in state:
            out[HF_DECODER_BIAS] = state[bias]
            return out
    raise ExportError(f"generator head {prefix}: no output bias ({prefix}.bias or {prefix}.decoder.bias)")


def split_for_hf(model: PretrainModel, state: dict[str, Tensor]) -> HFExport:
    """Sort a consolidated training state dict into main model / generator / objective heads."""
    params = dict(model.named_parameters(remove_duplicate=False))
    # A parameter registered under two names (tied weights, a generator holding the shared
    # embeddings) is exported once, under its first name; the other names are aliases.
    first_name: dict[int, str] = {}
    for key, p in params.items():
        first_name.setdefault(id(p), key)
    used: set[str] = {k for k, p in params.items() if first_name[id(p)] != k}

    main = to_hf({k: state[k] for k in params if k in state})
    used.update(k for k in params if k.startswith(("bert.", "cls.")))
    head_bias = head_bias_correction(model, state)
    if head_bias is not None and head_bias.corrected:
        assert head_bias.log_proposal is not None
        main[HF_DECODER_BIAS] = main[HF_DECODER_BIAS] + head_bias.log_proposal.to(main[HF_DECODER_BIAS].dtype)

    generator: Optional[GeneratorExport] = None
    for obj_name, objective in model.objectives.items():
        parts = _generator_parts(objective)
        if parts is None:
            continue
        if generator is not None:
            raise ExportError(f"objectives {generator.objective!r} and {obj_name!r} both hold a generator")
        stack_prefix, stack, head_prefix = parts
        base = f"objectives.{obj_name}."
        gen_state = {k: v for k, v in main.items() if k.startswith("bert.embeddings.")}
        for key in params:
            if key.startswith(base + stack_prefix + ".layer."):
                gen_state["bert.encoder." + key[len(base + stack_prefix) + 1 :]] = state[key]
                used.add(key)
        head_keys = {k for k in params if k.startswith(base + head_prefix + ".")}
        gen_state.update(_head_state(state, base + head_prefix))
        for key in head_keys:
            # The head's projection weight must be the tied word embeddings (the generator shares
            # them); a separate matrix there would not survive the HF tie and must not be dropped.
            word_embeddings = state["bert.embeddings.word_embeddings.weight"]
            if key.endswith(".decoder.weight") and not torch.equal(state[key], word_embeddings):
                raise ExportError(f"{key}: the generator's output projection is not tied to the word embeddings")
        used.update(head_keys)
        generator = GeneratorExport(obj_name, _generator_config(model.config, stack), split_qkv(gen_state))

    return assemble_export(model, main, generator, {k: state[k] for k in params if k not in used}, head_bias)


def assemble_export(model: PretrainModel, main: Mapping[str, Tensor], generator: Optional[GeneratorExport],
                    heads: Mapping[str, Tensor], head_bias: Optional[HeadBiasCorrection]) -> HFExport:
    """The export of either family once its main and generator weights are named: every parameter left over
    must be an objective head (`objectives.*`, kept beside the HF model), and the buffers not folded into the
    head's bias are listed as dropped."""
    unknown = sorted(k for k in heads if not k.startswith("objectives."))
    if unknown:
        raise ExportError(f"parameters outside bert.*, cls.* and objectives.*: {unknown}")
    folded = set(head_bias.buffers) if head_bias is not None and head_bias.corrected else set()
    dropped = sorted(k for k in dict(model.named_buffers()) if k not in folded)
    return HFExport(main=main, generator=generator, objective_heads=dict(heads), dropped_buffers=dropped,
                    head_bias=head_bias)


def head_bias_correction(model: PretrainModel, state: Mapping[str, Tensor]) -> Optional[HeadBiasCorrection]:
    """How the exported MLM head's bias is to be corrected (`HeadBiasCorrection`); None when no
    objective trains the head with sampled negatives (nothing to correct, nothing to say).

    Corrected by the checkpoint's log q when every objective training `cls.predictions`
    (`Objective.mlm_head`) uses sampled negatives and their `log_proposal` buffers agree. Not
    corrected, with the reason as the note, when a full-softmax objective trains the same head (its
    scores are then a mix of a masked LM's logits and log p - log q), when the checkpoint has no
    log q (written before the buffer existed), or when the NCE objectives' log q differ."""
    training = {name: how for name, how in mlm_head_training(model.objectives).items()
                if model.weights.get(name, 1.0) != 0}  # a zero weight trains nothing
    sampled = sorted(n for n, how in training.items() if how == SAMPLED_SOFTMAX)
    if not sampled:
        return None
    full = sorted(set(training) - set(sampled))
    if full:
        return HeadBiasCorrection(False, (
            f"the MLM head was trained by a full softmax ({', '.join(full)}) and with sampled negatives "
            f"({', '.join(sampled)}) together: its scores are not log p - log q alone, so its bias is exported "
            "as trained, not corrected by log q"), training)
    keys = sorted(f"{name}.{LOG_PROPOSAL}" for name in log_proposal_samplers(model))
    present = [k for k in keys if k in state]
    if not present:
        return HeadBiasCorrection(False, (
            f"the MLM head was trained with sampled negatives ({', '.join(sampled)}), but this checkpoint "
            f"predates the NCE samplers' log q buffer ({LOG_PROPOSAL}): its bias is exported as trained, not "
            "corrected, so its softmax is not a masked LM (it favours rare tokens)"), training)
    log_q = state[present[0]].detach().float()
    for key in present:
        if not torch.isfinite(state[key]).all():
            raise ExportError(f"{key} contains NaN or Inf; refusing to export a broken model")
    differ = [k for k in present[1:] if not torch.equal(state[k].detach().float(), log_q)]
    if differ:
        return HeadBiasCorrection(False, (
            f"the NCE objectives sharing the MLM head hold different log q ({', '.join(present)}; e.g. one "
            "uniform and one unigram pool): no single masked LM is implied, so its bias is exported as trained"),
            training, present)
    how = ("q is uniform (negatives: uniform), so log q is 0 and the bias is unchanged" if not log_q.any() else
           "q: the add-one smoothed unigram frequencies of the training shards")
    return HeadBiasCorrection(True, (
        f"the MLM head was trained with sampled negatives ({', '.join(sampled)}; NCE scores "
        f"s(v, c) = log p(v | c) - log q(v) + const): its bias is corrected by log q so that its softmax is the "
        f"masked LM p(v | c) ∝ q(v) exp s(v, c); {how}"), training, present, log_q)


def bert_config(encoder: EncoderConfig, special_tokens: dict[str, int]):
    """`transformers.BertConfig` with our sizes. GELU: ours is exact `F.gelu`, HF "gelu" is the same."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=encoder.vocab_size,
        hidden_size=encoder.hidden_size,
        num_hidden_layers=encoder.num_layers,
        num_attention_heads=encoder.num_heads,
        intermediate_size=encoder.ffn_size,
        hidden_act="gelu",
        hidden_dropout_prob=encoder.dropout,
        attention_probs_dropout_prob=encoder.attention_dropout,
        max_position_embeddings=encoder.max_position,
        type_vocab_size=encoder.type_vocab_size,
        initializer_range=encoder.initializer_range,
        layer_norm_eps=encoder.layer_norm_eps,
        pad_token_id=special_tokens.get("pad", encoder.pad_token_id),
        architectures=["BertForMaskedLM"],
        tie_word_embeddings=True,
    )


def contiguous_copies(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """fp32, contiguous, unshared tensors (what `safetensors` accepts)."""
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in state.items()}
