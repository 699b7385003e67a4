"""Data of the time-to-quality study: pretraining shards, two held-out halves, the SST-2 splits.

* pretraining: a WordPiece tokenizer and shards (`cpt-train-tokenizer`, `cpt-build-shards`; the study
  file names the directories);
* held-out text (WikiText-2 test) split into two halves by article (WikiText's ` = Title = ` lines;
  by line when the text has no such headings) by this module's command, each then its own shard
  directory with the same tokenizer: `heldout_select` is the one the learning rate may be chosen on
  (when no task is given), `heldout_report` is the one every reported masked-LM number comes from::

      python -m pipeline.study.data TEXT OUT_DIR   # OUT_DIR/select.txt, report.txt, split.json

* SST-2 (a task's `dir`, GLUE format with a labelled `test.tsv`): fine-tuning uses `train_examples`
  examples of `train.tsv` drawn with `pipeline.eval.glue.subset_split` (what `finetune
  --train-subset` draws), and `select.tsv` holds `select_examples` *other* examples of `train.tsv`:
  the split the learning rate is chosen on. `dev.tsv` is only ever reported (curves), `test.tsv`
  is predicted once, at the end, for the selected configurations.

Everything is written atomically under the study's work directory, and a step whose output exists
is skipped, so a re-run costs nothing here.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from pipeline.io import write_atomic

#: A WikiText article heading: ` = Title = ` (sections are ` = = Section = = `).
ARTICLE_HEADING = re.compile(r"^ = [^=].* = $")
SST2_FILES = ("train.tsv", "dev.tsv", "test.tsv")


@dataclass
class StudyData:
    train_shards: Path
    select_shards: Path
    report_shards: Path
    sst2_dir: Optional[Path]  # None: SST-2 absent (downstream skipped)
    select_file: Optional[Path]  # SST-2 examples the learning rate is chosen on
    sst2_note: str = ""

    def to_json(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


def split_halves(text_file: Path, first: Path, second: Path) -> dict:
    """Write the first and second half of `text_file`'s articles (by bytes, cut at an article
    boundary; at a line boundary when there are fewer than two articles); returns the counts."""
    lines = text_file.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if ARTICLE_HEADING.match(line.rstrip("\n"))]
    if len(starts) < 2:
        starts = list(range(len(lines)))
    if len(starts) < 2:
        raise ValueError(f"{text_file}: too little text to split into two held-out halves")
    sizes = np.cumsum([len(line.encode()) for line in lines])
    half = sizes[-1] / 2
    cut = min(starts[1:], key=lambda i: abs(sizes[i - 1] - half))  # an article start closest to the middle
    write_atomic(first, "".join(lines[:cut]), shared=True, parents=True)
    write_atomic(second, "".join(lines[cut:]), shared=True, parents=True)
    return {"source": str(text_file), "cut_line": cut, "units": len(starts),
            "by": "article" if len(starts) < len(lines) else "line"}


def prepare_sst2(sst2_dir: Optional[str], work: Path, n_train: int, n_select: int, seed: int,
                 task: str = "sst2", select: Optional[Path] = None) -> tuple[Optional[Path], Optional[Path], str]:
    """(SST-2 dir, selection file, note). The selection split is `n_select` examples of `train.tsv`
    outside the fine-tuning subset (`subset_split(train, n_train, seed)`), so no example the model
    is fine-tuned on is ever scored for selection. (None, None, reason) when SST-2 is absent.
    `task`: any GLUE task of `pipeline.eval.glue.GLUE_TASKS` (the SLURM study's several tasks;
    `select`: where its selection file goes, default `<work>/sst2/select.tsv`)."""
    from pipeline.eval.glue import GLUE_TASKS, load_split, read_tsv, subset_split

    if not sst2_dir:
        return None, None, "no task directory given: downstream evaluation skipped"
    root = Path(sst2_dir)
    missing = [f for f in SST2_FILES if not (root / f).is_file()]
    if missing:
        return None, None, f"SST-2 not found ({root}: missing {', '.join(missing)}): downstream evaluation skipped"
    spec = GLUE_TASKS[task]
    table = read_tsv(root / "train.tsv", task)
    train = load_split(table, spec)
    if n_train + n_select > len(train.texts):
        raise ValueError(f"train_examples {n_train} + select_examples {n_select} > {len(train.texts)} examples in "
                         f"{root / 'train.tsv'}")
    test = load_split(read_tsv(root / "test.tsv", task), spec)
    if test.labels is None:
        raise ValueError(f"{root / 'test.tsv'}: no labels; the study scores the test split once at the end")
    used = set(subset_split(train, n_train, seed).ids())
    rest = [i for i in range(len(train.texts)) if str(i) not in used]
    chosen = sorted(np.random.default_rng(seed + 1).choice(len(rest), size=n_select, replace=False).tolist())
    select = select or work / "sst2" / "select.tsv"
    if not select.is_file():
        columns = [table.columns.index(c) for c in (*spec.text_cols, spec.label_col)]
        rows = [table.rows[rest[i]] for i in chosen]
        write_atomic(select, "\t".join((*spec.text_cols, spec.label_col)) + "\n"
                     + "".join("\t".join(r[c] for c in columns) + "\n" for r in rows), shared=True, parents=True)
    return root, select, (f"SST-2 from {root}: fine-tuning on {n_train} train examples (subset seed {seed}), "
                          f"selection on {n_select} other train examples, dev reported, test scored once at the end")


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m pipeline.study.data TEXT OUT_DIR`: the two held-out halves of TEXT."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not Path(args[0]).is_file():
        print("usage: python -m pipeline.study.data TEXT OUT_DIR (TEXT: an existing text file)", file=sys.stderr)
        return 2
    out = Path(args[1])
    info = split_halves(Path(args[0]), out / "select.txt", out / "report.txt")
    write_atomic(out / "split.json", json.dumps(info, indent=1), shared=True, parents=True)
    print(f"wrote {out / 'select.txt'} and {out / 'report.txt'} (cut at line {info['cut_line']}, by {info['by']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
