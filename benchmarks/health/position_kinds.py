"""What a converted masked LM learned where, split by what BERT's masking put at the selected position.

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m benchmarks.health.position_kinds \\
        --shards WORK/shards-heldout-report --train-shards WORK/shards-train \\
        WORK/runs/mlm-nce/lr_0.001/seed_1/hf/step_300 WORK/runs/mlm/lr_0.001/seed_1/hf/step_300

BERT's masking replaces 80% of the selected tokens by `[MASK]`, 10% by a random token and leaves
10% unchanged. At an unchanged ("kept") position a model scores by copying its input, at a random
one by knowing its input is probably wrong; only at `[MASK]` does the score measure what the model
reads from the context (issue 29: a BERT-NCE run that learned nothing at `[MASK]` still left chance by
copying). Per kind, on held-out shards with the pipeline's masking and a fixed seed, through the
exported masked-LM head (for BERT-NCE the conversion adds log q to the bias, so the logits are log
p(v | c) + const):

  - `lm_loss`, `accuracy`: the full-vocabulary cross entropy and argmax accuracy, beside
    `unigram_entropy` = -mean log q(target) and `plateau` (always the training shards' most frequent
    token) at the same positions;
  - `nce_loss`, `nce_chance`: BERT-NCE's loss with the run's pool and number of negatives (K draws
    from the tokens of the other sequences of the batch, copies of the target masked out, the
    pipeline's own `NegativeTokenSampler`) on the scores s(v, c) = logit(v) - log q(v), the head
    BERT-NCE trains (`pipeline.objectives.mlm_nce`), and its chance mean ln(1 + |Neg|). Scoring an MLM
    the same way measures how much of the InfoNCE bound its context information buys:
    L_NCE >= ln(K + 1) - I (Oord et al. 2018, Sec. 2.3), with I estimated by `unigram_entropy -
    lm_loss` of the best masked LM at the same budget.

Prints one table row per model and kind (JSON with `--json`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

KINDS = ("mask", "random", "kept")
#: The collator's replacement fractions per view: BERT's defaults, and tiny-infoword's SpanBERT spans.
SPAN_FRACTIONS = {"masked": {}, "span_masked": {"span_mask_fraction": 0.8, "span_random_fraction": 0.1}}


def position_kinds(model_dir: Path, shards_dir: Path, train_shards: Path, max_sequences: int = 1024,
                   num_negatives: int = 16, negatives: str = "other_sequences", view: str = "masked",
                   batch_size: int = 32, seed: int = 0) -> dict[str, dict]:
    """kind -> metrics (module docstring) of the converted model in `model_dir` on `shards_dir`, masked as
    `view` says: "masked" (BERT's, the held-out evaluation's) or "span_masked" (InfoWord's n-gram spans
    with SpanBERT's per-span 80/10/10, `tiny-infoword`'s)."""
    import torch
    from transformers import AutoModelForMaskedLM

    from pipeline.data.batch import masked_view_keys
    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.reader import ShardDataset
    from pipeline.monitor.health import unigram_counts, unigram_log_probs
    from pipeline.objectives.mlm_nce import NegativeTokenSampler

    dataset = ShardDataset(shards_dir)
    counts = unigram_counts(ShardDataset(train_shards))
    log_q = unigram_log_probs(counts).float()
    top = int(counts.argmax())
    ids_key, labels_key = masked_view_keys(view, SPAN_FRACTIONS)
    collator = CorruptionCollator({view}, dataset.special_tokens, dataset.vocab_size, seed, **SPAN_FRACTIONS[view])
    sampler = NegativeTokenSampler(dataset.special_tokens, dataset.vocab_size, negatives, num_negatives)
    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForMaskedLM.from_pretrained(str(model_dir)).eval()
    mask_id = dataset.special_tokens["mask"]
    sums = {k: dict.fromkeys(("n", "lm_loss", "correct", "plateau", "entropy", "nce_loss", "nce_chance"), 0.0)
            for k in KINDS}
    n = min(len(dataset), max_sequences)
    with torch.no_grad():
        for start in range(0, n, batch_size):
            rows = np.arange(start, min(n, start + batch_size))
            batch = collator.collate(*dataset.take(rows), rows)
            inputs, labels = batch[ids_key], batch[labels_key]
            logits = model(input_ids=inputs, attention_mask=batch["attention_mask"]).logits.float()
            flat = torch.nonzero(labels.reshape(-1) != -100).squeeze(1)
            targets, shown = labels.reshape(-1)[flat], inputs.reshape(-1)[flat]
            scores = logits.reshape(-1, logits.shape[-1])[flat]
            lm = torch.nn.functional.cross_entropy(scores, targets, reduction="none")
            neg = sampler(batch, labels, flat, generator).ids  # [N, K]
            candidates = torch.cat([targets[:, None], neg], 1)
            s = (scores - log_q).gather(1, candidates)  # the NCE head's scores: logit - log q
            s[:, 1:] = s[:, 1:].masked_fill(neg == targets[:, None], float("-inf"))
            nce = torch.logsumexp(s, 1) - s[:, 0]
            chance = torch.log1p((neg != targets[:, None]).sum(1).float())
            kind = {"mask": shown == mask_id, "kept": shown == targets, "random": (shown != mask_id) & (shown != targets)}
            for k, sel in kind.items():
                acc = sums[k]
                acc["n"] += int(sel.sum())
                acc["lm_loss"] += float(lm[sel].sum())
                acc["correct"] += int((scores[sel].argmax(1) == targets[sel]).sum())
                acc["plateau"] += int((targets[sel] == top).sum())
                acc["entropy"] -= float(log_q[targets[sel]].sum())
                acc["nce_loss"] += float(nce[sel].sum())
                acc["nce_chance"] += float(chance[sel].sum())
    out = {}
    for k, acc in sums.items():
        m = max(acc["n"], 1)
        out[k] = {"positions": int(acc["n"]), "lm_loss": acc["lm_loss"] / m, "unigram_entropy": acc["entropy"] / m,
                  "accuracy": acc["correct"] / m, "plateau": acc["plateau"] / m,
                  "nce_loss": acc["nce_loss"] / m, "nce_chance": acc["nce_chance"] / m}
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.health.position_kinds", description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="converted Hugging Face directories (runs/<obj>/.../hf/step_N)")
    p.add_argument("--shards", required=True, help="held-out shards (the study's shards-heldout-report)")
    p.add_argument("--train-shards", required=True, help="the training shards (log q, the plateau's token)")
    p.add_argument("--max-sequences", type=int, default=1024)
    p.add_argument("--num-negatives", type=int, default=16)
    p.add_argument("--negatives", default="other_sequences")
    p.add_argument("--view", default="masked", choices=sorted(SPAN_FRACTIONS))
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    results = {}
    print("| model | kind | positions | LM loss (unigram entropy) | accuracy (plateau) | NCE loss / chance |")
    print("|---|---|---|---|---|---|")
    for model in args.models:
        results[model] = position_kinds(Path(model), Path(args.shards), Path(args.train_shards), args.max_sequences,
                                        args.num_negatives, args.negatives, args.view)
        for kind, r in results[model].items():
            print(f"| {model} | {kind} | {r['positions']} | {r['lm_loss']:.3f} ({r['unigram_entropy']:.3f}) | "
                  f"{r['accuracy']:.4f} ({r['plateau']:.4f}) | {r['nce_loss']:.3f} / {r['nce_chance']:.3f} = "
                  f"{r['nce_loss'] / r['nce_chance']:.3f}x |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
