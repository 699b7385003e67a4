"""Map a consolidated `PretrainModel` state dict onto Hugging Face BERT directories.

`PretrainModel` already uses `BertForMaskedLM` parameter names (`bert.*`, `cls.*`), so the main
model is a key copy plus one rename: our `cls.predictions.decoder.bias` is HF's
`cls.predictions.bias` (HF ties `decoder.bias` to it, and `decoder.weight` to the word embeddings,
so neither tied tensor is written). What is not part of `BertForMaskedLM` is sorted as follows:

* a generator inside an objective (COCO-LM): found by structure, not by name — an objective
  submodule that is a `BertLayerStack`, plus the module owning the objective's MLM head transform
  (its output bias beside it). It becomes a second `BertForMaskedLM` whose embeddings and tied
  output projection are the main model's (the generator shares them);
* every other objective parameter (CAPT aggregation MLP, COCO-LM copy / SCL heads, ...) goes to
  `objective_heads.safetensors` under its training name (`objectives.<name>.*`);
* buffers are training state, not weights: listed in the model card, not exported (CAPT's memory
  queue is not even a buffer; it lives in the checkpoint's extra state).

The expected keys and shapes come from a `PretrainModel` rebuilt from `pipeline_meta.json`, so a
checkpoint that disagrees with its own meta is rejected with the offending names instead of
producing a silently broken model.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import Tensor, nn

from pipeline.model import BertLayerStack, EncoderConfig, PredictionHeadTransform
from pipeline.pretrainer import PretrainModel
from pipeline.run_meta import RunMeta

#: HF ties these to other tensors; they are never written (safetensors refuses shared storage).
_HF_TIED = ("cls.predictions.decoder.weight",)
_OUR_DECODER_BIAS = "cls.predictions.decoder.bias"
_HF_DECODER_BIAS = "cls.predictions.bias"


class ExportError(ValueError):
    """The checkpoint's weights cannot be mapped to Hugging Face BERT (names the keys at fault)."""


@dataclass
class GeneratorExport:
    """A generator found inside an objective, as a stand-alone `BertForMaskedLM`."""

    objective: str
    config: EncoderConfig
    state: dict[str, Tensor]


@dataclass
class HFExport:
    """Everything the converter writes, already in Hugging Face naming."""

    main: dict[str, Tensor]
    generator: Optional[GeneratorExport]
    objective_heads: dict[str, Tensor]
    dropped_buffers: list[str] = field(default_factory=list)


def pretrain_model_from_meta(meta: RunMeta) -> PretrainModel:
    """The training model described by a checkpoint's meta (randomly initialised, on CPU).

    Used to learn names, shapes and module structure. Built on CPU rather than the `meta` device
    because objectives may compute real tensors in their constructors (e.g. sampling tables).
    """
    import pipeline.objectives  # noqa: F401  (registers every objective)

    return PretrainModel(
        EncoderConfig(**meta.encoder_config),
        meta.objectives,
        meta.special_tokens,
        objective_options=meta.objective_options,
    )


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
            out[_HF_DECODER_BIAS] = state[bias]
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

    main: dict[str, Tensor] = {}
    for key in params:
        if key.startswith("bert.") or (key.startswith("cls.") and key not in _HF_TIED):
            name = _HF_DECODER_BIAS if key == _OUR_DECODER_BIAS else key
            main[name] = state[key]
            used.add(key)
    used.update(_HF_TIED)

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
        generator = GeneratorExport(obj_name, _generator_config(model.config, stack), gen_state)

    heads = {k: state[k] for k in params if k not in used}
    unknown = sorted(k for k in heads if not k.startswith("objectives."))
    if unknown:
        raise ExportError(f"parameters outside bert.*, cls.* and objectives.*: {unknown}")
    dropped = sorted(dict(model.named_buffers()))
    return HFExport(main=main, generator=generator, objective_heads=heads, dropped_buffers=dropped)


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


_OBJECTIVE_TITLES = {
    "mlm": "masked language modelling (BERT)",
    "taco": "TACO token-alignment contrastive loss + MLM",
    "capt": "CAPT sequence contrast between a text and its corruption + MLM",
    "cocolm": "COCO-LM corrective LM + sequence contrastive learning (generator-corrupted input)",
    "infoword": "InfoWord DIM n-gram contrast + NCE-MLM",
    "mlm-nce": "masked-token prediction against sampled negatives (NCE) instead of the full softmax",
}


def _table(rows: list[tuple[str, object]]) -> str:
    return "\n".join(["| field | value |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows])


def render_model_card(meta: RunMeta, export: HFExport, tag_dir, source: str, generator_card: bool) -> str:
    """The README.md written beside the weights: what was trained, how long, on what, how it ended."""
    enc = EncoderConfig(**meta.encoder_config)
    if generator_card:
        assert export.generator is not None
        enc = export.generator.config
    objectives = ", ".join(f"`{n}` (weight {w:g})" for n, w in meta.objectives.items())
    recipe = meta.config.get("name") or meta.config.get("preset") or "(not recorded)"
    what = [_OBJECTIVE_TITLES.get(n, n) for n in meta.objectives]
    front = "---\nlibrary_name: transformers\npipeline_tag: fill-mask\ntags:\n" + "".join(
        f"- {t}\n" for t in ["bert", "contrastive-pretraining", *meta.objectives]
    ) + "---\n"
    title = (
        "COCO-LM auxiliary generator" if generator_card
        else "BERT encoder pretrained with " + " + ".join(meta.objectives)
    )
    lines = [
        front,
        f"# {title}",
        "",
        ("The MLM generator that produced COCO-LM's corrupted inputs; it shares the main model's "
         "embeddings (copied here). Loads with `AutoModelForMaskedLM`." if generator_card else
         "Converted from a DeepSpeed checkpoint by `python -m pipeline.convert`. "
         "Loads with `AutoModel`, `AutoModelForMaskedLM`, `AutoModelForSequenceClassification` and "
         "`AutoTokenizer`. `bert.pooler` is not part of pretraining: `AutoModel`/sequence "
         "classification initialise it (and the classifier) freshly."),
        "",
        "## Training",
        "",
        _table([
            ("objectives", objectives),
            ("what they are", "; ".join(what)),
            ("recipe", f"`{recipe}`"),
            ("optimizer steps", meta.step),
            ("samples seen", meta.consumed_samples),
            ("tokens seen", meta.tokens_seen),
            ("data manifest hash", f"`{meta.manifest_hash}`"),
            ("config hash", f"`{meta.config_hash}`"),
            ("ZeRO stage / ranks", f"{meta.zero_stage} / {meta.world_size}"),
            ("checkpoint", f"`{tag_dir}`"),
            ("weights", source),
        ]),
        "",
        "## Final losses",
        "",
        _table([(k, f"{v:.4f}" if isinstance(v, (int, float)) else v) for k, v in sorted(meta.last_metrics.items())])
        if meta.last_metrics else "(none recorded)",
        "",
        "## Architecture",
        "",
        _table([
            ("layers / hidden / heads / FFN",
             f"{enc.num_layers} / {enc.hidden_size} / {enc.num_heads} / {enc.ffn_size}"),
            ("vocabulary", enc.vocab_size),
            ("max positions", enc.max_position),
            ("activation", "exact GELU (erf)"),
            ("layer norm eps", enc.layer_norm_eps),
        ]),
    ]
    if not generator_card:
        lines += ["", "## Files", ""]
        lines.append("- `config.json`, `model.safetensors`: `BertForMaskedLM` (encoder + tied MLM head).")
        lines.append("- tokenizer files: the run's own tokenizer (`AutoTokenizer`).")
        if export.objective_heads:
            lines.append(
                "- `objective_heads.safetensors`: objective-only parameters under their training names "
                "(load with `safetensors.torch.load_file`): "
                + ", ".join(f"`{k}`" for k in sorted(export.objective_heads))
                + "."
            )
        if export.generator is not None:
            lines.append(
                f"- generator (objective `{export.generator.objective}`): written to `generator/` with "
                "`--with-generator`; otherwise omitted."
            )
        if export.dropped_buffers:
            lines.append(
                "- not exported (training state, not weights): "
                + ", ".join(f"`{k}`" for k in export.dropped_buffers)
                + "."
            )
    return "\n".join(lines) + "\n"
