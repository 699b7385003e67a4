"""The model card (`README.md`) written beside converted weights: what was trained, from what, how
long, on what, how it ended, whether it is healthy, and what a downstream user must know.

Everything comes from `pipeline_meta.json` (`RunMeta`) and the conversion itself; no local path
appears (files and directories by name only), so a card can be published as it is. The YAML front
matter carries the Hugging Face Hub metadata: `library_name`, `pipeline_tag`, `license`, `tags`,
and `base_model` for a warm-started run.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from pipeline.monitor.health import COLLAPSE_COSINE, POSITIVE_COSINE_PINNED
from pipeline.monitor.signals import ENTROPY_RATIO, LOSS_RATIO, PLATEAU_MARGIN, Signal
from pipeline.export.health_check import HealthReport
from pipeline.export.hf_adapter import CORRECTED_HEAD_FORMULA, HFExport
from pipeline.model.arch import FAMILY_TITLES, HF_MASKED_LM, arch_of, encoder_config_from_dict
from pipeline.model.modernbert import is_modernbert
from pipeline.train.run_meta import META_FILE, RunMeta

_OBJECTIVE_TITLES = {
    "mlm": "masked language modelling (BERT)",
    "taco": "TACO token-alignment contrastive loss + MLM",
    "capt": "CAPT sequence contrast between a text and its corruption + MLM",
    "cocolm": "COCO-LM corrective LM + sequence contrastive learning (generator-corrupted input)",
    "electra": "ELECTRA replaced-token detection: the main model is the discriminator of a small MLM generator's "
               "replacements",
    "infoword": "InfoWord DIM n-gram contrast + NCE-MLM",
    "mlm-nce": "masked-token prediction against sampled negatives (NCE) instead of the full softmax",
}
#: The snippet of the "Fine-tuning" section; `tests/convert` runs it on a converted directory.
SEGMENT_B_SNIPPET = '''import torch
from transformers import AutoModelForSequenceClassification

model_dir = "path/to/this/directory"
model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
with torch.no_grad():  # segment B starts where segment A is (trained), not at its untrained value
    types = model.bert.embeddings.token_type_embeddings.weight
    types[1:] = types[0]'''
#: What each objective's generator card says it is (`--with-generator`).
_GENERATOR_TITLES = {"cocolm": "COCO-LM auxiliary generator", "electra": "ELECTRA generator"}
_GENERATOR_LEADS = {
    "cocolm": "The MLM generator that produced COCO-LM's corrupted inputs; it shares the main model's embeddings "
              "(copied here). Loads with `AutoModelForMaskedLM`.",
    "electra": "The MLM generator that produced the discriminator's replaced tokens (`ElectraForMaskedLM`, narrower "
               "than the discriminator behind ELECTRA's `embeddings_project`); it shares the discriminator's token "
               "and position embeddings (copied here). Loads with `AutoModelForMaskedLM` and the fill-mask pipeline.",
}


@dataclass
class CardInputs:
    """What the card needs beyond `RunMeta` and the export."""

    tag_name: str  # the checkpoint tag (a name, never a path)
    source: str  # where the weights came from (ZeRO consolidation / model file)
    health: Optional[HealthReport] = None
    license: Optional[str] = None  # `convert --license`; default: the base model's, else "unknown"
    base_model: Optional[str] = None  # `convert --base-model` (a Hub id); default: the base directory's name


def public(value: Any) -> Any:
    """`value` with every local path reduced to its last component (cards never show local paths)."""
    if isinstance(value, dict):
        return {k: public(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [public(v) for v in value]
    if isinstance(value, str) and (os.path.isabs(value) or os.sep in value.strip(os.sep)):
        return Path(value).name
    return value


def format_metric(value: Any) -> str:
    """A final metric for the card: 4 decimals, but a nonzero value below 0.001 in magnitude (the learning
    rate at the end of its decay, 1.1e-06) in 3 significant digits (never `0.0000`), an int as it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if value != 0 and math.isfinite(value) and abs(value) < 1e-3:
        return f"{value:.3g}"
    return f"{value:.4f}"


def _schedule_text(optim: dict[str, Any]) -> str:
    """The learning-rate schedule after warm-up, as `optim.schedule` runs it (`pipeline.train.optim.lr_at`)."""
    schedule, floor = optim.get("schedule", "linear"), f"{optim.get('min_lr_ratio', 0.0)} x peak"
    if schedule == "wsd":
        length = (f"the last {optim['decay_steps']} steps" if optim.get("decay_steps")
                  else f"the last {100 * float(optim.get('decay_fraction', 0.2)):g}% of the steps")
        return f"linear warm-up, stable at the peak, then a {optim.get('decay_shape', 'linear')} decay over {length} to {floor}"
    return f"linear warm-up then {'cosine' if schedule == 'cosine' else 'linear'} decay to {floor}"


def _table(rows: list[tuple[str, object]], header: tuple[str, ...] = ("field", "value")) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _license(meta: RunMeta, inputs: CardInputs) -> tuple[str, str]:
    """(license id, where it came from)."""
    if inputs.license:
        return inputs.license, "set at conversion (`--license`)"
    if meta.base_model.get("license"):
        return str(meta.base_model["license"]), "the base model's card (a derivative: check its terms)"
    return "unknown", "not set at conversion: pass `--license`; the corpus's and any base model's terms apply"


def front_matter(meta: RunMeta, inputs: CardInputs, generator_card: bool, export: Optional[HFExport] = None) -> str:
    # an ELECTRA discriminator predicts "replaced" per token, not tokens: no fill-mask widget for it
    tag = "feature-extraction" if export is not None and export.hf_class and not generator_card else "fill-mask"
    front: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": tag,
                             "license": _license(meta, inputs)[0],
                             "tags": [meta.encoder_config.get("arch", "bert"), "contrastive-pretraining", *meta.objectives]}
    base = inputs.base_model or meta.base_model.get("name")
    if base:
        front["base_model"] = base
    if generator_card:
        front["tags"].append(f"{export.generator.objective if export and export.generator else 'cocolm'}-generator")
    return "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n"


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else f"`{value}`" if isinstance(value, str) else str(value)


def training_rows(meta: RunMeta, inputs: CardInputs) -> list[tuple[str, object]]:
    cfg = meta.config
    optim, data, train = cfg.get("optim", {}), cfg.get("data", {}), cfg.get("train", {})
    recipe = meta.recipe.get("preset") or cfg.get("name") or "(not recorded)"
    if meta.recipe:
        changed = meta.recipe.get("overrides", {})
        overrides = "; ".join(f"`{k}`: {_fmt(public(v['preset']))} -> {_fmt(public(v['run']))}"
                              for k, v in changed.items()) or "none"
    else:
        overrides = "(not recorded: the run was not started from the command line)"
    base = meta.base_model
    base_text = (f"`{base['name']}` (config.json sha256 `{str(base.get('config_sha256', ''))[:16]}`), "
                 "warm start (`model.init_from`): encoder and MLM head from it, objective heads fresh"
                 if base else f"none: random initialisation (seed {train.get('seed', '?')})")
    global_batch = data.get("global_batch_size", "?")
    micro = data.get("micro_batch_size", "?")
    corpus = meta.corpus
    files = ", ".join(f"`{f['name']}` ({f.get('documents', '?')} documents, sha256 `{str(f.get('sha256'))[:16]}`)"
                      for f in corpus.get("files", [])) or "(not recorded)"
    seq_len = corpus.get("seq_len") or meta.encoder_config.get("max_position")
    warmup = optim.get("warmup_steps", 0)
    lr = optim.get("lr", "?")
    return [
        ("objectives", ", ".join(f"`{n}` (weight {w:g})" for n, w in meta.objectives.items())),
        ("what they are", "; ".join(_OBJECTIVE_TITLES.get(n, n) for n in meta.objectives)),
        ("recipe", f"`{recipe}`"),
        ("overrides vs the recipe", overrides),
        ("base model", base_text),
        ("learning rate", f"{lr} peak, `{optim.get('name', 'adamw')}` (betas {optim.get('betas')}, weight decay "
                          f"{optim.get('weight_decay')}), {_schedule_text(optim)}"),
        ("warm-up", f"{warmup} steps"),
        ("batch", f"{global_batch} sequences per optimizer step ({micro} per micro-batch, {meta.world_size} "
                  f"rank{'' if meta.world_size == 1 else 's'})"),
        ("sequence length", f"{seq_len} tokens"),
        ("optimizer steps", f"{meta.step} (of `train.total_steps` {train.get('total_steps', '?')})"),
        ("samples seen", meta.consumed_samples),
        ("tokens seen", meta.tokens_seen),
        ("corpus", files),
        ("shards", f"{corpus.get('sequences', '?')} sequences, {corpus.get('tokens', '?')} tokens, packing "
                   f"`{corpus.get('packing', '?')}`; manifest content hash `{meta.manifest_hash}`"),
        ("config hash", f"`{meta.config_hash}`"),
        ("precision / ZeRO stage / ranks",
         f"{cfg.get('deepspeed', {}).get('precision', '?')} / {meta.zero_stage} / {meta.world_size}"),
        ("checkpoint", f"`{inputs.tag_name}`"),
        ("weights", inputs.source),
    ]


def health_section(health: Optional[HealthReport]) -> list[str]:
    if health is None:
        return []
    if health.token_cosine is None:
        cosine = ("mean token cosine, last layer", "not measured", health.note)
    else:
        verdict = "**COLLAPSED**" if health.collapsed else "ok"
        cosine = (f"mean token cosine, last layer ({health.probe_rows} shard rows, {health.probe_tokens} content "
                  "tokens)", f"{health.token_cosine:.4f}", f"{verdict} (collapsed above {COLLAPSE_COSINE})")
    rows = [cosine]
    for key, value in sorted(health.positive_cosines.items()):
        verdict = "**PINNED at 1.0**" if key in health.pinned else "ok"
        rows.append((f"`{key}` (last logged step)", f"{value:.4f}", f"{verdict} (pinned at >= {POSITIVE_COSINE_PINNED})"))
    return ["", "## Health check (at conversion)", "", _table(rows, ("measure", "value", "verdict"))] + signals_section(
        health.signals)


def signals_section(signals: list[Signal]) -> list[str]:
    """The last logged step's learning signals against their chance levels (`pipeline.monitor.signals`)."""
    if not signals:
        return []
    rows = []
    for s in signals:
        if s.kind == "collapse":
            continue  # the token cosine row above says it
        if s.direction == "lower":
            compared = f"{s.ratio:.2f}x {_REFERENCES[s.kind]} `{s.reference_key}` ({s.reference:.4f})"
        else:
            compared = f"{s.margin:+.4f} vs {_REFERENCES[s.kind]} `{s.reference_key}` ({s.reference:.4f})"
        rows.append((f"`{s.term}`", f"{s.value:.4f}", compared, "learned" if s.learned else "**AT CHANCE**"))
    if not rows:
        return []
    return ["", f"Learning signals at the last logged step (one step's sample; a contrastive loss is learned at <= "
            f"{LOSS_RATIO}x its chance level, a masked accuracy {PLATEAU_MARGIN} above the unigram plateau, an LM "
            f"loss at <= {ENTROPY_RATIO}x the unigram entropy):", "", _table(rows, ("signal", "value", "against", "verdict"))]


_REFERENCES = {"chance": "chance", "plateau": "unigram plateau", "entropy": "unigram entropy"}


def validation_section(summary: dict[str, Any]) -> list[str]:
    """The held-out set's values (`eval.shards_dir`, `pipeline.train.validation.validation_summary`): each
    `val/` term at the checkpoint's latest evaluation beside its chance level, and its best over the run."""
    if not summary or not summary.get("terms"):
        return []
    against = {s["term"]: s["text"] for s in summary.get("signals", [])}
    rows = [(f"`{term}`", f"{v['latest']:.4f}", f"{v['best']:.4f} (step {v['best_step']})",
             against.get(term, "").split(" ", 1)[-1] if term in against else "")
            for term, v in summary["terms"].items()]
    return ["", f"## Validation (held-out documents, step {summary['step']})", "",
            f"{summary['evaluations']} evaluation(s) during training on documents never trained on, with masks fixed "
            "by `eval.seed` (the same positions at every evaluation):", "",
            _table(rows, ("metric", "latest", "best", "against its chance level"))]


_FAMILY_ROWS = {
    "bert": f"BERT (`{HF_MASKED_LM['bert']}`): learned absolute positions, post-LayerNorm, GELU FFN",
    "modernbert": f"ModernBERT (`{HF_MASKED_LM['modernbert']}`, `model.arch=modernbert`): rotary positions, "
                  "pre-LayerNorm without biases, GeGLU, alternating global / sliding-window attention, final norm, "
                  "tied MLM head",
}


def modernbert_usage_section(with_head: bool = True) -> list[str]:
    """Fine-tuning notes of a `model.arch=modernbert` export (no segment embeddings, no pooler); `with_head`
    False: a body without the MLM head (an ELECTRA discriminator's), whose `head.*` is new too."""
    loaded = ("its `model.*` and `head.*` (the MLM head's transform, [CLS] pooling by default) load from these "
              "weights, only `classifier` is new" if with_head else
              "its `model.*` loads from these weights, `head.*` and `classifier` are new")
    return [
        "", "## Fine-tuning", "",
        f"`AutoModelForSequenceClassification` builds `ModernBertForSequenceClassification`: {loaded}. "
        "There are no segment embeddings: pass no `token_type_ids` (the tokenizer of this directory returns none "
        "only if told: `return_token_type_ids=False`). Local layers see +-"
        "`local_attention / 2` tokens; [CLS] sees the whole row only through the global layers.",
    ]


def usage_section(meta: RunMeta) -> list[str]:
    warm = bool(meta.base_model)
    segment_b = ("still holds the base model's value (this run did not update it)" if warm else
                 "still holds its random initial value (shrunk by weight decay)")
    return [
        "", "## Fine-tuning: untrained parts", "",
        "Pretraining here gives every token segment id 0 and has no pooler, so two parts of a "
        "`BertForSequenceClassification` are not pretrained:",
        "",
        "- `bert.pooler` is not in these weights" + (" (nor carried over from the base model)" if warm else "")
        + ": `AutoModel` and `AutoModelForSequenceClassification` initialise it randomly (as they do the "
        "classifier) and list it in their load report;",
        f"- the segment-B row of `bert.embeddings.token_type_embeddings` (token type id 1) never received a "
        f"gradient: it {segment_b}.",
        "",
        "Recommendation for `AutoModelForSequenceClassification`: fine-tune the whole model (with a frozen "
        "encoder the random pooler has nothing to adapt to), with warm-up; for frozen features use the [CLS] "
        "or mean-pooled last hidden states, not the pooler output. For sentence-pair tasks, "
        + ("the segment-B embedding is the base model's: keep it if the base model was pretrained on segment "
           "pairs (the original BERT was); otherwise pass all-zero `token_type_ids`, or start segment B from "
           "segment A:" if warm else
           "pass all-zero `token_type_ids`, or start segment B from segment A so that fine-tuning learns it "
           "from a trained starting point:"),
        "", "```python", SEGMENT_B_SNIPPET, "```",
    ]


def electra_usage_section(meta: RunMeta) -> list[str]:
    """Fine-tuning notes of an ELECTRA discriminator export (`ElectraForPreTraining`)."""
    return [
        "", "## Fine-tuning: untrained parts", "",
        "`AutoModelForSequenceClassification` builds `ElectraForSequenceClassification`: its `electra.*` loads from "
        "these weights, its `classifier` (dense -> GELU -> projection on [CLS]) is new, as ELECTRA's fine-tuning "
        "expects; `discriminator_predictions` (the replaced-token head) is not used there. Pretraining gives every "
        "token segment id 0, so the segment-B row of `electra.embeddings.token_type_embeddings` never received a "
        "gradient: for sentence pairs pass all-zero `token_type_ids`, or start segment B from segment A:",
        "", "```python", SEGMENT_B_SNIPPET.replace("model.bert.", "model.electra."), "```",
        "", "`ElectraForPreTraining` gives the discriminator's per-token logit of \"replaced\" (sigmoid > 0.5: "
        "replaced), what it was trained on.",
    ]


def head_section(export: HFExport) -> list[str]:
    """What the exported MLM head computes, when NCE objectives trained it (`HeadBiasCorrection`)."""
    head = export.head_bias
    if head is None:
        return []
    lines = ["", "## Masked-LM head", "", head.note[0].upper() + head.note[1:] + "."]
    if head.corrected:
        lines += ["", (f"Formula: {CORRECTED_HEAD_FORMULA}. Fill-mask and `AutoModelForMaskedLM` logits are this "
                       "masked LM's; the training head's own scores are these logits minus log q (a constant per "
                       "vocabulary entry, so the encoder is unaffected).")]
    return lines


def files_section(export: HFExport) -> list[str]:
    model = {"ElectraForPreTraining": "`ElectraForPreTraining` (the discriminator: encoder + `discriminator_predictions`"
                                      "; the MLM head `cls.predictions`, which ELECTRA does not train, is not "
                                      "exported)",
             "ModernBertModel": "`ModernBertModel` (the discriminator's body; its replaced-token head is in "
                                "`objective_heads.safetensors`, the untrained MLM head is not exported)",
             "ElectraForMaskedLM": "`ElectraForMaskedLM` (encoder + tied MLM head; the factorised embeddings, "
                                   "`model.embedding_size`, do not fit `BertForMaskedLM`)"}.get(
        export.hf_class, "`BertForMaskedLM` (encoder + tied MLM head)")
    lines = ["", "## Files", "",
             f"- `config.json`, `model.safetensors`: {model}.",
             "- tokenizer files: the run's own tokenizer (`AutoTokenizer`).",
             f"- `{META_FILE}`: the run's full record (config, data identity, counters, last metrics)."]
    if export.objective_heads:
        lines.append(
            "- `objective_heads.safetensors`: objective-only parameters under their training names ("
            + ", ".join(f"`{k}`" for k in sorted(export.objective_heads))
            + "); its metadata records each head's class, shapes and options, and "
            "`pipeline.export.objective_heads.load_objective_heads(DIR)` rebuilds them as modules.")
    if export.generator is not None:
        loads_as = f" as `{export.generator.hf_class}`" if export.generator.hf_class else ""
        lines.append(f"- generator (objective `{export.generator.objective}`): written to `generator/`{loads_as} with "
                     "`--with-generator`; otherwise omitted.")
    if export.dropped_buffers:
        lines.append("- not exported (training state, not weights): "
                     + ", ".join(f"`{k}`" for k in export.dropped_buffers) + ".")
    return lines


def render_model_card(meta: RunMeta, export: HFExport, inputs: CardInputs, generator_card: bool) -> str:
    """The README.md written beside the weights."""
    enc = encoder_config_from_dict(meta.encoder_config)
    if generator_card:
        assert export.generator is not None
        enc = export.generator.config
    generator_of = export.generator.objective if export.generator is not None else "cocolm"
    title = (_GENERATOR_TITLES.get(generator_of, f"{generator_of} generator") if generator_card
             else FAMILY_TITLES[arch_of(enc)] + " encoder pretrained with " + " + ".join(meta.objectives))
    lines = [front_matter(meta, inputs, generator_card, export), f"# {title}", ""]
    problems = inputs.health.problems() if inputs.health and not generator_card else []
    if problems:
        lines += ["> **Warning: this checkpoint looks collapsed** and will likely fine-tune worse than a randomly "
                  "initialised model:"] + [f"> - {p}" for p in problems] + [""]
    loads = {"ElectraForPreTraining": "`AutoModel` (`ElectraModel`), `ElectraForPreTraining` (every tensor: the "
                                      "discriminator and its replaced-token head)",
             "ModernBertModel": "`AutoModel` (`ModernBertModel`: the discriminator's body)"}.get(
        export.hf_class, "`AutoModel`, `AutoModelForMaskedLM` (every tensor)")
    lines.append(
        _GENERATOR_LEADS.get(generator_of, "The objective's generator.") if generator_card else
        f"Converted from a DeepSpeed checkpoint by `python -m pipeline.export.convert`. Loads with {loads}, "
        "`AutoModelForSequenceClassification` and `AutoTokenizer`; no `trust_remote_code`.")
    license_id, license_source = _license(meta, inputs)
    lines += ["", f"License: `{license_id}` ({license_source}).", "", "## Training", "",
              _table(training_rows(meta, inputs)), "", f"## Final metrics (step {meta.step})", "",
              _table([(k, format_metric(v)) for k, v in sorted(meta.last_metrics.items())])
              if meta.last_metrics else "(none recorded)"]
    if not generator_card:
        lines += validation_section(meta.validation)
        usage = (modernbert_usage_section(export.hf_class != "ModernBertModel") if is_modernbert(enc) else
                 electra_usage_section(meta) if export.hf_class == "ElectraForPreTraining" else usage_section(meta))
        lines += head_section(export) + health_section(inputs.health) + usage
    exported_as = (export.generator.hf_class if generator_card and export.generator is not None else export.hf_class)
    lines += ["", "## Architecture", "", _table([
        ("family", _FAMILY_ROWS[arch_of(enc)].replace(f"`{HF_MASKED_LM[arch_of(enc)]}`", f"`{exported_as}`")
         if exported_as else _FAMILY_ROWS[arch_of(enc)]),
        ("layers / hidden / heads / FFN", f"{enc.num_layers} / {enc.hidden_size} / {enc.num_heads} / {enc.ffn_size}"),
        *([("embedding size", f"{enc.embedding_width} (projected to the hidden size)")]
          if enc.factorised else []),
        ("vocabulary", enc.vocab_size),
        ("max positions", enc.max_position),
        ("activation", "GeGLU with exact GELU (erf)" if is_modernbert(enc) else "exact GELU (erf)"),
        ("layer norm eps", enc.layer_norm_eps),
        *([("attention", f"global every {enc.global_attn_every_n_layers} layers (layer 0 first), otherwise a "
                         f"sliding window of {enc.local_attention} tokens (|i - j| <= {enc.window})"),
           ("positions", f"rotary, base {enc.global_rope_theta:g} (global layers) / {enc.local_rope_theta:g} (local)")]
          if is_modernbert(enc) else []),
    ])]
    if not generator_card:
        lines += files_section(export)
    return "\n".join(lines) + "\n"
