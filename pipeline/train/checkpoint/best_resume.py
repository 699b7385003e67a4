"""The best checkpoint on resume: `best.json` reconciled with what the run itself recorded, so the best
tag is never forgotten, never confused with a worse one, and never pruned (`train.keep_best`).

`best.json` is a pointer beside the tags; a user, a full disk or a crash can truncate, delete or edit
it. Three sources say which tag is the best as of the resumed step S, trusted in this order:

1. the resumed checkpoint's own record, `RunMeta.best` (`{"record": BestRecord | None, "keep": [tags]}`),
   written with the tag and covered by its `COMPLETE.json` sha256;
2. `metrics.jsonl`: over the records at steps <= S that hold the metric (for a `val/` metric: measured
   on this run's validation set, `eval_set`) and whose step has a complete, healthy tag, the best
   value (strictly better wins; the earliest of equals), exactly the rule `Checkpointer.observe_metric`
   applies while the run goes (a best is saved at its own step);
3. `best.json` itself, when it names a complete tag at or before S.

The first one that is this run's (same metric and direction, a complete tag at or before S, the same
validation set) is the best. Every other source that disagrees is said in one warning line, and the
tag it names is kept from pruning too (it could be the best: `ResumedBest.keep`); `best.json` is then
rewritten to the best. A best measured on another validation set (a changed `eval.shards_dir`, or a
record from before sets were named) starts a new lineage: said in one line, its tag kept.
A changed metric or direction starts from what `metrics.jsonl` holds for the new one (nothing: afresh).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipeline.train.checkpoint.tags import is_complete, saved_healthy, step_of_tag, tag_for_step
from pipeline.train.checkpoint.best import BEST_FILE, BestRecord, read_best, record_of
from pipeline.train.metrics import read_jsonl
from pipeline.train.validation import EVAL_SET_KEY, PREFIX

METRICS_FILE = "metrics.jsonl"


@dataclass
class ResumedBest:
    best: Optional[BestRecord] = None
    keep: list[str] = field(default_factory=list)  # tags kept from pruning besides the best (module doc)
    notes: list[str] = field(default_factory=list)  # one warning line each


def _good(root: Path, tag: str) -> bool:
    return is_complete(root / tag) and saved_healthy(root / tag)


def best_from_metrics(root: Path, metric: str, mode: str, step: int, eval_set: str) -> Optional[BestRecord]:
    """Source 2 (module doc): the best of `metrics.jsonl`'s records of `metric` at steps <= `step` whose
    tag under `root` is complete and healthy; None when there is none."""
    validation = metric.startswith(PREFIX)
    best: Optional[BestRecord] = None
    for record in read_jsonl(root.parent / METRICS_FILE):
        at, value = record.get("step"), record.get(metric)
        if not isinstance(at, int) or at > step or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value) or (validation and record.get(EVAL_SET_KEY) != eval_set):
            continue
        if not _good(root, tag_for_step(at)):
            continue
        if best is None or best.improved_by(float(value)):
            best = BestRecord(metric, mode, float(value), at, tag_for_step(at), eval_set if validation else "")
    return best


def reconcile_best(root: Path, metric: str, mode: str, step: int, meta_best: Any, eval_set: str) -> ResumedBest:
    """The best as of resumed step `step` (module doc). `meta_best`: the resumed tag's `RunMeta.best`;
    `eval_set`: this run's validation set (`Validator.identity`; "" without validation)."""
    out = ResumedBest()
    if not metric:
        return out
    validation = metric.startswith(PREFIX)
    current = eval_set if validation else ""

    def ours(record: Optional[BestRecord]) -> bool:
        return (record is not None and (record.metric, record.mode) == (metric, mode) and record.step <= step
                and _good(root, record.tag))

    def describe(record: BestRecord) -> str:
        return f"{record.tag} ({record.metric}={record.value:.6g})"

    meta_best = meta_best if isinstance(meta_best, dict) else {}
    from_tag = record_of(meta_best.get("record"))
    from_metrics = best_from_metrics(root, metric, mode, step, current)
    file_path = root / BEST_FILE
    from_file = read_best(root)
    sources = [(from_tag, f"the checkpoint at step {step}"), (from_metrics, METRICS_FILE), (from_file, BEST_FILE)]
    same_set = [(r, where) for r, where in sources if ours(r) and r.eval_set == current]
    out.best, source = same_set[0] if same_set else (None, "")
    keep = {t for t in meta_best.get("keep") or [] if isinstance(t, str) and step_of_tag(t) is not None}
    for record, where in same_set[1:]:
        if (record.tag, record.value) != (out.best.tag, out.best.value):
            keep.add(record.tag)
            if where == BEST_FILE:
                continue  # said by the rewrite's line below
            out.notes.append(f"train.keep_best={metric}: {where} names {describe(record)} as the best, {source} "
                             f"names {describe(out.best)}: {out.best.tag} is the best, {record.tag} is kept too")
    for record, where in sources:  # measured on another validation set: a new lineage, its best kept
        if ours(record) and record.eval_set != current and record.tag not in keep:
            keep.add(record.tag)
            out.notes.append(
                f"train.keep_best={metric}: the best so far, {describe(record)}, was measured on another validation "
                f"set ({record.eval_set or 'not recorded'}) than this run's ({current}): values of two sets are "
                f"not compared, so a new best starts from step {step + 1}; {record.tag} stays on disk (kept from "
                "pruning)")
    if out.best is not None and from_file != out.best:
        if not file_path.exists():
            why = "is missing"
        elif from_file is None:
            why = "is damaged (not a best record)"
        elif from_file.step > step:
            why = f"names {describe(from_file)}, after the resumed step (that future is set aside)"
        elif (from_file.metric, from_file.mode) != (metric, mode):
            why = f"is a best by {from_file.metric} ({from_file.mode}), not by train.keep_best={metric} ({mode})"
        elif not _good(root, from_file.tag):
            why = f"names {from_file.tag}, which is not a complete checkpoint"
        else:
            why = f"names {describe(from_file)}"
        kept = f" ({from_file.tag} is kept too)" if from_file is not None and from_file.tag in keep else ""
        out.notes.append(f"{file_path} {why}: rebuilt from {source}: {describe(out.best)} at step {out.best.step}{kept}")
    out.keep = sorted(t for t in keep if _good(root, t) and (out.best is None or t != out.best.tag))
    return out


def eval_set_change(meta: Any, step: int, eval_set: str, eval_dir: str) -> str:
    """One line when the resumed checkpoint's latest evaluation (`RunMeta.validation`) was of another
    validation set than this run's (`eval_set`, "" without validation), else ""."""
    before = str((getattr(meta, "validation", None) or {}).get(EVAL_SET_KEY) or "")
    if not before or not eval_set or before == eval_set:
        return ""
    old_dir = str(((getattr(meta, "config", None) or {}).get("eval") or {}).get("shards_dir") or "")
    where = f"eval.shards_dir {old_dir} -> {eval_dir}" if old_dir != eval_dir else f"eval.shards_dir={eval_dir}"
    return (f"eval: the validation set changed since the checkpoint at step {step} ({where}; identity {before} -> "
            f"{eval_set}: other sequences, or other eval.* settings): val/ values from step {step + 1} on are compared "
            "only with each other (cpt-status, the model card and train.keep_best leave the earlier ones out)")
