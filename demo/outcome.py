"""What the demo's pretraining changed, on text it never saw: the converted checkpoint against a
random-init model of the same shape (`python -m demo.outcome DEMO_OUT`, also the demo's last stage).

Held-out text: the one document in ten the corpus stage held out (`demo.corpus.HELDOUT_EVERY`,
`DEMO_OUT/heldout/heldout.txt`: the corpus's own sources, no paragraph of the training text),
tokenized with the demo's tokenizer into `DEMO_OUT/heldout/shards`.

For both models, on the same held-out rows (a random sample in random order, as training draws
them) and masks (BERT 15% masking, the collator's seed):

* masked-LM accuracy and loss at the masked positions, and the unigram plateau (the accuracy of
  always answering the training corpus's most frequent token) — a working run beats both the
  random model and the plateau;
* the mean cosine between the last hidden states of two different tokens (`pipeline.monitor.health`;
  above 0.9 = collapsed: every token has nearly the same vector);
* TACO's loss (Fu et al. 2022, Eq. 6-8; g = hidden_states[-1] - hidden_states[0], the masked view,
  negatives from other documents, `pipeline.objectives.taco`, with the run's window, negatives and
  tau: the demo's `tiny-taco` preset draws 8 negatives, not the paper's 50) on held-out rows, and the same with every content token replaced by a uniformly random token (documents,
  positions and lengths kept). If the second stays as low as the first, the objective is solved by
  telling documents apart whatever they contain — its easy optimum by design (positives share the
  anchor's context, negatives come from other contexts), not a leak;
* the leak checks of the sampled pairs: positives equal to their anchor, positives outside the
  anchor's document, negatives inside it (all must be 0).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from pipeline.tokenizer_checks import converted_tokenizer_problem

HELDOUT_ROWS = 256
TACO_DEFAULTS = dict(window=5, num_negatives=50, tau=0.07)  # TokenAlignmentContrastive's (the paper's)


def taco_options(hf_dir: Path) -> dict:
    """The run's TACO window / negatives / tau (the export's pipeline_meta.json), else the defaults."""
    meta = hf_dir / "pipeline_meta.json"
    chosen = json.loads(meta.read_text()).get("objective_options", {}).get("taco", {}) if meta.is_file() else {}
    return {k: chosen.get(k, v) for k, v in TACO_DEFAULTS.items()}


def heldout_text(demo_out: Path) -> Path:
    """The held-out text the demo's corpus stage wrote (`demo.corpus.write_corpus(heldout_path=...)`)."""
    return demo_out / "heldout" / "heldout.txt"


def build_heldout(demo_out: Path, seq_len: int = 128) -> Path:
    """`DEMO_OUT/heldout/shards`: the held-out documents, tokenized with the demo's tokenizer."""
    from data_prep.build_shards import build_shards

    text = heldout_text(demo_out)
    if not text.is_file():
        raise FileNotFoundError(f"{text}: no held-out text (written by the demo's corpus stage; a demo output from "
                                "before the held-out split, or a --corpus too small to split, has none): re-run the demo")
    shards = demo_out / "heldout" / "shards"
    build_shards([str(text)], demo_out / "tokenizer", shards, seq_len=seq_len, num_proc=1, progress=False)
    return shards


def random_tokens(batch: dict, vocab_size: int, structure: Sequence[int], seed: int) -> torch.Tensor:
    """The masked view with every content token replaced by a random non-structure token."""
    generator = torch.Generator().manual_seed(seed)
    ids = batch["masked_ids"].clone()
    content = batch["attention_mask"].bool() & ~batch["special_mask"].bool()
    allowed = torch.tensor([t for t in range(vocab_size) if t not in set(structure)])
    ids[content] = allowed[torch.randint(len(allowed), (int(content.sum()),), generator=generator)]
    return ids


def evaluate(model, batches: list[dict], top_token: int, structure: Sequence[int], vocab_size: int,
             taco: dict) -> dict:
    from pipeline.data.batch import IGNORE_INDEX, content_tokens
    from pipeline.monitor.health import mean_token_cosine
    from pipeline.kernels.functional import token_contrastive_loss
    from pipeline.objectives.taco import sample_taco_indices

    sums = dict(loss=0.0, correct=0, plateau=0, count=0, taco=0.0, taco_random=0.0, anchors=0,
                pos_is_anchor=0, pos_other_doc=0, neg_same_doc=0)
    cosines = []
    with torch.no_grad():
        for i, batch in enumerate(batches):
            labels = batch["mlm_labels"]
            out = model(input_ids=batch["masked_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
            selected = labels != IGNORE_INDEX
            scores, target = out.logits[selected].float(), labels[selected]
            sums["loss"] += float(torch.nn.functional.cross_entropy(scores, target, reduction="sum"))
            sums["correct"] += int((scores.argmax(-1) == target).sum())
            sums["plateau"] += int((target == top_token).sum())
            sums["count"] += int(selected.sum())
            eligible = content_tokens(batch)
            docs = batch["document_ids"]
            a, p, n = sample_taco_indices(eligible, eligible, taco["window"], taco["num_negatives"],
                                          torch.Generator().manual_seed(i), documents=docs)
            flat_docs = (docs + docs.shape[1] * torch.arange(docs.shape[0])[:, None]).reshape(-1)  # unique per row
            sums["pos_is_anchor"] += int((p == a).sum())
            sums["pos_other_doc"] += int((flat_docs[p] != flat_docs[a]).sum())
            sums["neg_same_doc"] += int((flat_docs[n] == flat_docs[a][:, None]).sum())
            sums["anchors"] += int(a.numel())
            g = (out.hidden_states[-1] - out.hidden_states[0]).reshape(-1, out.hidden_states[0].shape[-1])
            sums["taco"] += float(token_contrastive_loss(g, a, p, n, taco["tau"])) * a.numel()
            noise = random_tokens(batch, vocab_size, structure, seed=i)
            hs = model(input_ids=noise, attention_mask=batch["attention_mask"], output_hidden_states=True).hidden_states
            g_noise = (hs[-1] - hs[0]).reshape(-1, hs[0].shape[-1])
            sums["taco_random"] += float(token_contrastive_loss(g_noise, a, p, n, taco["tau"])) * a.numel()
            cosines.append(mean_token_cosine(out.hidden_states[-1], eligible))
    count, anchors = max(1, sums["count"]), max(1, sums["anchors"])
    return {"mlm_acc": sums["correct"] / count, "mlm_loss": sums["loss"] / count,
            "unigram_acc": sums["plateau"] / count, "masked_tokens": sums["count"],
            "token_cosine": float(np.mean(cosines)), "taco_loss": sums["taco"] / anchors,
            "taco_loss_random_tokens": sums["taco_random"] / anchors, "taco_anchors": sums["anchors"],
            "leak_positive_is_anchor": sums["pos_is_anchor"], "leak_positive_other_document": sums["pos_other_doc"],
            "leak_negative_same_document": sums["neg_same_doc"]}


def measure(hf_dir: Path, heldout_shards: Path, train_shards: Path, seed: int = 0, rows: int = HELDOUT_ROWS) -> dict:
    """Trained (converted) model vs the same architecture at random init, on held-out rows."""
    from transformers import BertConfig, BertForMaskedLM

    from pipeline.data.batch import STRUCTURE_TOKENS
    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.reader import ShardDataset
    from pipeline.monitor.health import unigram_counts

    dataset = ShardDataset(heldout_shards)
    top_token = int(unigram_counts(ShardDataset(train_shards)).argmax())
    collator = CorruptionCollator({"masked"}, dataset.special_tokens, dataset.vocab_size, seed)
    n = min(rows, len(dataset))
    # rows in a random order, as training draws them: consecutive rows continue one document, and as
    # each other's TACO negatives they would be harder than the ones training saw
    order = np.sort(np.random.default_rng(seed).permutation(len(dataset))[:n])
    order = np.random.default_rng(seed + 1).permutation(order)
    batches = [collator.collate(*dataset.take(order[s:s + 32]), order[s:s + 32]) for s in range(0, n, 32)]
    structure = [dataset.special_tokens[name] for name in STRUCTURE_TOKENS if name in dataset.special_tokens]
    trained = BertForMaskedLM.from_pretrained(str(hf_dir)).eval()
    torch.manual_seed(seed)
    random_init = BertForMaskedLM(BertConfig.from_pretrained(str(hf_dir))).eval()
    taco = taco_options(hf_dir)
    result = {"heldout_sequences": n, "taco_options": taco,
              "trained": evaluate(trained, batches, top_token, structure, dataset.vocab_size, taco),
              "random_init": evaluate(random_init, batches, top_token, structure, dataset.vocab_size, taco)}
    result["taco_loss_uniform_guess"] = math.log(1 + taco["num_negatives"])  # all candidates alike
    return result


def verdict(result: dict) -> str:
    t, r = result["trained"], result["random_init"]
    working = t["mlm_acc"] > max(r["mlm_acc"], t["unigram_acc"]) and t["token_cosine"] < 0.9
    return ("working: the checkpoint predicts held-out masked tokens better than a random model and than always "
            "answering the most frequent token, and its token vectors are not collapsed" if working else
            "NOT working: held-out masked accuracy does not beat the random model and the plateau, or the token "
            "vectors collapsed; check the run's metrics.jsonl (health/*) and docs/demo.md")


def report_lines(result: dict) -> list[str]:
    t, r = result["trained"], result["random_init"]
    return [
        f"held-out text ({result['heldout_sequences']} sequences the demo never trained on):",
        f"  masked-LM accuracy  {t['mlm_acc']:.3f} trained   {r['mlm_acc']:.3f} random init   "
        f"{t['unigram_acc']:.3f} always the most frequent token",
        f"  masked-LM loss      {t['mlm_loss']:.2f}  trained   {r['mlm_loss']:.2f}  random init",
        f"  token cosine        {t['token_cosine']:.2f}  trained   {r['token_cosine']:.2f}  random init   (> 0.9: collapsed)",
        f"  TACO loss           {t['taco_loss']:.4f} trained, {t['taco_loss_random_tokens']:.4f} on random tokens; "
        f"{r['taco_loss']:.3f} random init; {result['taco_loss_uniform_guess']:.2f} = no preference "
        f"({result['taco_options']['num_negatives']} negatives, tau {result['taco_options']['tau']})",
        f"  leak checks (must be 0): positive = anchor {t['leak_positive_is_anchor']}, positive in another document "
        f"{t['leak_positive_other_document']}, negative in the anchor's document {t['leak_negative_same_document']}",
        f"  verdict: {verdict(result)}",
    ]


def write_outcome(out: Path, result: dict) -> None:
    """`DEMO_OUT/outcome.json`, atomically."""
    tmp = out / "outcome.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out / "outcome.json")


def load_demo(out: Path, objective: Optional[str]) -> tuple[Path, int]:
    """The converted model and sequence length of the demo output `out`, or a ValueError saying what is
    missing: a demo that failed or was interrupted leaves `demo.json` with its status, stage and error."""
    summary_path = out / "demo.json"
    if not summary_path.is_file():
        raise ValueError(f"{out}: not a demo output (no demo.json); give the demo's --out directory")
    summary = json.loads(summary_path.read_text())
    status = summary.get("status", "unknown")
    state = (f"the demo's status is {status!r}" + (f" at stage {summary['stage']!r}" if summary.get("stage") else "")
             + (f" ({summary['error']})" if summary.get("error") else ""))
    objective = objective or summary.get("objective")
    if not objective:
        raise ValueError(f"{summary_path}: names no objective ({state}); pass --objective NAME or re-run the demo")
    hf_dir = out / "hf" / objective
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{hf_dir}: no converted model ({state}); re-run the demo (bash scripts/demo.sh)")
    swapped = converted_tokenizer_problem(hf_dir, "demo output")
    if swapped:
        raise ValueError(swapped)
    return hf_dir, int(summary.get("seq_len", 128))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.outcome", description=__doc__.split("\n\n")[0])
    parser.add_argument("demo_out", help="a demo's --out directory (demo_output) that reached its conversion stage")
    parser.add_argument("--objective", default=None, help="which hf/<objective> model (default: the demo's)")
    args = parser.parse_args(argv)
    out = Path(args.demo_out)
    try:
        hf_dir, seq_len = load_demo(out, args.objective)
        heldout = build_heldout(out, seq_len=seq_len)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = measure(hf_dir, heldout, out / "shards")
    print("\n".join(report_lines(result)))
    write_outcome(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
