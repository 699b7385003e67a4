"""The model card (`README.md`) written beside converted weights: what was trained, how long, on
what, and how it ended."""
from __future__ import annotations

from pipeline.export.hf_adapter import HFExport
from pipeline.model.encoder import EncoderConfig
from pipeline.train.run_meta import RunMeta


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
         "Converted from a DeepSpeed checkpoint by `python -m pipeline.export.convert`. "
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
