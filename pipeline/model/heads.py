"""BERT's MLM head (`cls.predictions`) with Hugging Face parameter names, the tied vocabulary projection.

ZeRO-3 note: parameters are gathered per module around that module's forward. Anything that
reads the tied word-embedding matrix must therefore do so inside the forward of the module that
holds it; `TiedVocabProjection` owns the (tied) weight for exactly that reason, and callers hand
it the loss function to apply (`head(hidden, fn, *args)`), so no `[tokens, vocab]` logits are
built outside the loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from typing import Optional

from torch import Tensor, nn

from pipeline.model.encoder import EncoderConfig


class TiedVocabProjection(nn.Module):
    """`cls.predictions.decoder`: owns the tied word-embedding weight and the output bias.

    Callers pass a loss function that receives `(hidden, weight, bias, ...)`; the weight is read
    inside this module's forward so that ZeRO-3 has gathered it.
    """

    def __init__(self, word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.weight = word_embeddings.weight  # tied: the same Parameter object
        self.bias = nn.Parameter(torch.zeros(word_embeddings.num_embeddings))

    def forward(self, hidden: Tensor, fn=None, *args, **kwargs):
        """`fn(hidden, weight, bias, *args, **kwargs)`; plain logits `hidden @ W^T + b` when fn is None."""
        if fn is None:
            return F.linear(hidden, self.weight, self.bias)
        return fn(hidden, self.weight, self.bias, *args, **kwargs)


class PredictionHeadTransform(nn.Module):
    """dense -> GELU -> LayerNorm (`cls.predictions.transform`). `in_size`: the width of the states it
    reads when it is not the hidden size (a narrower generator's head, ELECTRA's `generator_predictions`:
    dense H_G -> E). The output is always E = `cfg.embedding_width`, the tied word embeddings' width
    (H unless the embeddings are factorised: then dense H -> E and LayerNorm at E, as
    `transformers.ElectraGeneratorPredictions` with `embedding_size`)."""

    def __init__(self, cfg: EncoderConfig, in_size: Optional[int] = None) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size or cfg.hidden_size, cfg.embedding_width)
        self.LayerNorm = nn.LayerNorm(cfg.embedding_width, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.LayerNorm(F.gelu(self.dense(x)))


class MLMPredictionHead(nn.Module):
    """BERT's `cls.predictions`: transform, then the tied vocabulary projection.

    `forward(hidden_at_selected_positions, fn, ...)` applies the transform and hands the result to
    the projection with a loss function, so a `[tokens, vocab]` logits tensor is never built for
    unselected positions (and not at all with the fused kernel).
    """

    def __init__(self, cfg: EncoderConfig, word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.transform = PredictionHeadTransform(cfg)
        self.decoder = TiedVocabProjection(word_embeddings)

    def forward(self, hidden: Tensor, fn=None, *args, **kwargs):
        return self.decoder(self.transform(hidden), fn, *args, **kwargs)


class MLMHead(nn.Module):
    """`cls` in `BertForMaskedLM` (holds `predictions`)."""

    def __init__(self, cfg: EncoderConfig, word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.predictions = MLMPredictionHead(cfg, word_embeddings)

    def forward(self, hidden: Tensor, fn=None, *args, **kwargs):
        return self.predictions(hidden, fn, *args, **kwargs)
