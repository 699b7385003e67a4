"""Does a finished training run learn? Its learning signals, judged after the fact, with held-out numbers.

For every `--run NAME=RUN_DIR[,RUN_DIR...]` (one directory per seed, as `pipeline.train` left it: its
`metrics.jsonl` with every step logged, its final checkpoint):

* the learning signals of `pipeline.monitor.signals` over the last 20% of the logged steps (each term
  against its chance level, the unigram plateau or entropy, the collapse threshold), and whether each
  term with a declared chance (and the AUC) is still improving (`still_improving`: the last window
  against the one before);
* held-out numbers of the final checkpoint (`pipeline.study.evaluate.heldout_metrics` on the converted
  directory, `convert_once`: for ELECTRA through its generator, the token cosine through the
  discriminator) on `--heldout` shards;
* curves every `--curve-every` steps of the terms named by `--curve` (with their references), plotted per
  seed.

    python -m benchmarks.quality.judge_runs --run electra=RUN1,RUN2,RUN3 --heldout SHARDS --top-token-shards \\
        TRAIN_SHARDS --out benchmarks/results/electra_learns --name electra
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from pipeline.report_files import panel_chart, write_report

DEFAULT_CURVES = ("electra/rtd_auc", "electra/gen_accuracy", "electra/gen_loss", "health/token_cosine")
#: Reference drawn beside a curve (the level it must leave).
REFERENCES = {"electra/gen_accuracy": "health/unigram_accuracy", "electra/gen_loss": "health/unigram_entropy",
              "electra/rtd_auc": "electra/rtd_auc_chance", "cocolm/rtd_auc": "cocolm/rtd_auc_chance",
              "mlm/accuracy": "health/unigram_accuracy", "mlm/loss": "health/unigram_entropy"}


def judge_run(run_dir: Path, heldout: Optional[Path], top_token: Optional[int], sequences: int, curves: Sequence[str],
              every: int) -> dict:
    """One run's final signals, trends, held-out numbers and curves (module docstring)."""
    from pipeline.study.evaluate import convert_once, heldout_metrics
    from pipeline.monitor.signals import final_signals, still_improving
    from pipeline.train.checkpoint.tags import list_tags
    from pipeline.train.metrics import read_jsonl
    from pipeline.train.validation import is_validation_record

    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if not is_validation_record(r)]
    if not records:
        raise ValueError(f"--run {run_dir}: no training records in metrics.jsonl")
    signals = final_signals(records)
    trends = {s.term: still_improving(records, s) for s in signals if s.kind == "chance" or s.term.endswith("auc")}
    out = {"run": str(run_dir), "steps": records[-1]["step"], "final_signals": [s.to_dict() for s in signals],
           "learned": {s.term: s.learned for s in signals}, "still_improving": trends,
           "curves": {term: [(r["step"], r.get(term), r.get(REFERENCES.get(term, ""), None))
                             for r in records if r["step"] % every == 0 and term in r] for term in curves}}
    if heldout is not None:
        tags = list_tags(run_dir / "checkpoints")
        if not tags:
            raise ValueError(f"--run {run_dir}: no checkpoint to evaluate")
        step, tag = tags[-1]
        hf = convert_once(tag, run_dir / "hf" / f"step_{step}")
        out["heldout"] = {"step": step, **heldout_metrics(hf, heldout, top_token, sequences)}
    return out


def summary_rows(name: str, judged: list[dict]) -> list[dict]:
    rows = []
    for seed, run in enumerate(judged, 1):
        row = {"model": name, "seed": seed, "steps": run["steps"]}
        for s in run["final_signals"]:
            arrow = "" if s["term"] not in run["still_improving"] else (
                " (still improving)" if run["still_improving"][s["term"]] else " (flat)")
            row[s["term"]] = (f"{s['value']:.3f} vs {s['reference']:.3f}: "
                              f"{'learned' if s['learned'] else 'AT CHANCE'}{arrow}")
        held = run.get("heldout")
        if held:
            row.update(heldout_mlm_acc=f"{held['mlm_acc']:.3f} (plateau {held['unigram_acc']:.3f})",
                       heldout_token_cosine=f"{held['token_cosine']:.3f}")
        rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality.judge_runs", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, help="NAME=RUN_DIR[,RUN_DIR...] (one per seed)")
    p.add_argument("--heldout", default=None, help="held-out shards for the final checkpoint's numbers")
    p.add_argument("--top-token-shards", default=None, help="the training shards (the plateau's most frequent token)")
    p.add_argument("--sequences", type=int, default=256, help="held-out sequences evaluated (default 256)")
    p.add_argument("--curve", action="append", default=None, help="a logged term to plot (default: ELECTRA's)")
    p.add_argument("--curve-every", type=int, default=10)
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="judged_runs")
    p.add_argument("--notes", action="append", default=[])
    args = p.parse_args(argv)
    from pipeline.study.evaluate import top_token_of

    top = top_token_of(Path(args.top_token_shards or args.heldout)) if args.heldout else None
    curves = tuple(args.curve or DEFAULT_CURVES)
    rows, judged_all, panels = [], {}, {}
    for spec in args.run:
        name, _, dirs = spec.partition("=")
        judged = [judge_run(Path(d), Path(args.heldout) if args.heldout else None, top, args.sequences, curves,
                            args.curve_every) for d in dirs.split(",") if d]
        judged_all[name] = judged
        rows += summary_rows(name, judged)
        for term in curves:
            panel = panels.setdefault(f"{name}: {term}", {})
            for seed, run in enumerate(judged, 1):
                panel[f"seed {seed}"] = [(s, v) for s, v, _ in run["curves"][term] if v is not None]
    hlines = {f"{name}: {term}": [(sum(r for _, _, r in run["curves"][term] if r is not None)
                                   / max(1, sum(1 for _, _, r in run["curves"][term] if r is not None)),
                                   REFERENCES[term])]
              for name, judged in judged_all.items() for term in curves if term in REFERENCES
              for run in judged[:1] if any(r is not None for _, _, r in run["curves"][term])}
    from pipeline.monitor.health import COLLAPSE_COSINE

    for name in judged_all:
        if "health/token_cosine" in curves:
            hlines[f"{name}: health/token_cosine"] = [(COLLAPSE_COSINE, "collapse threshold")]
    out = Path(args.out)
    write_report(args.name, rows, out, "Learning signals at the end of each run (last 20% of the logged steps)",
                 notes=["signals: pipeline.monitor.signals (a loss <= 0.85x its chance, an AUC / accuracy closing 15% "
                        "of the gap to 1 from its chance, a masked accuracy >= plateau + 0.01, an LM loss <= 0.98x "
                        "the unigram entropy, token cosine < 0.9); still improving: the last 20% against the 20% before",
                        *args.notes], extra={"runs": judged_all})
    panel_chart(panels, out / f"{args.name}.png", "Learning curves per seed (references: mean over the run)", "step",
                "value", hlines=hlines)
    print(f"wrote {out / (args.name + '.json')}, {out / (args.name + '.md')}, {out / (args.name + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
