"""`infoword`: InfoWord = DIM n-gram contrast + BERT-NCE (Kong et al. 2020, "A Mutual Information
Maximization Perspective of Language Representation Learning", Sec. 4-5).

Input: the `span_masked` view — n-grams of n ~ N(5, 1) words (clipped to [1, 10]) masked until
15% of the sub-word tokens are covered (built by the collator; `span_index` numbers the spans).

    I_DIM: a_i = g(X^_i) = [CLS] state of sentence i with its spans masked,
           b_i = g(X_{i:j}) = [CLS] state of one of its masked n-grams encoded alone as
                 [CLS] n-gram [SEP] (same encoder, original tokens, positions from 0),
           L_DIM = mean_i -log( exp(a_i . b_i) / sum_j exp(a_i . b_j) )
           with the n-grams b_j of the other sentences of the micro-batch as negatives
           (`sequence_contrastive_loss` with normalize=False, symmetric=False, no same-view terms).
    I_MLM: BERT-NCE on the span-masked positions (`mlm-nce`), negatives = tokens of other
           sequences of the micro-batch (paper Sec. 5.2).
    L = lambda_mlm * L_NCE + lambda_dim * L_DIM      (lambda_mlm 1, lambda_dim 1.0; paper 0.4-1.0)

*Choices* (configurable): one n-gram per sentence, sampled uniformly among its spans
(sentences without a span take no part in DIM); `score` "dot" (the paper's) or "cosine" with
`tau` (the dot product is divided by tau too; default 1.0); NCE `negatives` / `num_negatives`
as in `mlm-nce`.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from pipeline.model.encoder import EncoderConfig
from pipeline.objectives.base import Objective, StepContext, register, scalar_metric
from pipeline.objectives.mlm_nce import NegativeTokenSampler, nce_loss
from pipeline.objectives.sampling import sample_one_per_row

SCORES = ("dot", "cosine")


def build_ngram_inputs(
    input_ids: Tensor, span_index: Tensor, chosen_span: Tensor, cls_id: int, sep_id: int, pad_id: int
) -> tuple[Tensor, Tensor]:
    """[CLS] n-gram [SEP] inputs, one row per sentence, left-aligned and padded.

    input_ids, span_index [B, L]; chosen_span [B] (the span number to extract for each row; every
    row must contain it). Returns (ids [B, 2 + longest], attention_mask [B, 2 + longest]).
    """
    in_span = span_index == chosen_span[:, None]  # [B, L]
    lengths = in_span.sum(1)
    width = int(lengths.max().item()) + 2 if lengths.numel() else 2
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    ids = torch.full((input_ids.shape[0], width), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, 0] = cls_id
    r, c = torch.nonzero(in_span, as_tuple=True)  # row-major: columns ascending within a row
    rank = torch.cumsum(in_span.long(), dim=1)[r, c]  # 1-based position inside the n-gram
    ids[r, rank] = input_ids[r, c]
    ids[rows, lengths + 1] = sep_id
    positions = torch.arange(width, device=input_ids.device)[None, :]
    mask = (positions <= (lengths + 1)[:, None]).long()
    return ids, mask


@register
class InfoWord(Objective):
    """InfoWord (see the module docstring). Options: lambda_mlm, lambda_dim, score, tau,
    negatives, num_negatives, track_accuracy."""

    name = "infoword"
    views = ("span_masked",)

    def __init__(
        self,
        encoder_config: EncoderConfig,
        special_tokens: Mapping[str, int],
        lambda_mlm: float = 1.0,
        lambda_dim: float = 1.0,
        score: str = "dot",
        tau: float = 1.0,
        negatives: str = "other_sequences",
        num_negatives: int = 128,
        track_accuracy: bool = True,
    ) -> None:
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        if tau <= 0:
            raise ValueError(f"tau must be positive, got {tau}")
        for key in ("cls", "sep", "pad"):
            if key not in special_tokens:
                raise ValueError(f"special_tokens: infoword needs the {key!r} token id")
        self.lambda_mlm, self.lambda_dim, self.score, self.tau = lambda_mlm, lambda_dim, score, tau
        self.special = dict(special_tokens)
        self.sampler = NegativeTokenSampler(special_tokens, encoder_config.vocab_size, negatives, num_negatives)
        self.track_accuracy = track_accuracy

    def dim_loss(self, ctx: StepContext) -> tuple[Tensor, Tensor]:
        """(L_DIM, number of sentences taking part)."""
        span_index = ctx.batch["span_index"]
        sentence = ctx.encode("span_masked_ids").last_hidden[:, 0]
        num_spans = int(span_index.max().item()) + 1 if span_index.numel() else 0
        if num_spans <= 0:
            return sentence.float().sum() * 0.0, torch.zeros((), device=sentence.device)
        present = torch.zeros(span_index.shape[0], num_spans + 1, dtype=torch.bool, device=span_index.device)
        present.scatter_(1, span_index.clamp(min=-1) + 1, True)  # column 0 collects "no span"
        chosen, has_span = sample_one_per_row(present[:, 1:], ctx.generator)
        rows = torch.nonzero(has_span).squeeze(1)
        ids, mask = build_ngram_inputs(
            ctx.batch["input_ids"][rows], span_index[rows], chosen[rows],
            self.special["cls"], self.special["sep"], self.special["pad"],
        )
        ngram = ctx.encoder(ids, mask).last_hidden[:, 0]
        loss = ctx.op("sequence_contrastive_loss")(
            sentence[rows], ngram, self.tau, None,
            normalize=self.score == "cosine", symmetric=False, same_view_negatives=False,
        )
        return loss, scalar_metric(rows.numel(), sentence.device)

    def forward(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:
        mlm, metrics = nce_loss(ctx, "span_masked_ids", "span_labels", self.sampler, self.track_accuracy)
        dim, pairs = self.dim_loss(ctx)
        metrics.update(nce_loss=mlm.detach(), dim_loss=dim.detach(), dim_sentences=pairs)
        return self.lambda_mlm * mlm + self.lambda_dim * dim, metrics
