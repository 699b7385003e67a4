"""COCO-LM's Figure 1, measured: how squeezed is each model's sentence-representation space?

Meng et al. 2021 (COCO-LM, Sec. 2 / Figure 1) plot the cosine similarity of random sentence pairs (from the
pretraining corpus) and of STS-B's most similar pairs: RoBERTa's random pairs sit near 0.8, above many
similar pairs, and "the representation space from ELECTRA is even more squeezed. Nearly all sentence
pairs, both random and similar ones, have around 0.9 cosine similarity"; COCO-LM's sequence contrast is
meant to spread random pairs (uniformity) and pull similar ones together (alignment).

What this measures, per converted model directory (`cpt-convert` output; several seeds per model) and for
randomly initialised models of the same shape (`pipeline.eval.embed.Encoder.random_init`, Hugging Face's
initialisation, one per seed):

* sentence representation: the last layer's [CLS] state, and the mean over the attended tokens ([CLS] and
  [SEP] included: the sentence-transformers export's `mean`), both through `pipeline.eval.embed` (the
  directory's `AutoModel` and tokenizer, truncated at its positions);
* random pairs: `--pairs` pairs of two different sentences drawn uniformly (seeded) from held-out text
  (`--heldout-text`: sentences of 8-60 words, split at " . " in WikiText's tokenised text, headings dropped);
* similar pairs: every STS-B pair of `--sts` with a gold score >= `--min-score` (4: "semantically
  similar"; the paper's "maximum similarity");
* per model and seed: the mean cosine of each set, its 5 / 50 / 95% quantiles, the gap (similar - random)
  and the share of random pairs whose cosine exceeds the median similar pair's (COCO-LM: "bigger than many
  semantically similar pairs"); over seeds: mean [95% t-interval] (`pipeline.stats`).

"More squeezed than" is read as: a higher mean random-pair cosine (less uniform) with a gap no larger
(no better aligned); the verdict lines state both comparisons and whether the seed intervals separate.

    python -m benchmarks.quality.representation_cosines --model mlm=DIR1,DIR2,DIR3 --model electra=... \\
        --model cocolm=... --heldout-text TEXT --sts STS-B/test.tsv --out benchmarks/results/representation_cosines
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from pipeline.report_files import save_figure, write_report
from pipeline.stats import format_ci, mean_ci

POOLINGS = ("cls", "mean")
RANDOM_INIT = "random init"
#: The cosine histograms' bin edges (the plot's and the JSON's): 48 bins over [-0.2, 1].
BINS = np.linspace(-0.2, 1.0, 49)
#: Default verdicts: (a, b) = "is a more squeezed than b".
COMPARISONS = ("electra:mlm", "cocolm:mlm", "cocolm:electra")
MIN_WORDS, MAX_WORDS = 8, 60


def heldout_sentences(path: Path) -> list[str]:
    """WikiText-style text split into sentences at " . " (its tokenised full stops), headings (` = T = `) and
    sentences outside `MIN_WORDS`..`MAX_WORDS` words dropped, duplicates once, in text order."""
    seen, out = set(), []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            continue
        for piece in line.split(" . "):
            sentence = piece.strip().rstrip(" .") + " ."
            words = len(sentence.split())
            if MIN_WORDS <= words <= MAX_WORDS and sentence not in seen:
                seen.add(sentence)
                out.append(sentence)
    if len(out) < 2:
        raise ValueError(f"--heldout-text {path}: fewer than 2 sentences of {MIN_WORDS}-{MAX_WORDS} words")
    return out


def random_pairs(sentences: Sequence[str], count: int, seed: int) -> tuple[list[str], list[str]]:
    """`count` pairs of two different sentences, uniform over ordered pairs (seeded)."""
    rng = np.random.default_rng(seed)
    first = rng.integers(0, len(sentences), count)
    offset = rng.integers(1, len(sentences), count)  # never the same sentence
    second = (first + offset) % len(sentences)
    return [sentences[i] for i in first], [sentences[j] for j in second]


def similar_pairs(path: Path, min_score: float) -> tuple[list[str], list[str]]:
    """STS-B pairs with gold score >= `min_score` (`pipeline.eval.sts.read_sts` checks the file)."""
    from pipeline.eval.sts import read_sts

    pairs = read_sts(path)
    keep = [i for i, s in enumerate(pairs.scores) if s >= min_score]
    if not keep:
        raise ValueError(f"--sts {path}: no pair scores >= {min_score}")
    return [pairs.first[i] for i in keep], [pairs.second[i] for i in keep]


def pair_cosines(encoder, first: Sequence[str], second: Sequence[str]) -> np.ndarray:
    from pipeline.eval.sts import cosines

    return cosines(encoder.embed(list(first)), encoder.embed(list(second)))


def summary(random: np.ndarray, similar: np.ndarray) -> dict:
    """One model and seed: the statistics of the module docstring."""
    q = lambda x, p: float(np.quantile(x, p))  # noqa: E731
    return {"random_mean": float(random.mean()), "similar_mean": float(similar.mean()),
            "gap": float(similar.mean() - random.mean()),
            "random_q05": q(random, 0.05), "random_q50": q(random, 0.5), "random_q95": q(random, 0.95),
            "similar_q05": q(similar, 0.05), "similar_q50": q(similar, 0.5), "similar_q95": q(similar, 0.95),
            "random_above_similar_median": float((random > np.median(similar)).mean())}


def measure(models: dict[str, list[Path]], pairs: dict[str, tuple[list[str], list[str]]], init_seeds: Sequence[int]
            ) -> dict:
    """{pooling: {model: [per-seed record with its cosines]}}, random init from the first model's first directory."""
    from pipeline.eval.embed import open_encoder

    out: dict = {p: {} for p in POOLINGS}
    for pooling in POOLINGS:
        reference = open_encoder(next(iter(models.values()))[0], pooling=pooling)
        encoders = {RANDOM_INIT: [(f"seed {s}", reference.random_init(s)) for s in init_seeds]}
        for name, dirs in models.items():
            encoders[name] = [(str(d), open_encoder(d, pooling=pooling)) for d in dirs]
        for name, listed in encoders.items():
            records = []
            for source, encoder in listed:
                cos = {kind: pair_cosines(encoder, *pairs[kind]) for kind in ("random", "similar")}
                records.append({"source": source, **summary(cos["random"], cos["similar"]), "cosines": cos})
                print(f"{pooling:>4} {name:<12} {source}: random {records[-1]['random_mean']:.3f}, "
                      f"similar {records[-1]['similar_mean']:.3f}", file=sys.stderr, flush=True)
            out[pooling][name] = records
    return out


STATS = ("random_mean", "similar_mean", "gap", "random_above_similar_median", "random_q05", "random_q50",
         "random_q95", "similar_q50")


def table_rows(measured: dict) -> list[dict]:
    rows = []
    for pooling, by_model in measured.items():
        for name, records in by_model.items():
            row = {"representation": pooling, "model": name, "seeds": len(records)}
            for stat in STATS:
                row[stat] = format_ci(mean_ci([r[stat] for r in records]), 4)
            rows.append(row)
    return rows


def compare(measured: dict, pooling: str, a: str, b: str) -> str:
    """One verdict line: is `a` more squeezed than `b` (higher random-pair cosine, gap no larger)?"""
    by = measured[pooling]
    if a not in by or b not in by:
        return ""
    parts = []
    for stat, word in (("random_mean", "random-pair cosine"), ("gap", "similar - random gap")):
        ca, cb = mean_ci([r[stat] for r in by[a]]), mean_ci([r[stat] for r in by[b]])
        separated = ca["lo"] is not None and cb["lo"] is not None and (ca["lo"] > cb["hi"] or ca["hi"] < cb["lo"])
        relation = "higher" if ca["mean"] > cb["mean"] else "lower"
        parts.append(f"{word} {format_ci(ca)} vs {format_ci(cb)}: {relation}"
                     f"{' (intervals separate)' if separated else ' (intervals overlap)'}")
    ra, rb = (mean_ci([r["random_mean"] for r in by[m]])["mean"] for m in (a, b))
    ga, gb = (mean_ci([r["gap"] for r in by[m]])["mean"] for m in (a, b))
    squeezed = ra > rb and ga <= gb
    return f"[{pooling}] {a} {'IS' if squeezed else 'is NOT'} more squeezed than {b}: " + "; ".join(parts)


def plot(measured: dict, path: Path, title: str) -> None:
    """Histograms of random vs similar pair cosines, every seed pooled: one row per representation, one
    column per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(measured[POOLINGS[0]])
    fig, axes = plt.subplots(len(POOLINGS), len(names), figsize=(3.2 * len(names), 2.8 * len(POOLINGS)),
                             squeeze=False)
    bins = BINS
    for row, pooling in enumerate(POOLINGS):
        for col, name in enumerate(names):
            ax = axes[row][col]
            records = measured[pooling][name]
            for kind, color in (("random", "tab:blue"), ("similar", "tab:red")):
                values = np.concatenate([np.asarray(r["cosines"][kind]) for r in records])
                ax.hist(values, bins=bins, density=True, alpha=0.55, color=color,
                        label=f"{kind} (mean {values.mean():.2f})")
            ax.set_title(f"{name} [{pooling}]", fontsize=9)
            ax.set_xlabel("cosine")
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def with_histograms(measured: dict) -> dict:
    """`measured` for the JSON: each record's cosines as counts over `BINS` (the plot's histogram; values
    outside the edges fall in the end bins), not the pairs one by one."""
    out: dict = {}
    for pooling, by_model in measured.items():
        out[pooling] = {}
        for name, records in by_model.items():
            out[pooling][name] = [{**{k: v for k, v in r.items() if k != "cosines"},
                                   "histogram": {kind: np.histogram(np.clip(c, BINS[0], BINS[-1]), BINS)[0].tolist()
                                                 for kind, c in r["cosines"].items()}}
                                  for r in records]
    return out


def parse_models(values: Sequence[str]) -> dict[str, list[Path]]:
    models: dict[str, list[Path]] = {}
    for value in values:
        name, sep, dirs = value.partition("=")
        if not sep or not dirs:
            raise ValueError(f"--model {value!r}: expected NAME=DIR[,DIR...]")
        paths = [Path(d) for d in dirs.split(",") if d]
        missing = [str(p) for p in paths if not (p / "config.json").is_file()]
        if missing:
            raise ValueError(f"--model {name}: no converted model (config.json) in {missing}")
        models[name] = paths
    if not models:
        raise ValueError("--model: at least one NAME=DIR[,DIR...]")
    return models


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality.representation_cosines", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=[], help="NAME=DIR[,DIR...]: converted directories, one per seed")
    p.add_argument("--heldout-text", required=True, help="held-out text the random pairs are drawn from")
    p.add_argument("--sts", required=True, help="an STS-B file (SentEval layout) for the similar pairs")
    p.add_argument("--min-score", type=float, default=4.0, help="similar pairs: gold score >= this (default 4)")
    p.add_argument("--pairs", type=int, default=2000, help="random pairs (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random pairs")
    p.add_argument("--init-seeds", default="1,2,3", help="seeds of the randomly initialised models")
    p.add_argument("--out", required=True, help="output directory (JSON, Markdown, PNG)")
    p.add_argument("--name", default="representation_cosines")
    p.add_argument("--notes", action="append", default=[], help="a line added to the report's notes (e.g. the runs)")
    p.add_argument("--compare", action="append", default=None,
                   help=f"A:B, a verdict on whether model A is more squeezed than B (default {', '.join(COMPARISONS)})")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        models = parse_models(args.model)
        pairs = {"random": random_pairs(heldout_sentences(Path(args.heldout_text)), args.pairs, args.seed),
                 "similar": similar_pairs(Path(args.sts), args.min_score)}
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    measured = measure(models, pairs, [int(s) for s in args.init_seeds.split(",")])
    out = Path(args.out)
    pairs_to_compare = [tuple(c.split(":", 1)) for c in (args.compare or COMPARISONS)]
    verdicts = [line for pooling in POOLINGS for a, b in pairs_to_compare if (line := compare(measured, pooling, a, b))]
    notes = [f"random pairs: {args.pairs} pairs of different sentences ({MIN_WORDS}-{MAX_WORDS} words) from "
             f"{Path(args.heldout_text).name}, seed {args.seed}; similar pairs: the {len(pairs['similar'][0])} pairs of "
             f"{Path(args.sts).name} with gold score >= {args.min_score:g}",
             "cls: the last layer's [CLS] state; mean: the mean over attended tokens ([CLS], [SEP] included); cosine of "
             "the two sentences' vectors",
             "each figure: mean [95% t-interval] over seeds of the per-seed statistic; random init: Hugging Face's "
             f"initialisation of the same configuration, seeds {args.init_seeds}",
             "random_above_similar_median: share of random pairs whose cosine exceeds the median similar pair's",
             *verdicts, *args.notes]
    rows = table_rows(measured)
    paths = write_report(args.name, rows, out, "Sentence-pair cosines: random held-out pairs vs STS-B's similar pairs "
                         "(COCO-LM Figure 1)", notes=notes,
                         extra={"measured": with_histograms(measured), "histogram_bins": BINS.round(4).tolist(),
                                "models": {k: [str(p) for p in v] for k, v in models.items()}})
    plot(measured, out / f"{args.name}.png", "Cosine of random (blue) vs STS-B score >= 4 (red) sentence pairs")
    print("\n".join(verdicts))
    print(f"wrote {paths['json']}, {paths['md']}, {out / (args.name + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
