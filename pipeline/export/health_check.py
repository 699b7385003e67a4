"""The health check at conversion: has this encoder collapsed? (measures of `pipeline.monitor.health`)

A collapsed encoder — every token's last hidden state nearly the same vector — fine-tunes worse
than a random one, yet its MLM loss can look plausible and it converts like any other. Two signs
are checked before anything is written:

* the mean pairwise cosine of the content tokens' last hidden states on `PROBE_ROWS` rows of the
  run's shards, spread evenly over the whole dataset (`pipeline.monitor.health.encoder_token_cosine`;
  collapsed above `COLLAPSE_COSINE`). The shards are found through `pipeline_meta.json`'s
  `data_dir` or `convert --shards DIR`; without them this measure is reported as not measured;
* a contrastive positive cosine pinned at 1.0 in the run's last logged metrics
  (`pipeline.monitor.health.pinned_positive_cosines`, e.g. `capt/positive_cosine`).

Beside them, the run's learning signals at its last logged step (`pipeline.monitor.signals`: each
term against its chance level, the unigram plateau or entropy) go into the model card; a signal
at chance is reported there, not treated as collapse (one logged step is a noisy sample of it).

An unhealthy checkpoint still converts (it may be wanted for a post-mortem), but the converter
prints a loud warning on stderr and the model card carries it at the top.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TextIO

import numpy as np
import torch

from pipeline.monitor.health import (
    COLLAPSE_COSINE,
    POSITIVE_COSINE_PINNED,
    encoder_token_cosine,
    is_collapsed,
    pinned_positive_cosines,
    positive_cosines,
)
from pipeline.monitor.signals import Signal, learning_signals
from pipeline.pretrain.pretrainer import PretrainModel
from pipeline.train.run_meta import RunMeta

PROBE_ROWS = 16


@dataclass
class HealthReport:
    token_cosine: Optional[float]  # None: not measured (see `note`)
    probe_rows: int = 0
    probe_tokens: int = 0
    positive_cosines: dict[str, float] = field(default_factory=dict)
    note: str = ""
    signals: list[Signal] = field(default_factory=list)  # the last logged step's learning signals

    @property
    def collapsed(self) -> bool:
        return self.token_cosine is not None and is_collapsed(self.token_cosine)

    @property
    def pinned(self) -> dict[str, float]:
        return pinned_positive_cosines(self.positive_cosines)

    def problems(self) -> list[str]:
        """One sentence per sign of collapse found (empty: healthy as far as measured)."""
        out = []
        if self.collapsed:
            out.append(f"mean token cosine {self.token_cosine:.4f} > {COLLAPSE_COSINE} on {self.probe_tokens} content "
                       f"tokens of {self.probe_rows} shard rows: every token's last hidden state is nearly the same "
                       "vector")
        for key, value in sorted(self.pinned.items()):
            out.append(f"{key} = {value:.4f} (>= {POSITIVE_COSINE_PINNED}): the contrastive positive is pinned at 1.0")
        return out


def probe_batch(shards_dir: str | os.PathLike, rows: int = PROBE_ROWS) -> dict[str, torch.Tensor]:
    """`rows` rows spread evenly over the shards, as the `original` view of the collator (input ids,
    attention mask, structure-token mask)."""
    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.reader import ShardDataset

    dataset = ShardDataset(shards_dir)
    index = np.unique(np.linspace(0, len(dataset) - 1, num=min(rows, len(dataset))).round().astype(np.int64))
    ids, starts = dataset.take(index)
    collator = CorruptionCollator(("original",), dataset.special_tokens, dataset.vocab_size, seed=0)
    return collator.collate(ids, starts, index)


def check_health(model: PretrainModel, state: dict[str, torch.Tensor], meta: RunMeta,
                 shards_dir: Optional[str | os.PathLike]) -> HealthReport:
    """Both measures for the checkpoint weights `state` (its `bert.*` are loaded into `model`, the
    model `pipeline_meta.json` describes) and the run's last metrics."""
    positives = positive_cosines(meta.last_metrics)
    signals = learning_signals(meta.last_metrics)
    path = Path(shards_dir or meta.data_dir or "")
    if not str(path) or not (path / "manifest.json").is_file():
        return HealthReport(None, positive_cosines=positives, signals=signals,
                            note=f"shards not found at {path.name or '(no data_dir)'}: pass --shards DIR to measure")
    changed = data_changed(path, meta)
    if changed:
        return HealthReport(None, positive_cosines=positives, signals=signals, note=changed)
    model.bert.load_state_dict({k[len("bert."):]: v for k, v in state.items() if k.startswith("bert.")})
    batch = probe_batch(path)
    cosine = encoder_token_cosine(model.bert, batch["input_ids"], batch["attention_mask"], batch["special_mask"])
    tokens = int((batch["attention_mask"].bool() & ~batch["special_mask"].bool()).sum())
    return HealthReport(cosine, len(batch["input_ids"]), tokens, positives, signals=signals)


def data_changed(path: Path, meta: RunMeta) -> str:
    """'' when the shards at `path` are the data the run trained on (their manifest's identity, or for
    older checkpoints the manifest file's sha256, equals the `manifest_hash` recorded at training), else
    the note saying they are not, so the token cosine is not measured on other text. A mixture run
    (`data.sources`) recorded the mixture's hash, which one directory cannot be compared with: not checked."""
    from pipeline.data.shards import manifest_file_sha256, manifest_hash

    if not meta.manifest_hash or (meta.config.get("data") or {}).get("sources"):
        return ""
    try:
        current = manifest_hash(path)
    except (OSError, ValueError) as err:
        return f"shards at {path.name} unreadable ({err}): pass --shards DIR of the run's data to measure"
    if meta.manifest_hash in (current, manifest_file_sha256(path)):
        return ""
    return (f"shards at {path.name} are not the data this checkpoint trained on (manifest {current[:12]}, recorded at "
            f"training {meta.manifest_hash[:12]}: rebuilt or replaced since): pass --shards DIR of the run's data to "
            "measure")


def announce(report: HealthReport, stream: Optional[TextIO] = None) -> None:
    """A loud banner on `stream` (stderr) when the checkpoint looks collapsed; a note when unmeasured."""
    stream = stream or sys.stderr
    problems = report.problems()
    if problems:
        bar = "!" * 78
        lines = [bar, "WARNING: this checkpoint looks COLLAPSED; it will likely fine-tune worse than a random "
                 "model.", *(f"  - {p}" for p in problems), "The model card records this.", bar]
        print("\n".join(lines), file=stream)
    elif report.token_cosine is None:
        print(f"note: token-cosine health check not run ({report.note})", file=stream)
