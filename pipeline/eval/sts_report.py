"""`cpt-sts`'s result for a person: a table of the model and each reference per split (Spearman x 100 with
its bootstrap interval) and one verdict line per split, from the JSON record `pipeline.eval.sts` builds.

The verdict against each reference reads the paired bootstrap interval of the model's difference to it
(`minus_<reference>`): **above** when the interval lies above 0, **below** when it lies below 0, **inside**
when it holds 0 (the model cannot be told apart from that reference on these pairs). Without an interval
(`--bootstrap 0`, or one undefined) the difference is shown and no side is claimed; an undefined Spearman
shows as `undefined` with its reason, never as a number.
"""
from __future__ import annotations

from typing import Optional

#: row labels, in the table's order
LABELS = {"model": "model", "random_init": "random init", "input_embeddings": "input embeddings",
          "token_overlap": "token overlap"}


def _interval(values: Optional[list]) -> str:
    return f"[{values[0]:.2f}, {values[1]:.2f}]" if values else ""


def cell(stat: dict) -> str:
    """`62.31 [59.80, 64.70]`, `62.31` (no interval), or `undefined`."""
    if stat.get("spearman") is None:
        return "undefined"
    return f"{stat['spearman']:.2f} {_interval(stat.get('interval'))}".rstrip()


def side(diff: dict) -> str:
    """above / below / inside from the difference's interval; '' without one."""
    interval = diff.get("interval")
    if not interval:
        return ""
    return "above" if interval[0] > 0 else "below" if interval[1] < 0 else "inside"


def verdict(split: str, result: dict) -> str:
    """One line: where the model stands against each reference on this split."""
    model = result.get("model", {})
    if model.get("spearman") is None:
        return f"{split}: no verdict: the model's Spearman is undefined ({model.get('undefined', '?')})"
    parts = []
    for name in LABELS:
        diff = model.get(f"minus_{name}")
        if name == "model" or diff is None:
            continue
        label = LABELS[name]
        if diff.get("spearman") is None:
            parts.append(f"no verdict against {label} (its Spearman is undefined)")
            continue
        where = side(diff)
        gap = f"{diff['spearman']:+.2f}"
        if where:
            parts.append(f"{where} {label} ({gap} {_interval(diff['interval'])})")
        else:
            why = diff.get("interval_undefined") or "no bootstrap interval"
            parts.append(f"{gap} against {label} (no side claimed: {why})")
    return f"{split}: model {model['spearman']:.2f}: " + ("; ".join(parts) if parts else "no references measured")


def render(record: dict) -> str:
    """The table and the verdict lines of one `cpt-sts` record."""
    splits = record["splits"]
    boot = record.get("bootstrap", {})
    seeds = record.get("random_init_seeds") or []
    head = [f"cpt-sts {record['model']} ({record['pooling']['mode']} pooling): zero-shot STS-B, "
            "Spearman x 100 of the cosine against the human score"]
    if boot.get("samples"):
        head.append(f"intervals: {100 * boot['level']:g}% percentile bootstrap over pairs ({boot['samples']} "
                    f"resamples, seed {boot['seed']}, the same draws for every row)")
    rows = [["", *[f"{name} ({result['n_pairs']} pairs)" for name, result in splits.items()]]]
    methods = [m for m in LABELS if any(m in result for result in splits.values())]
    for method in methods:
        label = LABELS[method] + (f" (mean of {len(seeds)} init seeds)" if method == "random_init" and len(seeds) > 1
                                  else "")
        rows.append([label, *[cell(result[method]) if method in result else "-" for result in splits.values()]])
        if method == "random_init" and len(seeds) > 1:
            rows.append(["  spread over init seeds (sd)",
                         *[_sd(result.get(method, {})) for result in splits.values()]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  ".join(value.ljust(width) for value, width in zip(row, widths)).rstrip() for row in rows]
    notes = [f"  {LABELS[m]}, {name}: {result[m]['undefined']}" for name, result in splits.items()
             for m in methods if m in result and result[m].get("undefined")]
    notes += [f"  {LABELS[m]}, {name}: interval undefined: {result[m]['interval_undefined']}"
              for name, result in splits.items() for m in methods if m in result and result[m].get("interval_undefined")]
    verdicts = ["verdict (paired bootstrap interval of the difference: above / below / inside)"] if boot.get(
        "samples") else ["verdict (no bootstrap: differences only)"]
    verdicts += [verdict(name, result) for name, result in splits.items()]
    return "\n".join(head + [""] + table + (["undefined:"] + notes if notes else []) + [""] + verdicts)


def _sd(stat: dict) -> str:
    sd = stat.get("seed_sd")
    per_seed = stat.get("per_seed") or []
    if sd is None:
        return "undefined"
    return f"{sd:.2f} (" + ", ".join("-" if v is None else f"{v:.2f}" for v in per_seed) + ")"
