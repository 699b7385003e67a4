"""Representation health: is an encoder still telling tokens apart, and has its MLM left the plateau?

Two failure modes make a pretraining comparison meaningless, and neither shows in the loss alone:

* **collapse**: every token's last hidden state is (nearly) the same vector. Measured as the mean
  pairwise cosine similarity of the content tokens' states,

      c = mean_{i != j} cos(h_i, h_j) = (||sum_i u_i||^2 - n) / (n (n - 1)),   u_i = h_i / ||h_i||

  (O(n H), no n x n matrix). Healthy BERT-style encoders sit well below 1; a collapsed one at
  ~1.0. `COLLAPSE_COSINE` is the threshold above which a run is flagged.
* **a pinned contrastive positive**: a sequence-contrastive objective whose two views' representations
  agree perfectly (`capt/positive_cosine` ~ 1.0) has made the task trivial, typically because the
  encoder maps every input to the same vector; `pinned_positive_cosines` reads it off a run's last
  metrics (any `*/positive_cosine`), `POSITIVE_COSINE_PINNED` being the threshold.
* **the unigram plateau**: an MLM that predicts the most frequent token everywhere reaches the
  accuracy of that token's frequency at the masked positions, whatever the context. A baseline
  "learned" only when its masked-token accuracy clearly beats `unigram_accuracy`.

Used at conversion (`pipeline.export.health_check`: a loud warning and a section of the model
card), by the benchmarks (every report states both numbers for every run) and during training:
`step_health` reads an encoder output the step already computed (no extra forward) and logs
`health/token_cosine`, `health/unigram_accuracy` (the plateau on this batch's masked positions,
beside the objective's own masked accuracy, e.g. `mlm/accuracy`) and `health/unigram_entropy` (the
unigram predictor's cross-entropy at the same positions, the level a full-vocabulary LM loss such as
`mlm/loss` or `cocolm/clm_softmax_ce` must get below; `pipeline.monitor.signals` pairs them); `CollapseMonitor` adds the
`health/collapsed` flag and a warning when the run enters or leaves collapse. The top token comes
from `unigram_counts` over a bounded, evenly spaced sample of shard rows (deterministic, read once
at start-up, never a scan of the corpus).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import numpy as np
import torch
from torch import Tensor

#: Mean pairwise token cosine above which an encoder is reported as collapsed.
COLLAPSE_COSINE = 0.9
#: A contrastive positive cosine at or above this is "pinned at 1.0".
POSITIVE_COSINE_PINNED = 0.999


@torch.no_grad()
def token_cosine_tensor(hidden: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """`mean_token_cosine` as a 0-d float32 tensor on `hidden`'s device, computed without a host
    sync (the mask weights the unit vectors instead of indexing them), so a training step can log
    it for free; nan with fewer than two rows."""
    rows = hidden.detach().reshape(-1, hidden.shape[-1]).float()
    unit = torch.nn.functional.normalize(rows, dim=-1, eps=1e-8)
    if mask is None:
        weight = torch.ones(rows.shape[0], device=rows.device)
    else:
        weight = mask.reshape(-1).to(device=rows.device, dtype=torch.float32)
    total = (unit * weight[:, None]).sum(0)
    n = weight.sum()
    pairs = n * (n - 1)
    value = (total @ total - n) / pairs.clamp(min=1.0)
    return torch.where(pairs > 0, value, torch.full_like(value, float("nan")))


def mean_token_cosine(hidden: Tensor, mask: Optional[Tensor] = None) -> float:
    """Mean pairwise cosine of the rows of `hidden` [..., H] selected by `mask` [...] (bool; all rows
    when None), over all pairs of distinct rows; nan with fewer than two rows."""
    return float(token_cosine_tensor(hidden, mask))


def is_collapsed(token_cosine: float, threshold: float = COLLAPSE_COSINE) -> bool:
    return token_cosine == token_cosine and token_cosine > threshold  # nan (too few tokens) is not collapse


@torch.no_grad()
def encoder_token_cosine(encoder: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                         special_mask: Tensor) -> float:
    """`mean_token_cosine` of an encoder's last hidden states over the content tokens (attended,
    not [CLS]/[SEP]/[PAD]) of a batch, in eval mode (no dropout)."""
    was_training = encoder.training
    encoder.eval()
    try:
        hidden = encoder(input_ids, attention_mask).last_hidden
    finally:
        encoder.train(was_training)
    return mean_token_cosine(hidden, attention_mask.bool() & ~special_mask.bool())


def positive_cosines(metrics: Mapping[str, float]) -> dict[str, float]:
    """Every contrastive positive cosine (`<objective>/positive_cosine`) among a run's metrics."""
    return {k: float(v) for k, v in metrics.items() if k.endswith("positive_cosine") and isinstance(v, (int, float))}


def pinned_positive_cosines(metrics: Mapping[str, float], threshold: float = POSITIVE_COSINE_PINNED) -> dict[str, float]:
    """The positive cosines of `metrics` pinned at 1.0 (>= `threshold`)."""
    return {k: v for k, v in positive_cosines(metrics).items() if v >= threshold}


@torch.no_grad()
def unigram_accuracy(train_token_counts: Tensor, targets: Tensor) -> float:
    """Masked-token accuracy of always predicting the most frequent training token.

    train_token_counts [V]: how often each id occurs in the training data (special tokens zeroed by
    the caller); targets [N]: the original ids at the evaluated masked positions."""
    if targets.numel() == 0:
        return float("nan")
    top = int(torch.argmax(train_token_counts))
    return float((targets == top).float().mean())


# ---- during training -------------------------------------------------------------------------

#: Encoder inputs whose cached output `step_health` reads, in order of preference: the masked view
#: first (what MLM, TACO, CAPT and BERT-NCE all encode, so their numbers compare), then the others; last,
#: ELECTRA's generator-corrupted input (`StepContext.encode_private`), the only one its main model reads.
HEALTH_INPUTS: tuple[tuple[str, str], ...] = (
    ("masked_ids", "attention_mask"), ("input_ids", "attention_mask"), ("span_masked_ids", "attention_mask"),
    ("shuffled_ids", "attention_mask"), ("crop_ids", "crop_attention_mask"), ("corrupted_ids", "attention_mask"),
)
#: Label keys of the masked views, in order of preference (the unigram plateau is measured on them).
LABEL_KEYS = ("mlm_labels", "span_labels")
#: Rows read once at start-up to find the most frequent token (evenly spaced over the shards).
UNIGRAM_SAMPLE_ROWS = 4096


def unigram_counts(dataset: Any, max_rows: int = UNIGRAM_SAMPLE_ROWS) -> np.ndarray:
    """Token counts [V] over at most `max_rows` rows of a `ShardDataset`, evenly spaced over the
    whole dataset (deterministic; a bounded read, not a corpus scan), the manifest's special tokens
    (pad, cls, sep, mask, unk) zeroed: `argmax` is the unigram predictor's constant answer."""
    n = len(dataset)
    if n == 0:
        raise ValueError("unigram_counts: the dataset has no rows")
    rows = np.unique(np.linspace(0, n - 1, num=min(max_rows, n)).round().astype(np.int64))
    ids, _ = dataset.take(rows)
    counts = np.bincount(ids.reshape(-1).astype(np.int64), minlength=dataset.vocab_size).astype(np.int64)
    counts[sorted(set(dataset.special_tokens.values()))] = 0
    return counts


def unigram_log_probs(counts: np.ndarray) -> Tensor:
    """log q_v [V] (float64) of the add-one smoothed unigram distribution q_v = (c_v + 1) / sum_u (c_u + 1)
    of `unigram_counts` (special tokens, zeroed there, keep the add-one mass): the one home of the
    smoothing, shared by the output-bias start (`pipeline.pretrain.build.unigram_bias`), the NCE log q and
    `health/unigram_entropy`."""
    smoothed = counts.astype(np.float64) + 1.0
    return torch.from_numpy(np.log(smoothed / smoothed.sum()))


@torch.no_grad()
def step_health(cached: Mapping[tuple[str, str], Any], batch: Mapping[str, Tensor], structure_ids: Tensor,
                top_token: Optional[int], log_unigram: Optional[Tensor] = None) -> dict[str, Tensor]:
    """Health metrics of one micro-batch from encoder outputs it already has (`StepContext`'s cache):

    * `health/token_cosine`: `token_cosine_tensor` of the last hidden states of the content tokens
      (attended, not [PAD]/[CLS]/[SEP]) of the first cached input in `HEALTH_INPUTS` order; in
      training mode (dropout on), so it reads slightly lower than the eval-mode number of the
      conversion check;
    * `health/unigram_accuracy`: the fraction of this batch's masked targets equal to `top_token`,
      i.e. the accuracy of the unigram predictor on exactly the positions the objective's masked
      accuracy is measured on (when the batch has masked labels and `top_token` is known);
    * `health/unigram_entropy`: -mean log q(target) over the same positions, q the smoothed unigram
      distribution `log_unigram` [V] (`unigram_log_probs`, on the batch's device): the cross-entropy of
      the unigram predictor, i.e. the loss a full-vocabulary LM reaches by ignoring the context.
    No host sync; empty when nothing applies."""
    out: dict[str, Tensor] = {}
    key = next((k for k in HEALTH_INPUTS if k in cached), None)
    if key is not None:
        ids, attention = batch[key[0]], batch[key[1]]
        content = attention.bool() & ~torch.isin(ids, structure_ids.to(ids.device))
        out["health/token_cosine"] = token_cosine_tensor(cached[key].last_hidden, content)
    labels_key = next((k for k in LABEL_KEYS if k in batch), None)
    if labels_key is None:
        return out
    labels = batch[labels_key]
    selected = labels != -100  # pipeline.data.batch.IGNORE_INDEX (this module stays import-light)
    count = selected.sum().clamp(min=1).float()
    if top_token is not None:
        out["health/unigram_accuracy"] = (selected & (labels == top_token)).sum().float() / count
    if log_unigram is not None:
        # a gather at every position (ignored ones read id 0, then weighted 0): no boolean indexing, no sync
        log_q = log_unigram[labels.clamp(min=0)]
        out["health/unigram_entropy"] = -(log_q * selected).sum() / count
    return out


def collapse_problems(metrics: Mapping[str, float], threshold: float = COLLAPSE_COSINE,
                      pinned_threshold: float = POSITIVE_COSINE_PINNED) -> list[str]:
    """One sentence per sign of collapse in a step's logged metrics (empty: healthy as measured)."""
    problems = []
    cosine = metrics.get("health/token_cosine")
    if cosine is not None and is_collapsed(float(cosine), threshold):
        problems.append(f"mean token cosine {float(cosine):.4f} > {threshold}")
    for key, value in sorted(pinned_positive_cosines(metrics, pinned_threshold).items()):
        problems.append(f"{key} {value:.4f} >= {pinned_threshold} (the contrastive positive is pinned at 1.0)")
    return problems


@dataclass
class CollapseMonitor:
    """Flags collapse in the logged metrics of a training run: `observe` returns
    `{"health/collapsed": 0 or 1}` for every logged step and warns when the run enters collapse and
    when it leaves it (not at every step: a run can pass through a collapsed phase early on)."""

    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("pipeline.train"))
    collapsed: bool = False
    since: Optional[int] = None

    def observe(self, step: int, metrics: Mapping[str, float], announce: bool = True) -> dict[str, float]:
        problems = collapse_problems(metrics)
        if problems and not self.collapsed:
            self.since = step
            if announce:
                self.logger.warning("COLLAPSE at step %d: %s; every token's representation is nearly the same "
                                    "vector (metric health/collapsed = 1)", step, "; ".join(problems))
        elif not problems and self.collapsed and announce:
            self.logger.warning("recovered from collapse at step %d (collapsed since step %s)", step, self.since)
        self.collapsed = bool(problems)
        return {"health/collapsed": float(self.collapsed)}
