"""Zero-shot STS in the time-to-quality report: does any objective separate from MLM?

Each evaluation point of a study with `sts:` carries STS-B dev and test Spearman x 100
(`pipeline.study.units.sts_at`, `pipeline.eval.sts.measure`). Per objective and split, the comparison
with MLM is made twice, per pretraining seed (paired: the same seed's MLM run):

  * **equal budget**: both runs' final points (the study's step or token budget);
  * **matched compute**: h* = min(run's final device-hours, MLM's final device-hours); each run's last
    evaluation point whose device-hours <= h*. The more expensive run is thus read earlier on its own
    curve, never extrapolated; with no such point (its first evaluation already costs more than h*) the
    row says so and has no value;
  * **selected on dev** (test split only): each run's checkpoint with the highest STS-B dev Spearman over its
    whole curve (ties: the earlier step), read on test. Model selection on dev, as a user would pick the
    checkpoint to ship: a curve that peaks early is read at its peak for MLM and the objective alike, so an
    early point of one run is not compared with the late point of the other (the artefact matched compute
    can show when the curves fall with training).

Over the seeds: each side's mean and 95% t-interval (`pipeline.stats.mean_ci`), and the paired
difference's. The issue's criterion for a claim is strict: the two intervals do not overlap
(`separates`); the paired difference is given beside it.

The reference points (`floor_rows`) are read from the report's STS records: token overlap (Jaccard of
token sets) and the randomly initialised encoder do not depend on the checkpoint, so one record gives
them (with their bootstrap interval over pairs); the averaged input embeddings do and are a column of
the summary (`sts_test_input_embeddings`).
"""
from __future__ import annotations

from typing import Optional, Sequence

from pipeline.stats import format_ci, mean_ci
from pipeline.study.targets import EvalPoint

SPLITS = ("test", "dev")
#: references measured once per study (independent of the checkpoint) -> row label
FLOORS = {"token_overlap": "token overlap (STS floor)", "random_init": "random init (STS floor)"}


def sts_values(sts: Optional[dict]) -> dict[str, float]:
    """Curve values of one point's STS record: `sts_<split>` and `sts_<split>_input_embeddings`."""
    out: dict[str, float] = {}
    for split, result in ((sts or {}).get("splits") or {}).items():
        out[f"sts_{split}"] = result["model"]["spearman"]
        if "input_embeddings" in result:
            out[f"sts_{split}_input_embeddings"] = result["input_embeddings"]["spearman"]
    return out


def _at_or_before(curve: Sequence[EvalPoint], hours: float, metric: str) -> Optional[EvalPoint]:
    inside = [p for p in curve if p.device_hours <= hours * (1 + 1e-9) and p.values.get(metric) is not None]
    return max(inside, key=lambda p: p.step) if inside else None


def _best_on(curve: Sequence[EvalPoint], selector: str) -> Optional[EvalPoint]:
    scored = [p for p in curve if p.values.get(selector) is not None]
    return max(scored, key=lambda p: (p.values[selector], -p.step)) if scored else None


#: the comparison bases, in the report's order; "selected on dev" is read on the test split only
BASES = ("equal budget", "matched compute", "selected on dev")


def paired_points(baseline: Sequence[EvalPoint], run: Sequence[EvalPoint], metric: str,
                  basis: str) -> tuple[Optional[EvalPoint], Optional[EvalPoint]]:
    """The (run, baseline) points compared for one seed on `basis` (one of `BASES`; module docstring)."""
    if not baseline or not run:
        return None, None
    if basis == "equal budget":
        return run[-1], baseline[-1]
    if basis == "selected on dev":
        return _best_on(run, "sts_dev"), _best_on(baseline, "sts_dev")
    budget = min(run[-1].device_hours, baseline[-1].device_hours)
    return _at_or_before(run, budget, metric), _at_or_before(baseline, budget, metric)


def comparison_rows(curves: dict[str, dict[int, list[EvalPoint]]]) -> list[dict]:
    """Per objective (MLM excluded), split and basis: both sides over the paired seeds, the paired difference,
    and whether the intervals separate (module docstring)."""
    baseline = curves.get("mlm", {})
    rows = []
    for objective, by_seed in curves.items():
        if objective == "mlm":
            continue
        seeds = sorted(set(by_seed) & set(baseline))
        for split in SPLITS:
            metric = f"sts_{split}"
            if not any(p.values.get(metric) is not None for c in by_seed.values() for p in c):
                continue
            for basis in BASES:
                if basis == "selected on dev" and split != "test":
                    continue  # selecting on dev and reading dev would report the selection's own maximum
                pairs = {seed: paired_points(baseline[seed], by_seed[seed], metric, basis) for seed in seeds}
                row = {"objective": objective, "split": split, "basis": basis, "seeds": len(seeds)}
                if not seeds or any(r is None or b is None for r, b in pairs.values()):
                    row["note"] = ("no seed shared with MLM" if not seeds else
                                   "no STS-B dev record to select on" if basis == "selected on dev" else
                                   "no evaluation point of the objective within MLM's device-hours")
                    rows.append(row)
                    continue
                if any(r.values.get(metric) is None or b.values.get(metric) is None for r, b in pairs.values()):
                    row["note"] = "a compared point's Spearman is undefined (cpt-sts: every cosine equal)"
                    rows.append(row)
                    continue
                ours = mean_ci([r.values[metric] for r, _ in pairs.values()])
                theirs = mean_ci([b.values[metric] for _, b in pairs.values()])
                gap = mean_ci([r.values[metric] - b.values[metric] for r, b in pairs.values()])
                row.update({
                    "objective_sts": format_ci(ours, 1), "mlm_sts": format_ci(theirs, 1),
                    "steps": f"{_mean([r.step for r, _ in pairs.values()]):.0f} / "
                             f"{_mean([b.step for _, b in pairs.values()]):.0f}",
                    "device_hours": f"{_mean([r.device_hours for r, _ in pairs.values()]):.4f} / "
                                    f"{_mean([b.device_hours for _, b in pairs.values()]):.4f}",
                    "difference_paired": format_ci(gap, 1),
                    "separates": separation(ours, theirs),
                })
                rows.append(row)
    return rows


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def separation(ours: dict, theirs: dict) -> str:
    """"higher" / "lower" when the two 95% intervals do not overlap, "no" when they do, "n/a" without intervals
    (a single seed)."""
    if ours.get("lo") is None or theirs.get("lo") is None:
        return "n/a (one seed: no interval)"
    if ours["lo"] > theirs["hi"]:
        return "higher"
    if ours["hi"] < theirs["lo"]:
        return "lower"
    return "no"


def verdict(rows: list[dict], baseline_healthy: bool = True) -> str:
    """One line for the report's notes (and the README): which objectives separate from MLM on STS-B test. With
    an MLM baseline that failed the report's health check (it has not learned), the line says the separations
    are comparisons with an untrained-looking baseline, not claims."""
    split_rows = [r for r in rows if r["split"] == "test" and "separates" in r]
    if not split_rows:
        return "STS-B: no comparison with MLM (no STS records, or no seed shared with MLM)"
    found = [f"{r['objective']} {r['separates']} at {r['basis']} ({r['objective_sts']} vs MLM {r['mlm_sts']})"
             for r in split_rows if r["separates"] in ("higher", "lower")]
    caveat = "" if baseline_healthy else ("NOT A CLAIM, the MLM baseline failed its health check (it has not learned "
                                          "yet): ")
    if found:
        return caveat + "STS-B test, intervals not overlapping: " + "; ".join(found)
    return caveat + ("STS-B test: no objective separates from MLM (every objective's 95% interval over seeds overlaps "
                     "MLM's, on every basis: " + ", ".join(BASES) + ")")


def floor_record(selected: dict[str, list[dict]]) -> Optional[dict]:
    """The STS record the checkpoint-independent floors are read from: the first one found, MLM's runs first."""
    runs = sorted((run for runs in selected.values() for run in runs if run["status"] == "ok"),
                  key=lambda run: run["key"].objective != "mlm")
    return next((p["sts"] for run in runs for p in run["points"] if p.get("sts")), None)


def floor_rows(selected: dict[str, list[dict]]) -> list[dict]:
    """Summary rows of the checkpoint-independent references (`floor_record`), each with its pair interval."""
    record = floor_record(selected)
    if record is None:
        return []
    rows = []
    for reference, label in FLOORS.items():
        row = {"objective": label, "seeds": "bootstrap over pairs"}
        for split, result in record["splits"].items():
            if reference in result:
                value = result[reference]
                row[f"sts_{split}"] = ("undefined" if value.get("spearman") is None else f"{value['spearman']:.1f}"
                                       + (" [{:.1f}, {:.1f}]".format(*value["interval"]) if value.get("interval")
                                          else ""))
        if len(row) > 2:
            rows.append(row)
    return rows


def floor_lines(selected: dict[str, list[dict]], split: str = "test") -> list[tuple[float, str]]:
    """(Spearman, label) of each STS floor on `split`, for the plots."""
    result = ((floor_record(selected) or {}).get("splits") or {}).get(split) or {}
    return [(float(result[reference]["spearman"]), label.replace(" (STS floor)", ""))
            for reference, label in FLOORS.items() if reference in result and result[reference].get("spearman")
            is not None]
