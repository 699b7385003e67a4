"""`mlm-nce` (BERT-NCE): masked-token prediction with the softmax over sampled negatives.

InfoWord (Kong et al. 2020, Sec. 4, I_MLM and the BERT-NCE baseline of Sec. 5.1):

    L = mean_{i in M} -log( exp s_i(x_i) / (exp s_i(x_i) + sum_k exp s_i(v_ik)) ),
    s_i(v) = E_v . T(h_i) + b_v

The negatives v_ik replace the full vocabulary. The paper takes them from "words from other
sequences in the same batch" (Sec. 5.2) and mentions a unigram distribution (Sec. 4); *choice*
`negatives`:
  - "other_sequences" (default): uniform over the non-special tokens of the *other* sequences of
    the micro-batch (their original ids) — the batch's empirical unigram distribution, minus the
    anchor's own sequence;
  - "batch": uniform over the non-special tokens of the whole micro-batch (own sequence included);
  - "uniform": uniform over the vocabulary ids that are not special tokens.
A negative equal to the target is masked out inside the loss (see `functional`).
`num_negatives` K defaults to 128 (the paper uses all ~70k batch tokens; K bounds the
[N, K+1, H] gather of the torch reference). Uses the same head as `mlm` (`cls.predictions`).
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from pipeline.batch import content_tokens, gather_selected, masked_view_keys, positions_key, special_ids
from pipeline.data.shards import SPECIAL_TOKEN_NAMES
from pipeline.model.encoder import EncoderConfig
from pipeline.objectives.base import Objective, StepContext, register, scalar_metric
from pipeline.objectives.mlm import with_accuracy
from pipeline.objectives.sampling import sample_from_other_rows

NEGATIVE_SOURCES = ("other_sequences", "batch", "uniform")


class NegativeTokenSampler:
    """Draws [N, K] negative token ids for N masked positions (see the module docstring)."""

    def __init__(self, special_tokens: Mapping[str, int], vocab_size: int, source: str, k: int) -> None:
        if source not in NEGATIVE_SOURCES:
            raise ValueError(f"negatives must be one of {NEGATIVE_SOURCES}, got {source!r}")
        if k < 1:
            raise ValueError(f"num_negatives must be >= 1, got {k}")
        self.source, self.k = source, k
        special = torch.tensor(special_ids(special_tokens, SPECIAL_TOKEN_NAMES), dtype=torch.long)
        keep = torch.ones(vocab_size, dtype=torch.bool)
        keep[special[special < vocab_size]] = False
        self.non_special_ids = torch.nonzero(keep).squeeze(1)

    def __call__(self, batch: Mapping[str, Tensor], flat_positions: Tensor, generator: torch.Generator) -> Tensor:
        """flat_positions [N] index the [B*L] flattened batch; returns negative ids [N, K]."""
        ids = batch["input_ids"]
        n, device = flat_positions.numel(), ids.device
        if self.source == "uniform":
            pool = self.non_special_ids.to(device)
            pick = torch.randint(pool.numel(), (n, self.k), generator=generator, device=device)
            return pool[pick]
        eligible = content_tokens(batch).reshape(-1)
        pool_pos = torch.nonzero(eligible).squeeze(1)  # row-major, so rows are sorted
        pool_ids = ids.reshape(-1)[pool_pos]
        if self.source == "batch":
            pick = torch.randint(pool_pos.numel(), (n, self.k), generator=generator, device=device)
        else:
            length = ids.shape[1]
            pick = sample_from_other_rows(pool_pos // length, flat_positions // length, ids.shape[0], self.k, generator)
        return pool_ids[pick]


@register
class MaskedLanguageModelingNCE(Objective):
    """BERT-NCE. Options: view ("masked" | "wwm_masked" | "span_masked"), negatives, num_negatives,
    track_accuracy (full-vocabulary argmax accuracy, no gradient)."""

    name = "mlm-nce"
    views = ("masked",)

    def __init__(
        self,
        encoder_config: EncoderConfig,
        special_tokens: Mapping[str, int],
        view: str = "masked",
        negatives: str = "other_sequences",
        num_negatives: int = 128,
        track_accuracy: bool = True,
    ) -> None:
        super().__init__()
        self.ids_key, self.labels_key = masked_view_keys(view)
        self.views = (view,)
        self.sampler = NegativeTokenSampler(special_tokens, encoder_config.vocab_size, negatives, num_negatives)
        self.track_accuracy = track_accuracy

    def forward(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:
        return nce_loss(ctx, self.ids_key, self.labels_key, self.sampler, self.track_accuracy)


def nce_loss(
    ctx: StepContext, ids_key: str, labels_key: str, sampler: NegativeTokenSampler, track_accuracy: bool
) -> tuple[Tensor, dict[str, Tensor]]:
    """BERT-NCE on the selected positions of `ids_key` (shared by `mlm-nce` and `infoword`)."""
    hidden = ctx.encode(ids_key).last_hidden
    h_sel, targets, flat = gather_selected(hidden, ctx.batch[labels_key], ctx.batch.get(positions_key(labels_key)))
    negative_ids = sampler(ctx.batch, flat, ctx.generator)
    op = with_accuracy(ctx.op("sampled_softmax_cross_entropy"), track_accuracy)
    loss, acc = ctx.head(h_sel, op, targets, negative_ids)
    metrics = {"selected_tokens": scalar_metric(targets.numel(), hidden.device)}
    if acc is not None:
        metrics["accuracy"] = acc
    return loss, metrics
