"""GLUE-format task directories: reading `train.tsv` / `dev.tsv`, the task table, the metrics.

A task directory holds tab-separated files with a header row (CoLA's header-less original files
are recognised by their four-column shape). Known tasks fix their text columns, label column,
label set and metric (GLUE paper, Wang et al. 2019, Table 1); `generic` detects them:

* label column: the first of `label`, `gold_label`, `score`, `is_duplicate`, `Quality`, else the
  last column;
* text columns: the known sentence/question columns present, else every other column that is
  not purely numeric (ids); one column = single sentence, two = sentence pair;
* regression when every label parses as a number and not all are integers, else classification.

Metrics: `pipeline.eval.metrics` (scikit-learn and scipy; an undefined one is null with its reason).
F1 is binary with the positive label `1` (MRPC, QQP).
"""
from __future__ import annotations

import csv
import math
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

LABEL_COLUMN_NAMES = ("label", "gold_label", "score", "is_duplicate", "Quality")
TEXT_COLUMN_NAMES = (
    ("sentence1", "sentence2"),
    ("question1", "question2"),
    ("#1 String", "#2 String"),
    ("question", "sentence"),
    ("text_a", "text_b"),
    ("sentence",),
    ("text",),
)


@dataclass(frozen=True)
class TaskSpec:
    """How to read one GLUE task and which metrics it reports (first one = the task's main metric)."""

    text_cols: tuple[str, ...]
    label_col: str
    labels: Optional[tuple[str, ...]]  # None: regression
    metrics: tuple[str, ...]
    positive_label: str = "1"


GLUE_TASKS: dict[str, TaskSpec] = {
    "cola": TaskSpec(("sentence",), "label", ("0", "1"), ("matthews", "accuracy")),
    "sst2": TaskSpec(("sentence",), "label", ("0", "1"), ("accuracy",)),
    "mrpc": TaskSpec(("#1 String", "#2 String"), "Quality", ("0", "1"), ("f1", "accuracy")),
    "qqp": TaskSpec(("question1", "question2"), "is_duplicate", ("0", "1"), ("f1", "accuracy")),
    "stsb": TaskSpec(("sentence1", "sentence2"), "score", None, ("pearson", "spearman")),
    "mnli": TaskSpec(
        ("sentence1", "sentence2"), "gold_label", ("contradiction", "entailment", "neutral"), ("accuracy",)
    ),
    "qnli": TaskSpec(("question", "sentence"), "label", ("entailment", "not_entailment"), ("accuracy",)),
    "rte": TaskSpec(("sentence1", "sentence2"), "label", ("entailment", "not_entailment"), ("accuracy",)),
    "wnli": TaskSpec(("sentence1", "sentence2"), "label", ("0", "1"), ("accuracy",)),
}
TASK_CHOICES = (*GLUE_TASKS, "generic")
#: CoLA's original files have no header: source, label, original label, sentence.
_COLA_COLUMNS = ("source", "label", "original_label", "sentence")


@dataclass
class TsvTable:
    path: Path
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def column(self, name: str, flag: str) -> list[str]:
        if name not in self.columns:
            headerless = any(_is_number(c) for c in self.columns)
            raise ValueError(f"{self.path}: no column {name!r} (columns: {_short(self.columns)})"
                             f"{'; its first line looks like data, not a header' if headerless else ''}; set {flag}")
        i = self.columns.index(name)
        return [r[i] for r in self.rows]


def read_tsv(path: Path, task: str) -> TsvTable:
    """A GLUE tsv (no quoting: GLUE text contains bare quotes). Short rows are an error, by line."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (a GLUE task dir needs train.tsv and dev.tsv)")
    csv.field_size_limit(sys.maxsize)
    with path.open(newline="", encoding="utf-8") as f:
        lines = [r for r in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if r and any(c.strip() for c in r)]
    if not lines:
        raise ValueError(f"{path}: empty")
    headerless_cola = task == "cola" and len(lines[0]) == 4 and lines[0][1] in ("0", "1")
    columns = list(_COLA_COLUMNS) if headerless_cola else [c.strip() for c in lines[0]]
    body = lines if headerless_cola else lines[1:]
    for n, row in enumerate(body, start=1 if headerless_cola else 2):
        if len(row) < len(columns):
            raise ValueError(f"{path}: line {n} has {len(row)} fields, the header has {len(columns)}")
    if not body:
        raise ValueError(f"{path}: no examples after the header")
    return TsvTable(path, columns, body)


def _short(values: Sequence[str], count: int = 5, width: int = 40) -> str:
    """At most `count` values, each cut to `width` characters: file contents quoted in an error stay short."""
    cut = [v if len(v) <= width else v[: width - 3] + "..." for v in list(values)[:count]]
    return repr(cut)[:-1] + (f", ... ({len(values)} in all)]" if len(values) > count else "]")


def _is_number(value: str) -> bool:
    try:
        return math.isfinite(float(value))
    except ValueError:
        return False


def detect_spec(train: TsvTable, text_cols: Optional[Sequence[str]], label_col: Optional[str]) -> TaskSpec:
    """A `TaskSpec` for a `generic` task, from the train file's header and labels."""
    cols = train.columns
    if any(_is_number(c) for c in cols):
        raise ValueError(f"{train.path}: its first line looks like data, not a header (columns: {_short(cols)}); a "
                         "generic task's files start with a header line naming the text and label columns")
    named = next((c for c in LABEL_COLUMN_NAMES if c in cols), None)
    if label_col is None and named is None and len(cols) < 2:
        raise ValueError(f"{train.path}: no label column (columns: {_short(cols)}; looked for "
                         f"{list(LABEL_COLUMN_NAMES)} or a last column besides the text); add one or set --label-col")
    label = label_col or named or cols[-1]
    labels = train.column(label, "--label-col")
    if text_cols:
        texts = tuple(text_cols)
    else:
        texts = next((group for group in TEXT_COLUMN_NAMES if all(c in cols for c in group)), ())
        if not texts:
            texts = tuple(
                c for c in cols if c != label and not all(_is_number(v) for v in train.column(c, "--text-cols"))
            )
    if not 1 <= len(texts) <= 2:
        raise ValueError(f"{train.path}: found text columns {list(texts)}; pass one or two with --text-cols")
    for c in texts:
        train.column(c, "--text-cols")
    regression = all(_is_number(v) for v in labels) and not all(float(v).is_integer() for v in labels)
    if regression:
        return TaskSpec(texts, label, None, ("pearson", "spearman"))
    label_set = tuple(sorted(set(labels)))
    if label_col is None and len(label_set) > 50 and 2 * len(label_set) > len(labels):
        raise ValueError(f"{train.path}: column {label!r}, taken as the label, has {len(label_set)} distinct values in "
                         f"{len(labels)} rows: it holds text, not labels; name the label column with --label-col "
                         f"(columns: {_short(cols)})")
    if len(label_set) < 2:
        raise ValueError(f"{train.path}: column {label!r} has a single label {label_set}; nothing to learn")
    metrics = ("accuracy", "f1", "matthews") if len(label_set) == 2 else ("accuracy",)
    positive = "1" if "1" in label_set else label_set[-1]
    return TaskSpec(texts, label, label_set, metrics, positive)


@dataclass
class Split:
    texts: list[tuple[str, ...]]
    labels: Optional[list[float] | list[int]]  # None: an unlabelled file (predictions only)
    index: Optional[list[str]] = None  # the file's `index` column (GLUE test files), else row numbers

    def ids(self) -> list[str]:
        return self.index if self.index is not None else [str(i) for i in range(len(self.texts))]


def load_split(table: TsvTable, spec: TaskSpec) -> Split:
    """Examples of one file; labels as class indices (classification) or floats (regression), or
    None when the file has no label column (a GLUE test file)."""
    columns = [table.column(c, "--text-cols") for c in spec.text_cols]
    index = table.column("index", "") if "index" in table.columns else None
    if spec.label_col not in table.columns:
        return Split(list(zip(*columns)), None, index)
    raw = table.column(spec.label_col, "--label-col")
    if spec.labels is None:
        bad = next((i for i, v in enumerate(raw) if not _is_number(v)), None)
        if bad is not None:
            raise ValueError(f"{table.path}: label {raw[bad]!r} in row {bad + 1} is not a number (regression task)")
        labels: list = [float(v) for v in raw]
    else:
        index = {name: i for i, name in enumerate(spec.labels)}
        unknown = sorted(set(raw) - set(index))
        if unknown:
            raise ValueError(f"{table.path}: labels {_short(unknown, 3)} not in the task's label set "
                             f"{_short(spec.labels)}")
        labels = [index[v] for v in raw]
    return Split(list(zip(*columns)), labels, index if "index" in table.columns else None)


def subset_split(split: Split, n: int, seed: int) -> Split:
    """`n` examples drawn without replacement with `seed` (file order kept); all when `n` >= size."""
    if n >= len(split.texts):
        return split
    rows = sorted(np.random.default_rng(seed).choice(len(split.texts), size=n, replace=False).tolist())
    labels = None if split.labels is None else [split.labels[i] for i in rows]
    index = [split.ids()[i] for i in rows]
    return Split([split.texts[i] for i in rows], labels, index)


# ---- metrics ----------------------------------------------------------------------------------


def task_metrics(spec: TaskSpec, predictions: np.ndarray, gold: np.ndarray) -> tuple[dict[str, Optional[float]],
                                                                                     dict[str, str]]:
    """The task's metrics (`pipeline.eval.metrics`: scikit-learn / scipy): ({name: value, None when undefined},
    {name: why undefined}); classification `predictions` are class indices, regression ones floats."""
    from pipeline.eval import metrics

    if spec.labels is None:
        x, y = predictions.astype(np.float64), gold.astype(np.float64)
        table = {"pearson": lambda: metrics.pearson(x, y, ("predicted score", "gold score")),
                 "spearman": lambda: metrics.spearman(x, y, ("predicted score", "gold score"))}
    else:
        labels = spec.labels
        table = {"accuracy": lambda: metrics.accuracy(predictions, gold),
                 "f1": lambda: metrics.f1_binary(predictions, gold, labels.index(spec.positive_label)),
                 "matthews": lambda: metrics.matthews(predictions, gold)}
    unknown = [name for name in spec.metrics if name not in table]
    if unknown:  # pragma: no cover - the task table names only these
        raise ValueError(f"metrics {unknown}: not for a {'regression' if spec.labels is None else 'classification'} task")
    return metrics.metric_values({name: table[name] for name in spec.metrics})


def resolve_task(
    task_dir: str | os.PathLike,
    task: str,
    text_cols: Optional[Sequence[str]] = None,
    label_col: Optional[str] = None,
    train_file: str = "train.tsv",
    dev_file: str = "dev.tsv",
) -> tuple[TaskSpec, Split, Split]:
    """(spec, train split, dev split) of a GLUE-format directory."""
    if task not in TASK_CHOICES:
        raise ValueError(f"--task {task!r}: choose one of {list(TASK_CHOICES)}")
    task_dir = Path(task_dir)
    if not task_dir.is_dir():
        raise FileNotFoundError(f"--task-dir {task_dir}: not a directory")
    train = read_tsv(task_dir / train_file, task)
    dev = read_tsv(task_dir / dev_file, task)
    if task == "generic":
        spec = detect_spec(train, text_cols, label_col)
    else:
        spec = GLUE_TASKS[task]
        if text_cols or label_col:
            spec = replace(spec, text_cols=tuple(text_cols or spec.text_cols), label_col=label_col or spec.label_col)
    for table in (train, dev):  # both must be labelled
        table.column(spec.label_col, "--label-col")
    return spec, load_split(train, spec), load_split(dev, spec)


def load_eval_file(task_dir: str | os.PathLike, file: str, spec: TaskSpec, task: str) -> Split:
    """A further file to predict (`--eval-file`, e.g. GLUE's `test.tsv`); labels when it has them."""
    return load_split(read_tsv(Path(task_dir) / file, task), spec)
