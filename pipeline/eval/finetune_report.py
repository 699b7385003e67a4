"""`cpt-finetune`'s result for a person: one table of every dev metric (the mean over fine-tuning seeds with
its 95% Student-t interval, the random-init baseline and the pretraining gain with Welch's interval when
`--random-init` ran), the seeds' own values of the task's main metric, and one verdict line, from the JSON
record `pipeline.eval.finetune` builds (`--json` prints that record instead).

The verdict reads the gain's interval for the task's main metric: pretraining **helps** when the interval
lies above 0, **hurts** when below, and is **not told apart** from random init when it holds 0. With one
seed on either side there is no interval and no side is claimed, nor when every seed of both models gave the
same value (a zero-width interval: the seeds measured no spread); an undefined value shows as `undefined`
with its reason (the pretrained side's, else random init's), never as a number.
"""
from __future__ import annotations

from typing import Optional


def cell(mean: Optional[float], interval: Optional[list], signed: bool = False) -> str:
    """`0.912 [0.880, 0.944]`, `0.912` (no interval), or `undefined`."""
    if mean is None:
        return "undefined"
    text = f"{mean:+.3f}" if signed else f"{mean:.3f}"
    return f"{text} [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else text


def verdict(result: dict) -> str:
    """One line: whether pretraining bought anything on the task's main metric, read from the gain's interval."""
    metric = result["metric"]
    if "pretraining_gain" not in result:
        return f"verdict: none claimed: --random-init was not run, so there is no baseline for {metric}"
    gain = result["pretraining_gain"].get(metric)
    if gain is None:
        return f"verdict: none: the {metric} gain is undefined ({_why_undefined(result, metric)})"
    interval = result.get("pretraining_gain_interval", {}).get(metric)
    if not interval:
        return (f"verdict: {metric} gain {gain:+.3f}, no side claimed: an interval needs at least two seeds "
                "for each model")
    if interval[0] == interval[1]:  # Welch's se is 0: every seed of both models gave one value
        return (f"verdict: {metric} gain {gain:+.3f}, no side claimed: every seed gave the same {metric} on both "
                "sides, so the seeds measured no spread to judge the gain by (a zero-width interval; e.g. each "
                "model predicts one class whatever the seed)")
    where = ("pretraining helps" if interval[0] > 0 else "pretraining hurts" if interval[1] < 0
             else "pretrained and random init are not told apart")
    return f"verdict: {where} on {metric} (gain {cell(gain, interval, signed=True)}, 95% Welch interval over seeds)"


def _why_undefined(result: dict, metric: str) -> str:
    """Why the gain of `metric` is undefined: the pretrained side's reason, else the random-init side's."""
    for where, record in (("", result), ("random init: ", result.get("random_init") or {})):
        why = (record.get("undefined") or {}).get(metric)
        if why:
            return f"{where}{why}"
    return "see the JSON"


def _seed_reasons(runs: list[dict], where: str) -> list[str]:
    """The seeds' own reasons for an undefined metric (the summary lines say 'their `undefined` says why':
    here is what it says), one line per metric and reason with the seeds that gave it."""
    seeds_of: dict[tuple[str, str], list[str]] = {}
    for run in runs:
        for name, why in (run.get("undefined") or {}).items():
            seeds_of.setdefault((name, why), []).append(str(run["seed"]))
    return [f"  {where}{name} on seed(s) {', '.join(seeds)}: {why}" for (name, why), seeds in seeds_of.items()]


def _eval_file_lines(runs: list[dict], metric: str) -> list[str]:
    """The main metric per seed on each labelled `--eval-file` (its full metrics are in the JSON record)."""
    names = list(dict.fromkeys(name for run in runs for name in run.get("eval_file_metrics") or {}))
    return [f"{metric} per seed on eval file {name}: " + ", ".join(
        f"{run['seed']}: {cell((run.get('eval_file_metrics') or {}).get(name, {}).get(metric), None)}" for run in runs)
        for name in names]


def render(result: dict) -> str:
    """The table, the seeds' main metric (dev, then each labelled eval file), the undefined values' reasons
    (the seeds' own too) and the verdict."""
    seeds = result["seeds"]
    baseline = result.get("random_init")
    header = ["metric", "pretrained"] + (["random init", "gain"] if baseline else [])
    rows = [header]
    for name, mean in result["mean"].items():
        row = [name, cell(mean, result.get("interval", {}).get(name))]
        if baseline:
            row += [cell(baseline["mean"][name], baseline.get("interval", {}).get(name)),
                    cell(result["pretraining_gain"][name], result.get("pretraining_gain_interval", {}).get(name),
                         signed=True)]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"cpt-finetune: {result['model']} on {result['task']} ({result['task_dir']}): dev, {result['n_train']} "
             f"training examples, {len(seeds)} seed(s) {', '.join(map(str, seeds))}; mean [95% t-interval over seeds]"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    metric = result["metric"]
    per_seed = ", ".join(f"{r['seed']}: {cell(r['metrics'][metric], None)}" for r in result["runs"])
    lines.append(f"{metric} per seed: {per_seed}")
    lines += _eval_file_lines(result["runs"], metric)
    for where, record in (("", result), ("random init ", baseline or {})):
        lines += [f"undefined: {where}{name}: {why}" for name, why in record.get("undefined", {}).items()]
        lines += _seed_reasons(record.get("runs", []), where)
    lines.append(verdict(result))
    if result.get("prediction_files"):
        lines.append(f"predictions: {len(result['prediction_files'])} file(s), e.g. {result['prediction_files'][0]}")
    if result.get("saved_model"):
        lines.append(f"fine-tuned model: {result['saved_model']}")
    return "\n".join(lines)
