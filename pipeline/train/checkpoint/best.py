"""The best checkpoint by a logged metric (`train.keep_best`, `train.keep_best_mode`): `checkpoints/best.json`.

    train.keep_best: val/mlm/loss      # a metric name the run logs (validation, `pipeline.eval`)
    train.keep_best_mode: min          # min (losses) or max (accuracies, correlations)

`best.json` = `{"metric", "mode", "value", "step", "tag", "eval_set"}`: the tag whose metric was the
best seen so far (`eval_set`: for a `val/` metric, the identity of the validation set it was measured
on, `pipeline.train.validation.eval_set_identity`; values of two sets are never compared). It is written (atomically, rank 0) when that tag's save completes, in the same stage that
writes its `COMPLETE.json` and moves `latest`, so it never names a tag that is not complete; a
crash before leaves the previous best in charge. Pruning (`keep_last`) never deletes the tag it
names, so a run keeps its `keep_last` newest checkpoints plus its best. The best tag is an ordinary
complete tag: resume from it or convert it like any other (`cpt-convert RUN/checkpoints/<tag> OUT`).

"Better" is strict (`<` for min, `>` for max): a tie keeps the earlier tag. A non-finite value is
never a best. Every checkpoint also records the best as of itself (`RunMeta.best`), so `best.json`
is a pointer that can be rebuilt: on resume the record is reconciled with the checkpoint's and with
`metrics.jsonl` (`pipeline.train.checkpoint.best_resume`); a changed `train.keep_best` metric or
direction starts afresh, and a changed validation set starts a new lineage (the earlier set's best
tag stays on disk).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from pipeline.io import write_atomic

BEST_FILE = "best.json"
MODES = ("min", "max")


@dataclass(frozen=True)
class BestRecord:
    metric: str
    mode: str
    value: float
    step: int
    tag: str
    eval_set: str = ""  # a `val/` metric's validation set (`pipeline.train.validation.EVAL_SET_KEY`); "" otherwise

    def improved_by(self, value: float) -> bool:
        """Whether `value` is strictly better than this record's (in its direction)."""
        return value < self.value if self.mode == "min" else value > self.value


def better(record: Optional[BestRecord], metric: str, mode: str, value: float) -> bool:
    """Whether `value` of `metric` would be a new best over `record` (None: none yet)."""
    if not math.isfinite(value):
        return False
    if record is None or (record.metric, record.mode) != (metric, mode):
        return True
    return record.improved_by(value)


def record_of(raw: object) -> Optional[BestRecord]:
    """A `BestRecord` from its dict form (`best.json`, `RunMeta.best`), None when it is not one."""
    try:
        assert isinstance(raw, dict)
        record = BestRecord(str(raw["metric"]), str(raw["mode"]), float(raw["value"]), int(raw["step"]),
                            str(raw["tag"]), str(raw.get("eval_set", "")))
    except (AssertionError, ValueError, KeyError, TypeError):
        return None
    # the tag is the step's own name (`step_%08d`): a record cannot point outside checkpoints/
    well_formed = record.mode in MODES and math.isfinite(record.value) and record.tag == f"step_{record.step:08d}"
    return record if well_formed else None


def read_best(root: Path) -> Optional[BestRecord]:
    """The record of `root/best.json`, or None when there is none or it is unreadable (a resume rebuilds
    it, `pipeline.train.checkpoint.best_resume`; during a run pruning keeps the run's own record)."""
    try:
        raw = json.loads((root / BEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record_of(raw)


def write_best(root: Path, record: BestRecord) -> None:
    """Replace `root/best.json` atomically (a reader sees the old record or the new one)."""
    write_atomic(root / BEST_FILE, json.dumps(asdict(record), indent=1, sort_keys=True))
