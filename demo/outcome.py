"""What the demo's pretraining changed, on text it never saw: the run's held-out validation against the
same model at its initialisation (`python -m demo.outcome DEMO_OUT`, also the demo's last stage).

Held-out text: the documents `data_prep.build_shards --holdout-fraction` held out (by document,
`data_prep.holdout`) into `DEMO_OUT/shards/validation`, the run's `eval.shards_dir`.

The masked-LM numbers have one home, the validation during training (`pipeline.train.validation`):

* trained: the run's last `val/` record in its `metrics.jsonl` — `val/mlm_head/accuracy` and
  `val/mlm_head/loss` on the held-out masked positions (ELECTRA, whose main model is a discriminator with
  no masked LM: its generator's, `val/electra/gen_accuracy` and `val/electra/gen_loss`, the masked LM the
  run trains and the demo's fill-mask uses), `val/health/unigram_accuracy` (the plateau: always
  answering the training corpus's most frequent token) and `val/health/token_cosine` (the mean cosine
  between the last hidden states of two different tokens; above 0.9 = collapsed);
* random init: the same `Validator`, same held-out rows and masks (`eval.seed`), applied to the run's own
  model at step 0 (`build_run_model`: the run's seed, its unigram output-bias start) — a working run
  beats both it and the plateau.

The chosen objective's own learning signals, from the same two validation records: each `val/<objective>/...`
term against its reference (`pipeline.monitor.signals`: a contrastive loss against its chance level ln(candidates),
a masked-token accuracy against the plateau, an LM loss against the unigram entropy), trained and at init, so the
outcome measures what the chosen objective trains (`--objective mlm`: `val/mlm/loss`, `val/mlm/accuracy`).

Besides, for TACO runs only (the objective they probe), on the converted (Hugging Face) checkpoint and a
random-init model of the same shape, on held-out rows in random order, what validation does not measure:

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
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from pipeline.io import write_atomic
from pipeline.tokenizer_checks import converted_tokenizer_problem

HELDOUT_ROWS = 256
TACO_DEFAULTS = dict(window=5, num_negatives=50, tau=0.07)  # TokenAlignmentContrastive's (the paper's)


def taco_options(hf_dir: Path) -> dict:
    """The run's TACO window / negatives / tau (the export's pipeline_meta.json), else the defaults."""
    meta = hf_dir / "pipeline_meta.json"
    chosen = json.loads(meta.read_text()).get("objective_options", {}).get("taco", {}) if meta.is_file() else {}
    return {k: chosen.get(k, v) for k, v in TACO_DEFAULTS.items()}


def heldout_shards(demo_out: Path) -> Path:
    """The demo's held-out shard set (`build_shards(holdout_fraction=...)`'s validation directory)."""
    from data_prep.holdout import DEFAULT_SUBDIR

    return demo_out / "shards" / DEFAULT_SUBDIR


def random_tokens(batch: dict, vocab_size: int, structure: Sequence[int], seed: int) -> torch.Tensor:
    """The masked view with every content token replaced by a random non-structure token."""
    generator = torch.Generator().manual_seed(seed)
    ids = batch["masked_ids"].clone()
    content = batch["attention_mask"].bool() & ~batch["special_mask"].bool()
    allowed = torch.tensor([t for t in range(vocab_size) if t not in set(structure)])
    ids[content] = allowed[torch.randint(len(allowed), (int(content.sum()),), generator=generator)]
    return ids


def evaluate(model, batches: list[dict], structure: Sequence[int], vocab_size: int, taco: dict) -> dict:
    """TACO's loss on the held-out rows and on random tokens, and the leak counts (module doc)."""
    from pipeline.data.batch import content_tokens
    from pipeline.kernels.functional import token_contrastive_loss
    from pipeline.objectives.taco import sample_taco_indices

    sums = dict(taco=0.0, taco_random=0.0, anchors=0, pos_is_anchor=0, pos_other_doc=0, neg_same_doc=0)
    with torch.no_grad():
        for i, batch in enumerate(batches):
            out = model(input_ids=batch["masked_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
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
    anchors = max(1, sums["anchors"])
    return {"taco_loss": sums["taco"] / anchors, "taco_loss_random_tokens": sums["taco_random"] / anchors,
            "taco_anchors": sums["anchors"], "leak_positive_is_anchor": sums["pos_is_anchor"],
            "leak_positive_other_document": sums["pos_other_doc"], "leak_negative_same_document": sums["neg_same_doc"]}


def measure(hf_dir: Path, heldout: Path, seed: int = 0, rows: int = HELDOUT_ROWS) -> dict:
    """TACO and leak checks (`evaluate`) of the converted model vs the same architecture at random init."""
    from transformers import AutoConfig, AutoModel, BertConfig, BertForMaskedLM

    from pipeline.data.batch import STRUCTURE_TOKENS
    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.reader import ShardDataset

    dataset = ShardDataset(heldout)
    collator = CorruptionCollator({"masked"}, dataset.special_tokens, dataset.vocab_size, seed)
    n = min(rows, len(dataset))
    # rows in a random order, as training draws them: consecutive rows continue one document, and as
    # each other's TACO negatives they would be harder than the ones training saw
    order = np.sort(np.random.default_rng(seed).permutation(len(dataset))[:n])
    order = np.random.default_rng(seed + 1).permutation(order)
    batches = [collator.collate(*dataset.take(order[s:s + 32]), order[s:s + 32]) for s in range(0, n, 32)]
    structure = [dataset.special_tokens[name] for name in STRUCTURE_TOKENS if name in dataset.special_tokens]
    config = AutoConfig.from_pretrained(str(hf_dir))
    # a BERT export as before; any other class (ELECTRA's discriminator) through its body, whose hidden
    # states are all TACO's loss reads
    trained = (BertForMaskedLM if config.model_type == "bert" else AutoModel).from_pretrained(str(hf_dir)).eval()
    torch.manual_seed(seed)
    random_init = (BertForMaskedLM(BertConfig.from_pretrained(str(hf_dir))) if config.model_type == "bert"
                   else AutoModel.from_config(config)).eval()
    taco = taco_options(hf_dir)
    result = {"heldout_sequences": n, "taco_options": taco,
              "trained": evaluate(trained, batches, structure, dataset.vocab_size, taco),
              "random_init": evaluate(random_init, batches, structure, dataset.vocab_size, taco)}
    result["taco_loss_uniform_guess"] = math.log(1 + taco["num_negatives"])  # all candidates alike
    return result


#: outcome key <- `val/` metric (`pipeline.train.validation`): the masked-LM yardstick, plateau, collapse check
VALIDATION_KEYS = {"mlm_acc": "val/mlm_head/accuracy", "mlm_loss": "val/mlm_head/loss",
                   "unigram_acc": "val/health/unigram_accuracy", "token_cosine": "val/health/token_cosine"}
#: the masked LM of a run whose main model has none (ELECTRA's discriminator): its generator's, same positions
GENERATOR_KEYS = {"mlm_acc": "val/electra/gen_accuracy", "mlm_loss": "val/electra/gen_loss"}


def validation_numbers(record: dict, where: str) -> dict:
    """The outcome's masked-LM numbers from one validation record (`VALIDATION_KEYS`; an ELECTRA run's
    generator for the masked LM, `GENERATOR_KEYS`)."""
    keys = dict(VALIDATION_KEYS)
    if not isinstance(record.get(keys["mlm_acc"]), (int, float)) and isinstance(record.get(GENERATOR_KEYS["mlm_acc"]), (int, float)):
        keys.update(GENERATOR_KEYS)
    missing = [k for k in keys.values() if not isinstance(record.get(k), (int, float))]
    if missing:
        raise ValueError(f"{where}: the validation record logs no {', '.join(missing)} (an objective without the "
                         "shared MLM head, or a run without eval.shards_dir)")
    return {key: float(record[name]) for key, name in keys.items()}


def last_validation(metrics_path: Path) -> dict:
    """The run's last `val/` record in its `metrics.jsonl` (the trained model's held-out numbers)."""
    from pipeline.train.metrics import read_jsonl
    from pipeline.train.validation import is_validation_record

    records = [r for r in read_jsonl(metrics_path) if is_validation_record(r)] if metrics_path.is_file() else []
    if not records:
        raise ValueError(f"{metrics_path}: no validation record (val/*); the run needs eval.shards_dir and eval.every")
    return records[-1]


def initial_validation(preset: str, overrides: Sequence[str]) -> dict:
    """The run's `Validator` (same held-out rows, masks and metrics as during training) applied to the run's
    own model at initialisation (`build_run_model`, the run's seed): the random-init reference, in-process
    on one CPU rank."""
    from pipeline.train.loop import build_run_model, open_data
    from pipeline.train.run_config import check_run, load_config
    from pipeline.train.validation import open_validator

    cfg = load_config(preset, overrides)
    plan = check_run(cfg, 1, False, fresh_start=True)
    run_cfg = plan.schedule.run_config(plan.schedule.phases[0])
    model = build_run_model(run_cfg, plan)
    open_data(run_cfg, plan, model)  # the health references (plateau) from the training shards, as the run sets them
    validator = open_validator(cfg, plan, model, 0, 1, torch.device("cpu"))
    if validator is None:
        raise ValueError(f"{preset} {' '.join(overrides)}: no eval.shards_dir, so no validation to apply")
    return {"step": 0, **validator.evaluate(model, model, 0, cfg.train.total_steps, plan.batch.grad_accum)}


def objective_signals(final: dict, start: dict, objectives: Sequence[str]) -> list[dict]:
    """The chosen objectives' own `val/<objective>/...` learning signals (`val_signals`), trained (`final`)
    beside the same term at init (`start`): [{"term", "trained", "random_init", "reference", "reference_kind",
    "direction", "learned", "text"}]."""
    from pipeline.monitor.signals import format_signal
    from pipeline.train.validation import val_signals

    at_init = {s.term: s for s in val_signals(start)}
    out = []
    for signal in val_signals(final):
        if not any(signal.term.startswith(f"val/{name}/") for name in objectives):
            continue
        init = at_init.get(signal.term)
        out.append({"term": signal.term, "trained": signal.value, "random_init": init.value if init else None,
                    "reference": signal.reference, "reference_kind": signal.kind, "direction": signal.direction,
                    "learned": signal.learned, "text": format_signal(signal)})
    return out


def run_objectives(hf_dir: Path) -> list[str]:
    """The objectives the converted run trained (its pipeline_meta.json), by weight."""
    meta = hf_dir / "pipeline_meta.json"
    objectives = json.loads(meta.read_text()).get("objectives", {}) if meta.is_file() else {}
    return [name for name, weight in sorted(objectives.items(), key=lambda kv: -float(kv[1])) if float(weight)]


def outcome(demo_out: Path, hf_dir: Path, run_dir: Path, preset: str, overrides: Sequence[str]) -> dict:
    """The demo's outcome (module doc): validation's masked-LM numbers and the chosen objective's own signals,
    trained and at init; for a TACO run, merged with the converted model's TACO and leak checks."""
    final = last_validation(run_dir / "metrics.jsonl")
    start = initial_validation(preset, overrides)
    objectives = run_objectives(hf_dir)
    result = measure(hf_dir, heldout_shards(demo_out)) if "taco" in objectives else {"trained": {}, "random_init": {}}
    result["objectives"] = objectives
    result["validation_step"] = final["step"]
    result["trained"].update(validation_numbers(final, f"{run_dir / 'metrics.jsonl'} step {final['step']}"))
    result["random_init"].update(validation_numbers(start, "the validation of the initial model"))
    result["objective_signals"] = objective_signals(final, start, objectives)
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
    lines = [
        f"held-out text (validation at step {result.get('validation_step', '?')}, documents the demo never "
        "trained on):",
        f"  masked-LM accuracy  {t['mlm_acc']:.3f} trained   {r['mlm_acc']:.3f} random init   "
        f"{t['unigram_acc']:.3f} always the most frequent token",
        f"  masked-LM loss      {t['mlm_loss']:.2f}  trained   {r['mlm_loss']:.2f}  random init",
        f"  token cosine        {t['token_cosine']:.2f}  trained   {r['token_cosine']:.2f}  random init   (> 0.9: collapsed)",
    ]
    names = "+".join(result.get("objectives") or []) or "the objective"
    for signal in result.get("objective_signals") or []:  # what the chosen objective itself trains
        init = "-" if signal["random_init"] is None else f"{signal['random_init']:.3f}"
        lines.append(f"  {names} signal  {signal['text']}; random init {init}")
    if "taco_loss" in t:  # TACO runs: the probes of its sampling
        lines += [
            f"  TACO loss           {t['taco_loss']:.4f} trained, {t['taco_loss_random_tokens']:.4f} on random tokens; "
            f"{r['taco_loss']:.3f} random init; {result['taco_loss_uniform_guess']:.2f} = no preference "
            f"({result['taco_options']['num_negatives']} negatives, tau {result['taco_options']['tau']})",
            f"  leak checks (must be 0): positive = anchor {t['leak_positive_is_anchor']}, positive in another "
            f"document {t['leak_positive_other_document']}, negative in the anchor's document "
            f"{t['leak_negative_same_document']}"]
    lines.append(f"  verdict: {verdict(result)}")
    return lines


def write_outcome(out: Path, result: dict) -> None:
    """`DEMO_OUT/outcome.json`, atomically."""
    write_atomic(out / "outcome.json", json.dumps(result, indent=2) + "\n")


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
        hf_dir, _ = load_demo(out, args.objective)
        training = json.loads((out / "demo.json").read_text()).get("training")
        if not training:
            raise ValueError(f"{out / 'demo.json'}: no training record (a demo output from before validation "
                             "during training, or a --corpus too small to hold out): re-run the demo")
        result = outcome(out, hf_dir, Path(training["run_dir"]), training["preset"], training["overrides"])
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(report_lines(result)))
    write_outcome(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
