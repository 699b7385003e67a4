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
card) and by the benchmarks (every report states both numbers for every run).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import Tensor

#: Mean pairwise token cosine above which an encoder is reported as collapsed.
COLLAPSE_COSINE = 0.9
#: A contrastive positive cosine at or above this is "pinned at 1.0".
POSITIVE_COSINE_PINNED = 0.999


@torch.no_grad()
def mean_token_cosine(hidden: Tensor, mask: Optional[Tensor] = None) -> float:
    """Mean pairwise cosine of the rows of `hidden` [..., H] selected by `mask` [...] (bool; all rows
    when None), over all pairs of distinct rows; nan with fewer than two rows."""
    rows = hidden.reshape(-1, hidden.shape[-1]).float()
    if mask is not None:
        rows = rows[mask.reshape(-1).bool()]
    n = rows.shape[0]
    if n < 2:
        return float("nan")
    unit = torch.nn.functional.normalize(rows, dim=-1, eps=1e-8)
    total = unit.sum(0)
    return float((total @ total - n) / (n * (n - 1)))


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
