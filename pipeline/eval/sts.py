"""`cpt-sts CONVERTED_DIR --data DIR`: zero-shot semantic textual similarity of a converted model.

The field's zero-shot measure of sentence representations (Reimers & Gurevych 2019, Sec. 4.1; Gao et
al. 2021, SimCSE, Sec. 5): embed both sentences of every STS Benchmark pair (Cer et al. 2017), score
each pair by the cosine of the two embeddings, and report Spearman's rank correlation between those
cosines and the human scores, x 100 (`scipy.stats.spearmanr`, through `pipeline.eval.metrics`). No
training: it moves with exactly what sequence-contrastive objectives train. Embeddings are those
`SentenceTransformer(dir).encode` gives (`pipeline.eval.embed`).

Reference points measured the same way on the same pairs (a result is only a result against them; at
small sizes lexical overlap beats a weak encoder):
  * `random_init`: the same architecture with fresh weights, same tokenizer and pooling, averaged over
    `--random-inits` init seeds (default 3: `--seed`, `--seed + 1`, ...; its Spearman moves ~0.7 points
    from one init seed to the next, which the bootstrap over pairs does not cover: `per_seed` and
    `seed_sd` give that spread);
  * `input_embeddings`: the mean of the model's own input embedding rows of each sentence's tokens;
  * `token_overlap`: Jaccard |A n B| / |A u B| of the two sentences' sets of content token ids.

Uncertainty: a percentile bootstrap over pairs (Efron & Tibshirani 1993, ch. 13): `--bootstrap B`
resamples of the pairs with replacement, drawn once from `--seed` and shared by every method (paired),
Spearman recomputed on each; the interval is the (1 - level)/2 and (1 + level)/2 quantiles. The same
draws give an interval for the model's difference to each reference (`minus_<reference>`), and the
verdict per split: the model is above a reference when that interval lies above 0, below it when
below 0, inside it otherwise.

Never a number where there is none: a Spearman undefined on a split (a split of one pair, every cosine
or every human score equal) is `null` with `undefined` saying why; an interval with any resample whose
Spearman is undefined is `null` with `interval_undefined` (a percentile over the other resamples would
claim a coverage it does not have).

Data: the SentEval copy of STS-B (`DIR/{dev,test}.tsv`, no header, tab-separated, 7 columns
`genre, file, year, id, score, sentence1, sentence2`). Every problem is one line before any compute
(exit 2): a missing file or directory, a line without its 7 columns, a score that is not a number in
0-5, an empty sentence, a split of one pair or of one score repeated (no Spearman exists); a converted directory without its tokenizer, with a swapped one, or one that
maps more than a quarter of the sentences' tokens to the unknown token.

Output: a table (the model and each reference, per split, with intervals) and a verdict line per split
(`pipeline.eval.sts_report`); `--json` prints the JSON record instead, `--out FILE` also writes it
(atomically). A progress bar on stderr while embedding, when stderr is a terminal (`--no-progress`: never).
`sts_spearman(dir, pairs)` and `measure(dir, splits)` are the same measurement as functions.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from pipeline.eval import metrics
from pipeline.eval.embed import Encoder, content_ids, open_encoder
from pipeline.eval.json_cli import run_json_command
from pipeline.export.sentence_embedding import POOLINGS

COLUMNS = ("genre", "file", "year", "id", "score", "sentence1", "sentence2")
SPLITS = ("dev", "test")
REFERENCES = ("random_init", "input_embeddings", "token_overlap")
SCORE_RANGE = (0.0, 5.0)
#: Init seeds the random-init reference averages over (its Spearman moves ~0.7 points from seed to seed on
#: STS-B, which the bootstrap over pairs does not cover).
RANDOM_INITS = 3


@dataclass(frozen=True)
class StsPairs:
    """One STS split: sentence pairs and their human scores (0-5)."""

    path: Path
    first: list[str]
    second: list[str]
    scores: np.ndarray

    def __len__(self) -> int:
        return len(self.scores)


def read_sts(path: str | Path) -> StsPairs:
    """A SentEval STS-B file, every line checked (module docstring); a ValueError names file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such STS file")
    first, second, scores = [], [], []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err})") from err
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        where = f"{path}:{number}"
        if len(fields) != len(COLUMNS):
            raise ValueError(f"{where}: {len(fields)} tab-separated columns, expected {len(COLUMNS)} "
                             f"({', '.join(COLUMNS)}; SentEval's STS-B, no header)")
        try:
            score = float(fields[4])
        except ValueError:
            raise ValueError(f"{where}: score {fields[4]!r} is not a number") from None
        if not SCORE_RANGE[0] <= score <= SCORE_RANGE[1]:
            raise ValueError(f"{where}: score {fields[4]} outside {SCORE_RANGE[0]:g}-{SCORE_RANGE[1]:g}")
        for name, sentence in (("sentence1", fields[5]), ("sentence2", fields[6])):
            if not sentence.strip():
                raise ValueError(f"{where}: {name} is empty")
        first.append(fields[5])
        second.append(fields[6])
        scores.append(score)
    if not scores:
        raise ValueError(f"{path}: no sentence pairs")
    if len(scores) < 2:  # a rank correlation needs two pairs, and a constant has no ranks to correlate
        raise ValueError(f"{path}: 1 sentence pair; a Spearman correlation needs at least 2")
    if len(set(scores)) == 1:
        raise ValueError(f"{path}: every score is {scores[0]:g}; a Spearman correlation with constant scores is "
                         "undefined (0/0)")
    return StsPairs(path, first, second, np.asarray(scores, dtype=np.float64))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of two [N, H] arrays in float64 (a zero row scores 0), rounded to 1e-12: pairs of
    equal embeddings (a sentence paired with itself) then tie at 1 exactly instead of being ordered by
    the last bits of the norms; float32 embeddings carry no information at that precision."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.round(np.divide((a * b).sum(1), norms, out=np.zeros(len(a)), where=norms > 0), 12)


def token_overlap(encoder: Encoder, pairs: StsPairs) -> np.ndarray:
    """Jaccard similarity of the two sentences' sets of content token ids."""
    out = np.zeros(len(pairs))
    for i, (s1, s2) in enumerate(zip(pairs.first, pairs.second)):
        a, b = set(content_ids(encoder.tokenizer, s1)), set(content_ids(encoder.tokenizer, s2))
        out[i] = len(a & b) / len(a | b) if a | b else 0.0
    return out


def bootstrap_draws(n: int, samples: int, seed: int) -> np.ndarray:
    """[samples, n] indices of pairs drawn with replacement (numpy's PCG64 from `seed`)."""
    return np.random.default_rng(seed).integers(0, n, size=(samples, n))


def init_seeds(seed: int, count: int) -> list[int]:
    """The random-init reference's initialisation seeds: `seed`, `seed + 1`, ... (`count` of them)."""
    return [seed + i for i in range(count)]


def spearman_x100(predictions: Sequence[np.ndarray], gold: np.ndarray, rows: Optional[np.ndarray] = None) -> float:
    """100 x Spearman of each prediction array against `gold` (on `rows`, a resample, when given), averaged over
    the arrays (the random-init reference's init seeds; one array otherwise). `metrics.Undefined` when any is."""
    gold = gold if rows is None else gold[rows]
    values = [metrics.spearman(p if rows is None else p[rows], gold, ("cosine", "human score")) for p in predictions]
    return 100 * float(np.mean(values))


def _resampled(predictions: Sequence[np.ndarray], gold: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """The statistic on every resample; nan where it is undefined on that resample."""
    out = np.full(len(draws), np.nan)
    for i, rows in enumerate(draws):
        try:
            out[i] = spearman_x100(predictions, gold, rows)
        except metrics.Undefined:
            pass
    return out


def interval(values: np.ndarray, level: float) -> tuple[Optional[list[float]], str]:
    """(the percentile interval of the resampled `values`, ""), or (None, why) when a resample has no value: a
    percentile over the defined resamples alone would condition on them and claim a coverage it does not have."""
    undefined = int(np.isnan(values).sum())
    if undefined:
        return None, (f"{undefined} of {len(values)} bootstrap resamples have no Spearman (a resample of a few pairs "
                      "repeats one pair or ties every score)")
    low, high = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return [round(float(low), 4), round(float(high), 4)], ""


def _statistic(predictions: Sequence[np.ndarray], gold: np.ndarray, boot: Optional[np.ndarray], level: float) -> dict:
    """{"spearman", "interval"} of one method, null with `undefined` / `interval_undefined` saying why."""
    try:
        out: dict = {"spearman": round(spearman_x100(predictions, gold), 4)}
    except metrics.Undefined as why:
        out = {"spearman": None, "undefined": str(why)}
    if boot is not None:
        out["interval"], why_not = interval(boot, level) if out["spearman"] is not None else (None, "")
        if why_not:
            out["interval_undefined"] = why_not
    return out


def summarise(predicted: dict[str, list[np.ndarray]], gold: np.ndarray, draws: np.ndarray, level: float) -> dict:
    """Per method: Spearman x 100 (averaged over its prediction arrays: `spearman_x100`) and its bootstrap
    interval; the model's difference to each reference with the paired interval. A statistic undefined on
    the split (one pair, every cosine equal) is null with `undefined` saying why, never a number."""
    boot = {name: _resampled(p, gold, draws) for name, p in predicted.items()} if len(draws) else {}
    out: dict[str, dict] = {name: _statistic(p, gold, boot.get(name), level) for name, p in predicted.items()}
    for name, p in predicted.items():
        if len(p) > 1:  # the random-init reference: one Spearman per init seed, and their spread
            per_seed = [_statistic([one], gold, None, level)["spearman"] for one in p]
            out[name]["per_seed"] = per_seed
            out[name]["seed_sd"] = (round(float(np.std(per_seed, ddof=1)), 4) if None not in per_seed else None)
    model = out.get("model")
    for name in predicted:
        if model is None or name == "model":
            continue
        other = out[name]
        both = model["spearman"] is not None and other["spearman"] is not None
        diff: dict = {"spearman": round(model["spearman"] - other["spearman"], 4) if both else None}
        if not both:
            diff["undefined"] = "the model's or the reference's Spearman is undefined"
        if len(draws):
            diff["interval"], why_not = interval(boot["model"] - boot[name], level) if both else (None, "")
            if why_not:
                diff["interval_undefined"] = why_not
        model[f"minus_{name}"] = diff
    return out


def sts_spearman(converted_dir: str | Path, pairs: StsPairs, *, references: Sequence[str] = REFERENCES,
                 bootstrap: int = 1000, seed: int = 0, level: float = 0.95, batch_size: int = 64,
                 encoder: Optional[Encoder] = None, random_inits: int = RANDOM_INITS,
                 progress: Optional[Callable[[int], None]] = None) -> dict:
    """Zero-shot STS of one split: {"n_pairs", "model": {"spearman", "interval", "minus_<ref>"},
    <reference>: {...}} (Spearman x 100). `encoder`: an already opened `converted_dir`; `random_inits`: how many
    init seeds the random-init reference averages; `progress(n)`: called with each batch of sentences embedded."""
    encoder = encoder or open_encoder(converted_dir, "CONVERTED_DIR")
    unknown = [name for name in references if name not in REFERENCES]
    if unknown:
        raise ValueError(f"references {unknown}: not among {', '.join(REFERENCES)}")

    def embedded(which: Encoder) -> np.ndarray:
        return cosines(which.embed(pairs.first, batch_size, progress), which.embed(pairs.second, batch_size, progress))

    predicted = {"model": [embedded(encoder)]}
    if "random_init" in references:
        predicted["random_init"] = [embedded(encoder.random_init(s)) for s in init_seeds(seed, random_inits)]
    if "input_embeddings" in references:
        predicted["input_embeddings"] = [cosines(encoder.mean_input_embeddings(pairs.first),
                                                 encoder.mean_input_embeddings(pairs.second))]
    if "token_overlap" in references:
        predicted["token_overlap"] = [token_overlap(encoder, pairs)]
    draws = bootstrap_draws(len(pairs), bootstrap, seed) if bootstrap else np.zeros((0, len(pairs)), dtype=np.int64)
    return {"n_pairs": len(pairs), **summarise(predicted, pairs.scores, draws, level)}


def check_coverage(encoder: Encoder, splits: dict[str, StsPairs]) -> None:
    """The tokenizer represents the sentences (`pipeline.tokenizer_checks.coverage_problem`)."""
    from pipeline.tokenizer_checks import SAMPLE_DOCUMENTS, coverage_problem, unknown_share

    texts = [s for pairs in splits.values() for s in pairs.first[:SAMPLE_DOCUMENTS]]
    share, tokens = unknown_share((content_ids(encoder.tokenizer, t) for t in texts), encoder.tokenizer.unk_token_id)
    problem = coverage_problem(encoder.directory, len(encoder.tokenizer), share, tokens,
                               f"the first {len(texts)} STS sentences")
    if problem:
        raise ValueError(f"CONVERTED_DIR {problem}")


def read_splits(data: str | Path, splits: Sequence[str] = SPLITS, flag: str = "--data") -> dict[str, StsPairs]:
    """`{split: StsPairs}` of a SentEval STS-B directory, every file checked (`read_sts`); `flag` names the
    setting in a missing directory's message."""
    data = Path(data)
    if not data.is_dir():
        raise ValueError(f"{flag} {data}: no such directory (the SentEval STS-B copy: dev.tsv, test.tsv)")
    return {name: read_sts(data / f"{name}.tsv") for name in splits}


def sentences_to_embed(splits: dict[str, StsPairs], references: Sequence[str], random_inits: int) -> int:
    """How many sentences `measure` passes through an encoder (the progress bar's total)."""
    encoders = 1 + (random_inits if "random_init" in references else 0)
    return sum(2 * len(pairs) for pairs in splits.values()) * encoders


def measure(converted_dir: str | Path, splits: dict[str, StsPairs], *, references: Sequence[str] = REFERENCES,
            bootstrap: int = 1000, seed: int = 0, level: float = 0.95, batch_size: int = 64,
            pooling: Optional[str] = None, random_inits: int = RANDOM_INITS, progress: bool = False) -> dict:
    """Every split of `read_splits` measured on one converted directory (`sts_spearman`), the tokenizer's
    coverage of the sentences checked first: {"pooling", "random_init_seeds", "splits": {split: ...}, "seconds"}.
    The one measurement of `cpt-sts` and of the time-to-quality study's evaluation points. `progress`: a bar on
    stderr over the sentences embedded."""
    from tqdm import tqdm

    encoder = open_encoder(converted_dir, "CONVERTED_DIR", pooling)
    check_coverage(encoder, splits)
    started = time.perf_counter()
    with tqdm(total=sentences_to_embed(splits, references, random_inits), desc="cpt-sts: embedding",
              unit=" sentences", disable=not progress, file=sys.stderr, leave=False) as bar:
        results = {name: sts_spearman(converted_dir, pairs, references=references, bootstrap=bootstrap, seed=seed,
                                      level=level, batch_size=batch_size, encoder=encoder, random_inits=random_inits,
                                      progress=bar.update)
                   for name, pairs in splits.items()}
    return {"pooling": encoder.pooling.record(),
            "random_init_seeds": init_seeds(seed, random_inits) if "random_init" in references else [],
            "splits": results, "seconds": round(time.perf_counter() - started, 2)}


def evaluate(args: argparse.Namespace) -> dict:
    """Every input checked (model, data, output), then each split measured."""
    data = Path(args.data)
    splits = read_splits(data, args.splits)
    if args.out and Path(args.out).is_dir():
        raise ValueError(f"--out {args.out}: is a directory; give a file name")
    measured = measure(args.converted_dir, splits, references=args.references, bootstrap=args.bootstrap,
                       seed=args.seed, level=args.level, batch_size=args.batch_size, pooling=args.pooling,
                       random_inits=args.random_inits, progress=args.progress)
    return {
        "model": str(args.converted_dir),
        "data": str(data),
        "metric": "spearman x 100 of cosine(embedding 1, embedding 2) against the human score",
        "pooling": measured["pooling"],
        "bootstrap": {"samples": args.bootstrap, "seed": args.seed, "level": args.level, "over": "pairs",
                      "paired": "the same draws for every method"},
        "random_init_seeds": measured["random_init_seeds"],
        "random_init": "the mean over the init seeds of each seed's Spearman (per_seed, seed_sd: their spread, "
                       "which the bootstrap over pairs does not cover)",
        "splits": measured["splits"],
        "seconds": measured["seconds"],
        "command": " ".join(["cpt-sts", *args.argv]),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpt-sts", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("converted_dir", help="a cpt-convert output directory")
    p.add_argument("--data", required=True, help="the SentEval STS-B directory (dev.tsv, test.tsv; no header)")
    p.add_argument("--splits", nargs="+", default=list(SPLITS), choices=SPLITS, help="the splits measured")
    p.add_argument("--references", nargs="*", default=list(REFERENCES), choices=REFERENCES,
                   help="reference points measured the same way (none with an empty list)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the pairs (0: no interval)")
    p.add_argument("--level", type=float, default=0.95, help="the intervals' coverage")
    p.add_argument("--seed", type=int, default=0, help="seeds the bootstrap draws and the first random init")
    p.add_argument("--random-inits", type=int, default=RANDOM_INITS, metavar="K",
                   help="the random-init reference is the mean over K init seeds (--seed, --seed + 1, ...)")
    p.add_argument("--pooling", default=None, choices=POOLINGS,
                   help="instead of the directory's declared pooling (modules.json)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per forward pass")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    p.add_argument("--out", default=None, help="also write the JSON result to this file (atomically)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (it is drawn on stderr only when stderr is a terminal)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.progress = args.progress and sys.stderr.isatty()
    for flag, bad in (("--bootstrap", args.bootstrap < 0), ("--batch-size", args.batch_size <= 0),
                      ("--level", not 0 < args.level < 1), ("--random-inits", args.random_inits < 1)):
        if bad:
            print(f"error: {flag} {getattr(args, flag[2:].replace('-', '_'))}: out of range", file=sys.stderr)
            return 2
    from pipeline.eval.sts_report import render

    return run_json_command(lambda: evaluate(args), args.threads, args.out, render=None if args.json else render)


if __name__ == "__main__":
    sys.exit(main())
