"""`eval.*`: validation during training — which held-out shard set, how often, how much — owned and
validated here (the measurement itself: `pipeline.train.validation`).

Stage 1 (`EvalConfig.check`, the config alone): `eval.every` within the run, positive batch counts.
Stage 2 (`check_eval_set`, before any model is built): the held-out directory is checked by the
rules training shards are (`pipeline.data.config.check_shard_dir`: complete, listed shards present,
layout, content hash, special-token ids against its tokenizer), then against the run's data: the
same tokenizer (hash, vocabulary, special-token ids, `pipeline.data.sources.mixture_mismatches`'
fields), the same `seq_len` (every phase's: a phase with its own `seq_len` is refused, naming it),
not the training set itself, nor its documents or rows in other shards (any training directory of the
run: a mixture's sources, every phase's; `pipeline.data.overlap`: the same documents by their source
files, the same rows by their token ids, whatever the shard size or build), and at least one
evaluation micro-batch per rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from pipeline.config.checks import ConfigError, check_positive
from pipeline.data.shards import Manifest

#: `eval.seed` default: a fixed value, not the run seed, so that runs with different seeds evaluated on
#: the same set see the same masked positions (curves compare across runs).
DEFAULT_EVAL_SEED = 20240


@dataclass
class EvalConfig:
    shards_dir: str = ""
    """Held-out shard directory (e.g. `data_prep.build_shards --holdout-fraction 0.05`'s validation set)
    built with the run's tokenizer and seq_len; "" switches validation off."""
    every: int = 0
    """Evaluate every this many optimizer steps, and at the last step (`train.total_steps`: at the last
    step only); required, in [1, train.total_steps], when `shards_dir` is set."""
    batches: int = 8
    """Micro-batches each rank evaluates per evaluation (bounds the cost; capped at what the set holds)."""
    micro_batch_size: int = 0
    """Sequences per evaluation micro-batch on one rank; 0: `data.micro_batch_size`."""
    seed: int = DEFAULT_EVAL_SEED
    """Seed of the validation batches' order and corruption (masks, spans, crops, negatives): the same
    positions at every evaluation of a run and across runs on the same set. Independent of `train.seed`."""

    @property
    def enabled(self) -> bool:
        return bool(self.shards_dir)

    def micro_batch(self, train_micro: int) -> int:
        """The evaluation micro-batch size (`micro_batch_size`, or the training one)."""
        return self.micro_batch_size or train_micro

    def check(self, total_steps: int) -> None:
        """Stage-1 checks (the config and the run's length)."""
        check_positive(self.batches, "eval.batches")
        check_positive(self.micro_batch_size, "eval.micro_batch_size", allow_zero=True)
        check_positive(self.every, "eval.every", allow_zero=True)
        if self.shards_dir and not self.every:
            raise ConfigError(f"eval.every=0 with eval.shards_dir={self.shards_dir}: evaluate every N steps, N in "
                              f"[1, train.total_steps={total_steps}] (N = train.total_steps: at the last step only)")
        if self.every and not self.shards_dir:
            raise ConfigError(f"eval.every={self.every} but eval.shards_dir is not set: name a held-out shard "
                              "directory (data_prep.build_shards --holdout-fraction) or leave eval.every at 0")
        if self.every > total_steps:
            raise ConfigError(f"eval.every={self.every} exceeds train.total_steps={total_steps}: the run would never "
                              "evaluate before its end; use a value <= train.total_steps")

    def due(self, step: int, total_steps: int) -> bool:
        """Is step `step` an evaluation step: every `every` steps and the last (a pure function of the step,
        so a resumed run continues the same schedule)."""
        return self.enabled and (step == total_steps or step % self.every == 0)


def check_eval_set(cfg: EvalConfig, train: Manifest, train_dir: str, phases: Sequence[tuple[str, int]],
                   world_size: int, train_micro: int, train_dirs: Sequence[str] = ()) -> Optional[Manifest]:
    """Stage 2: the held-out set against the run (module doc); its manifest, None when validation is off.
    `phases`: (label, seq_len) of each phase of a phased run (empty otherwise); `train_dirs`: every
    directory the run trains on (default: `train_dir`)."""
    if not cfg.enabled:
        return None
    from pipeline.data.config import check_shard_dir

    held = check_shard_dir(cfg.shards_dir, "eval.shards_dir", None)
    where = f"eval.shards_dir={cfg.shards_dir}"
    for what, mine, theirs in (("tokenizer_hash", held.tokenizer_hash, train.tokenizer_hash),
                               ("vocab_size", held.vocab_size, train.vocab_size),
                               ("special_tokens", held.special_tokens, train.special_tokens)):
        if mine != theirs:
            raise ConfigError(f"{where} was built with another tokenizer than the training data ({what} {mine} vs "
                              f"{theirs}); rebuild it with data_prep.build_shards --tokenizer {Path(train_dir) / 'tokenizer'}")
    for label, seq_len in phases or [("data.seq_len", train.seq_len)]:
        if held.seq_len != seq_len:
            raise ConfigError(f"{where} has seq_len={held.seq_len} but {label} has seq_len={seq_len}: validation "
                              "needs a held-out set of the same seq_len (build one with that --seq-len)")
    if held.content_hash and held.content_hash == train.content_hash:
        raise ConfigError(f"{where} is the training data itself ({train_dir}): a validation set must be held out "
                          "(data_prep.build_shards --holdout-fraction writes one)")
    check_held_out(cfg.shards_dir, held, list(dict.fromkeys([*train_dirs] or [train_dir])))
    micro = cfg.micro_batch(train_micro)
    if held.total_sequences < micro * world_size:
        raise ConfigError(f"{where} holds {held.total_sequences} sequences, fewer than one evaluation batch per rank "
                          f"(eval.micro_batch_size {micro} x {world_size} rank(s) = {micro * world_size}); hold out "
                          "more documents or lower eval.micro_batch_size")
    return held


def check_held_out(held_dir: str, held: Manifest, train_dirs: Sequence[str]) -> None:
    """Refuse a held-out set holding documents or rows of any training directory (`pipeline.data.overlap`)."""
    from pipeline.data.overlap import REFUSE_SHARE, row_overlap, shared_source
    from pipeline.data.shards import read_manifest

    where = f"eval.shards_dir={held_dir}"
    for train_dir in train_dirs:
        try:
            train = read_manifest(train_dir)
        except (OSError, ValueError):
            continue  # the training data's own checks name it
        source = shared_source(held, train)
        if source is not None:
            raise ConfigError(
                f"{where} was built from {Path(str(source.get('path', '?'))).name} (sha256 {str(source['sha256'])[:12]}), "
                f"which the training data {train_dir} was built from too: it holds training documents, whatever its "
                "shards' size or bytes; hold documents out with data_prep.build_shards --holdout-fraction")
        overlap = row_overlap(held_dir, train_dir)
        if overlap.refused():
            raise ConfigError(
                f"{where}: about {overlap.share:.0%} of its rows are rows of the training data {train_dir} ({overlap.hits} "
                f"of {overlap.sampled} sampled training rows are in it; refused from {REFUSE_SHARE:.0%}): the same "
                "sequences in other shards; hold documents out with data_prep.build_shards --holdout-fraction")


#: First name segments every run logs besides its objectives' (`pipeline.pretrain.pretrainer`, `pipeline.monitor.health`).
COMMON_PREFIXES = ("loss", "health")


def check_keep_best(keep_best: str, mode: str, objectives: dict, eval_cfg: EvalConfig) -> None:
    """Stage 1 of `train.keep_best` against what the run can log (before compute): a `val/` metric needs
    `eval.shards_dir`; the name's first segment must be the total `loss`, `health`, one of the run's
    objectives, or (`val/` only) `mlm_head` when an objective trains the shared MLM head; a metric whose
    name says its direction (`..._loss` lower, `..._accuracy` / `..._auc` higher, `pipeline.monitor.signals`)
    must agree with `train.keep_best_mode`. A `val/` name these rules let through but that the evaluation
    does not log is refused at the first evaluation (`pipeline.train.validation.check_best_metric`)."""
    if not keep_best:
        return
    from pipeline.config.checks import did_you_mean
    from pipeline.monitor.signals import direction_of
    from pipeline.objectives.registry import mlm_head_training

    where = f"train.keep_best={keep_best}"
    validation = keep_best.startswith("val/")
    if validation and not eval_cfg.enabled:
        raise ConfigError(f"{where}: a validation metric, but eval.shards_dir is not set, so no evaluation logs it; "
                          "set eval.shards_dir and eval.every")
    name = keep_best[len("val/"):] if validation else keep_best
    known = [*COMMON_PREFIXES, *objectives, *(["mlm_head"] if validation and mlm_head_training(objectives) else [])]
    if name.split("/", 1)[0] not in known:
        raise ConfigError(f"{where}: no objective logs it{did_you_mean(name.split('/', 1)[0], known)}; metric names "
                          f"start with {', '.join(('val/' if validation else '') + k for k in known)}")
    direction = direction_of(name)
    if direction is not None and {"lower": "min", "higher": "max"}[direction] != mode:
        raise ConfigError(f"{where} with train.keep_best_mode={mode}: {direction} is better for it; set "
                          f"train.keep_best_mode={'min' if direction == 'lower' else 'max'}")
