"""Evaluation of one converted checkpoint in the time-to-quality study.

* `heldout_metrics`: on held-out shards the pretraining never saw, with the pipeline's own masking
  and a fixed seed (every checkpoint sees identical masks), through the masked LM class the converted
  directory names (`AutoModelForMaskedLM`: `BertForMaskedLM`, `ModernBertForMaskedLM`, or `ElectraForMaskedLM`
  for a masked-LM run with factorised embeddings, `model.embedding_size`):
    - masked-LM loss and accuracy at the positions the masking replaced by `[MASK]`: what the model
      predicts from the context alone. BERT's masking also keeps 10% of the selected tokens
      unchanged, where a model scores by copying its input: measured at the study's size (seed 1,
      256 held-out sequences), MLM was right on 0.357 of those and 0.092 of the `[MASK]` ones, and a
      BERT-NCE run that had learned nothing from context (0.058 at `[MASK]`, the plateau 0.059) still
      scored 0.081 over all selected positions, above the plateau by copying alone. The all-selected
      accuracy (`selected_acc`) and the copy accuracy (`kept_acc`) are reported beside it;
    - `unigram_accuracy`: the accuracy of always answering the training data's most frequent token
      (`pipeline.monitor.health.unigram_counts`) at *the same* (`[MASK]`) positions: the plateau an MLM
      that ignores the context reaches;
    - `replaced_acc` / `replaced_loss`: the same at the selected positions when they hold a draw from
      the held-out text's unigram distribution instead of `[MASK]` (seeded; the positions where the
      draw differs from the original, `replaced_tokens`), beside its plateau `replaced_unigram_acc`:
      the input regime of COCO-LM's corrective LM, whose main model never sees `[MASK]` (its generator
      samples replacements; at the study's size it has learned the token frequencies and little
      context, `docs/objectives.md#coco-lm-at-small-scale`);
    - `token_cosine`: mean pairwise cosine of the last hidden states of the content tokens of
      `cos_rows` unmasked rows spread over the shards, in eval mode (`pipeline.monitor.health`;
      collapsed above `COLLAPSE_COSINE`).
  An ELECTRA export (`ElectraForPreTraining`, the discriminator, which has no masked LM) is read through
  its `generator/` (`ElectraForMaskedLM`, written beside it by `convert_once`) for every masked-LM number,
  the run's masked LM, and through the discriminator for `token_cosine` (`masked_lm_dir`).
* `finetune_sst2`: `pipeline.eval.finetune` on SST-2 (fine-tuning subset, several seeds), scoring
  dev and the selection split, plus `test.tsv` only when asked (the final evaluation), optionally
  with the randomly initialised floor (`--random-init`: same shape, seeds, data, hyperparameters).

Results are cached as JSON files (`cached`), written atomically: a killed study re-run skips every
evaluation it finished.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from pipeline.io import write_atomic
from pipeline.monitor.health import COLLAPSE_COSINE, mean_token_cosine
from pipeline.report_files import write_json


def cached(path: Path, compute: Callable[[], dict]) -> dict:
    """The JSON at `path`, or `compute()` written there first (atomically)."""
    if path.is_file():
        return json.loads(path.read_text())
    result = compute()
    write_json(path, result)
    return result


def heldout_metrics(model_dir: Path, shards_dir: Path, top_token: int, max_sequences: int, cos_rows: int = 64,
                    batch_size: int = 32, seed: int = 0) -> dict:
    """Masked-LM loss / accuracy at the `[MASK]`ed positions, the unigram plateau at the same positions,
    the all-selected and copy accuracies, the same with unigram draws in place of `[MASK]` (`replaced_*`),
    and the eval-mode mean token cosine of a converted model on held-out shards (see the module docstring)."""
    import torch
    from transformers import AutoModelForMaskedLM

    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.reader import ShardDataset
    from pipeline.monitor.health import unigram_counts

    dataset = ShardDataset(shards_dir)
    collator = CorruptionCollator({"masked"}, dataset.special_tokens, dataset.vocab_size, seed)
    unigram = torch.from_numpy(unigram_counts(dataset)).double()  # special tokens zeroed: never drawn
    draws = torch.Generator().manual_seed(seed)
    replaced = {"loss": 0.0, "correct": 0, "plateau": 0, "count": 0}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the class config.json names (either family): BertForMaskedLM on a ModernBERT export would build
    # a BERT, load none of its tensors and evaluate random weights with only a warning
    model = AutoModelForMaskedLM.from_pretrained(str(masked_lm_dir(model_dir))).eval().to(device)
    mask_id = dataset.special_tokens["mask"]
    total_loss, correct, plateau, count = 0.0, 0, 0, 0
    selected_correct, selected_count, kept_correct, kept_count = 0, 0, 0, 0
    n = min(len(dataset), max_sequences)
    with torch.no_grad():
        for start in range(0, n, batch_size):
            rows = np.arange(start, min(n, start + batch_size))
            batch = collator.collate(*dataset.take(rows), rows)
            inputs = batch["masked_ids"].to(device)
            logits = model(input_ids=inputs, attention_mask=batch["attention_mask"].to(device)).logits
            labels = batch["mlm_labels"].to(device)
            selected = labels != -100
            right = (logits.argmax(-1) == labels) & selected
            masked, kept = selected & (inputs == mask_id), selected & (inputs == labels)
            target, scores = labels[masked], logits[masked].float()
            total_loss += float(torch.nn.functional.cross_entropy(scores, target, reduction="sum"))
            correct += int(right[masked].sum())
            plateau += int((target == top_token).sum())
            count += int(masked.sum())
            selected_correct, selected_count = selected_correct + int(right.sum()), selected_count + int(selected.sum())
            kept_correct, kept_count = kept_correct + int(right[kept].sum()), kept_count + int(kept.sum())
            swapped = batch["input_ids"].clone()
            swapped[selected.cpu()] = torch.multinomial(unigram, int(selected.sum()), replacement=True, generator=draws)
            swapped = swapped.to(device)
            at = selected & (swapped != labels)
            scores = model(input_ids=swapped, attention_mask=batch["attention_mask"].to(device)).logits[at].float()
            replaced["loss"] += float(torch.nn.functional.cross_entropy(scores, labels[at], reduction="sum"))
            replaced["correct"] += int((scores.argmax(-1) == labels[at]).sum())
            replaced["plateau"] += int((labels[at] == top_token).sum())
            replaced["count"] += int(at.sum())
        if count == 0:
            raise ValueError(f"{shards_dir}: no [MASK]ed positions in the first {n} held-out sequences")
        rows = np.unique(np.linspace(0, len(dataset) - 1, num=min(cos_rows, len(dataset))).round().astype(np.int64))
        clean = CorruptionCollator(("original",), dataset.special_tokens, dataset.vocab_size, seed).collate(
            *dataset.take(rows), rows)
        body = model.base_model if masked_lm_dir(model_dir) == model_dir else _main_body(model_dir, device)
        hidden = body(input_ids=clean["input_ids"].to(device),
                      attention_mask=clean["attention_mask"].to(device)).last_hidden_state.cpu()
        content = clean["attention_mask"].bool() & ~clean["special_mask"].bool()
        cosine = mean_token_cosine(hidden, content)
    return {"mlm_loss": total_loss / count, "mlm_acc": correct / count, "unigram_acc": plateau / count,
            "masked_tokens": count, "selected_acc": selected_correct / selected_count,
            "kept_acc": kept_correct / max(kept_count, 1), "kept_tokens": kept_count,
            "replaced_loss": replaced["loss"] / max(replaced["count"], 1),
            "replaced_acc": replaced["correct"] / max(replaced["count"], 1),
            "replaced_unigram_acc": replaced["plateau"] / max(replaced["count"], 1), "replaced_tokens": replaced["count"],
            "sequences": n, "token_cosine": cosine, "cosine_tokens": int(content.sum()),
            "collapsed": bool(cosine > COLLAPSE_COSINE)}


def finetune_sst2(model_dir: Path, sst2_dir: Path, select_file: Path, args, output: Path, seeds: Sequence[int],
                  with_test: bool = False, random_init: bool = False, task: str = "sst2") -> dict:
    """`pipeline.eval.finetune` on SST-2 with the study's fine-tuning settings and fine-tuning `seeds`;
    returns, per model ("pretrained", and "random_init" when asked), every seed's accuracy on dev /
    select (/ test) and their means. The full finetune output (every seed, predictions) is kept at
    `output`."""
    from pipeline.eval.finetune import build_parser, finetune

    eval_files = [str(select_file)] + (["test.tsv"] if with_test else [])
    argv = ["--model", str(model_dir), "--task-dir", str(sst2_dir), "--task", task,
            "--train-subset", str(args.sst2_train), "--subset-seed", str(args.subset_seed),
            "--seeds", *map(str, seeds), "--lr", str(args.finetune_lr),
            "--epochs", str(args.finetune_epochs), "--batch-size", "32",
            "--eval-file", *eval_files, "--output", str(output)]
    if args.device:
        argv += ["--device", args.device]
    if random_init:
        argv.append("--random-init")
    result = finetune(build_parser().parse_args(argv))
    write_atomic(output, json.dumps(result, indent=2) + "\n", shared=True, parents=True)
    out = {"pretrained": summarize_finetune(result["runs"])}
    if random_init:
        out["random_init"] = summarize_finetune(result["random_init"]["runs"])
    return out


def merge_finetune_summaries(parts: Sequence[dict]) -> dict:
    """One `finetune_sst2` record from records of disjoint seed sets (in the given order): per model and
    split, the seeds' accuracies concatenated and their mean recomputed. A split is kept only when
    every part has it (a mean over a subset of the seeds would be a different figure)."""
    merged: dict[str, dict] = {}
    for model in parts[0] if parts else {}:
        splits = set.intersection(*(set(part.get(model, {})) for part in parts))
        merged[model] = {}
        for split in sorted(splits):
            values = [v for part in parts for v in part[model][split]["seeds"]]
            merged[model][split] = {"seeds": values, "mean": float(np.mean(values))}
    return merged


def summarize_finetune(runs: list[dict]) -> dict:
    """{split: {"seeds": [accuracy per fine-tuning seed], "mean": ...}} for dev, select, test."""
    per_split: dict[str, list[float]] = {"dev": [r["metrics"]["accuracy"] for r in runs]}
    for run in runs:
        for split, metrics in run.get("eval_file_metrics", {}).items():
            per_split.setdefault(split, []).append(metrics["accuracy"])
    return {split: {"seeds": values, "mean": float(np.mean(values))} for split, values in per_split.items()}


def top_token_of(shards_dir: Path) -> int:
    """The unigram predictor's answer: the most frequent token of a bounded sample of training rows."""
    from pipeline.data.reader import ShardDataset
    from pipeline.monitor.health import unigram_counts

    return int(unigram_counts(ShardDataset(shards_dir)).argmax())


def conversion_problem(objectives: dict, arch: str) -> str:
    """'' when `convert_once` can convert a run of `objectives` (name -> weight) and `model.arch` `arch`, else
    `cpt-convert`'s refusal (`electra_adapter.export_refusal`): an ELECTRA run is converted with its
    generator, so a ModernBERT ELECTRA (no Hugging Face generator) or one beside an MLM-head objective cannot be
    evaluated. `spec.check_conversions` asks before any job, not after the pretraining."""
    from pipeline.export.electra_adapter import export_refusal, is_electra_run

    return export_refusal(objectives, arch, with_generator=is_electra_run(objectives))


def convert_once(tag_dir: Path, hf_dir: Path) -> Path:
    """The Hugging Face conversion of a checkpoint tag, made once (the directory appears complete
    or not at all: `pipeline.export.convert` renames a finished temporary directory); an ELECTRA run's
    with its generator (its masked LM, `masked_lm_dir`)."""
    from pipeline.export.convert import convert
    from pipeline.export.electra_adapter import is_electra_run
    from pipeline.train.run_meta import RunMeta

    if (hf_dir / "config.json").is_file():
        return hf_dir
    return convert(tag_dir, hf_dir, overwrite=True, with_generator=is_electra_run(RunMeta.read(tag_dir).objectives))


def masked_lm_dir(model_dir: Path) -> Path:
    """Where a converted directory's masked LM is: the directory itself, or an ELECTRA export's `generator/`."""
    from pipeline.export.electra_adapter import DISCRIMINATOR_CLASS
    from pipeline.export.generator_record import generator_problem

    architectures = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []
    if DISCRIMINATOR_CLASS not in architectures:
        return Path(model_dir)
    swapped = generator_problem(model_dir)  # another run's generator/ would give its numbers as this run's
    if swapped:
        raise ValueError(swapped)
    generator = Path(model_dir) / "generator"
    if not (generator / "config.json").is_file():
        raise ValueError(f"{model_dir}: an ELECTRA discriminator without its generator/ (convert with --with-generator): "
                         "no masked LM to evaluate")
    return generator


def _main_body(model_dir: Path, device: str):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(model_dir)).eval().to(device)
