"""`infoword`: InfoWord = DIM n-gram contrast + BERT-NCE (Kong et al. 2020, "A Mutual Information
Maximization Perspective of Language Representation Learning", Sec. 4-5).

Input: the `span_masked` view — n-grams of n ~ N(5, 1) words (clipped to [1, 10]) masked until
15% of the sub-word tokens are covered (built by the collator; `span_index` numbers the spans).

    I_DIM: a_i = g(X^_i) = [CLS] state of sentence i with its spans masked,
           b_m = g(X_{i:j}) = [CLS] state of its masked n-gram m encoded alone as
                 [CLS] n-gram [SEP] (same encoder, original tokens, positions from 0),
           L_DIM = mean_m -log( exp(a_{s(m)} . b_m) / (exp(a_{s(m)} . b_m) + sum_{m' in S-} exp(a_{s(m)} . b_m')) )
           over the positive pairs (sentence s(m), n-gram m); S- = the n-grams of every *other*
           sentence of the global batch ("negative n-grams from other sentences", Sec. 4)
           (`sequence_contrastive_loss` with normalize=False, symmetric=False, no same-view
           terms, groups = the sentence, the other ranks' n-grams as constant extra rows).
    I_MLM: BERT-NCE on the span-masked positions (`mlm-nce`), negatives = tokens of other
           sequences of the batch (paper Sec. 5.2). Its optimal head scores are
           s(v, c) = log p(v | c) - log q(v) + const(c) (CPC, Oord et al. 2018, Sec. 2.3): the
           sampler's `log_proposal` buffer keeps log q for the conversion (see `mlm_nce`).
    L = lambda_mlm * L_NCE + lambda_dim * L_DIM      (lambda_mlm 1, lambda_dim 1.0; paper 0.4-1.0)

*Choices* (configurable):
  - `ngrams_per_sentence` k (default 1): up to k of a sentence's masked n-grams, sampled uniformly
    without replacement, are encoded; each is a positive pair with its sentence and a negative of
    every other sentence (never of its own). "all" takes every span: the paper's "approximately
    10,000 n-grams in a batch" of 1,024 sequences (Sec. 5.2) is about 10 per sentence, i.e. all of
    them at a 15% budget of 512 tokens and ~5-word spans. k = 1 keeps the n-gram encoder pass at
    one short row per sentence. Sentences without a span take no part.
  - `dim_negatives` "global" (default, the paper's batch): the n-grams of every rank's micro-batch
    are all-gathered (detached; the gradient flows through this rank's n-grams and sentences);
    "local": this micro-batch only. The negatives per pair are logged as `dim_negatives`.
  - `score` "dot" (the paper's) or "cosine" with `tau` (the dot product is divided by tau too;
    default 1.0); NCE `negatives` / `num_negatives` as in `mlm-nce`.
  - `nce_view` "span_masked" (default: I_MLM on the DIM sentence's span-masked view, one encoder pass
    for both terms) or "masked" (I_MLM on a BERT-masked view of its own, one more pass: the paper's
    I_MLM, "X^_i a sentence masked at position i", Sec. 4, with its spans "for training with I_DIM",
    Sec. 5.2).
  - `pool` "cls" (default, the paper's g: the first token's state) or "mean" (the mean of the
    view's word states, [MASK]ed spans included in the sentence, [CLS] / [SEP] / padding excluded:
    the paper's footnote 4 alternative); `center` (default false): each view's rows minus their
    micro-batch mean before scoring (`centred`).

Learning signals (logged every step, each beside its chance level): `dim_loss` against
`dim_loss_chance` = mean_m ln(1 + negatives_m), and `nce_loss` against `nce_loss_chance` =
mean_i ln(1 + |Neg_i|) (`mlm_nce.Negatives.chance`).

What was wrong at small scale (issue 29; measured at the time-to-quality study's size, 2 x 128,
300 steps x 32 x 64 tokens, vocabulary 4,096; docs/objectives.md#infoword has every number):
  1. [CLS] carries nothing for DIM. At initialisation the [CLS] state is one vector for every
     input (mean cosine between sentences 1.000; DIM scores 128.0 with a spread of 0.02 across a
     row), nothing but DIM trains it (no NSP; NCE reads masked positions only), and DIM's gradient
     is proportional to that spread: DIM stays at ln 32 (3.43 at step 300; DIM alone reaches only
     0.87 x chance after 900 steps). Mean pooling (footnote 4) reads states that NCE trains and that
     carry the words from the start; centring removes the component every row shares (cosine 0.98
     between unrelated sentences' means), which otherwise adds a per-n-gram offset to all scores.
  2. Every span [MASK]ed leaves the final states of visible tokens trained by nothing: they drift
     to one vector (held-out token cosine 0.99 with DIM off, 0.92 with it) and NCE stays at chance.
     SpanBERT's per-span 80/10/10 (the masking the paper's spans follow) trains them through the
     unchanged spans (BERT's reason for keeping 10% unchanged): cosine 0.12.
  3. `model.mlm_bias_init=unigram` started the NCE head at log p, twice the frequency its optimum
     log p - log q holds (`pipeline.pretrain.build.context_free_head_bias`): NCE started at 4.39.
  4. NCE learned nothing from context (held-out accuracy at [MASK] 0.048, plateau 0.051; its loss at
     [MASK] 1.004x chance): on the span view even a full softmax learns nothing at [MASK] in 300
     steps (0.059, its LM loss above the unigram entropy), and DIM at weight 1 puts 8-15x NCE's
     gradient on the encoder, nearly orthogonal to it (cosine ~0.01), so Adam's per-parameter scale,
     set by DIM's gradient, shrinks NCE's steps by that factor: NCE on a BERT-masked view of its own
     still scored 0.047 at weight 1 and 0.051 at 0.25, and 0.070 at 0.1 (docs/objectives.md#bert-nce).
The small-scale recipe (`tiny-infoword`: pool mean, center, cosine / 0.1, every n-gram, 80/10/10,
nce_view masked, lambda_dim 0.1) is a deviation from the paper's [CLS] / dot / [MASK] recipe, which
`infoword-base` keeps.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Union

import numpy as np
import torch
from torch import Tensor

from pipeline.data.batch import content_tokens, masked_view_keys
from pipeline.data.corruption import span_widths
from pipeline.distributed import all_gather_row_blocks, split_own_block
from pipeline.model.encoder import EncoderConfig
from pipeline.objectives.base import SAMPLED_SOFTMAX, Objective, StepContext, register, scalar_metric
from pipeline.objectives.mlm_nce import NegativeTokenSampler, nce_loss
from pipeline.objectives.sampling import sample_per_row

SCORES = ("dot", "cosine")
DIM_NEGATIVES = ("global", "local")
#: What stands for a view in I_DIM: its first token's ([CLS]) state (the paper's g_w, Sec. 4) or the mean
#: of its words' states (the paper's footnote 4 alternative).
POOLS = ("cls", "mean")
#: The view I_MLM (BERT-NCE) reads: the DIM sentence's span-masked view (one encoder pass for both terms), or
#: a BERT-masked view of its own (the paper's I_MLM, "a sentence masked at position i", Sec. 4; one more pass).
NCE_VIEWS = ("span_masked", "masked")


def pooled_states(hidden: Tensor, words: Tensor, pool: str) -> Tensor:
    """A view's representation in I_DIM: [B, H] from hidden [B, L, H] and words [B, L] (bool, the
    positions that are words of the view: not [CLS] / [SEP] / padding).

        cls:  g(X) = h_0                                     (Kong et al. 2020, Sec. 4)
        mean: g(X) = sum_t words_t h_t / max(1, sum_t words_t)   (Sec. 4, footnote 4)
    """
    if pool == "cls":
        return hidden[:, 0]
    weight = words.to(hidden.dtype)[..., None]
    return (hidden * weight).sum(1) / weight.sum(1).clamp(min=1)


def centred(rows: Tensor) -> Tensor:
    """rows - their mean over the rows (float32): what tells this micro-batch's rows of one view apart.
    Every row of a view shares a large common component at this project's small sizes (the mean-pooled
    states of two unrelated sentences have cosine ~0.98 at initialisation); left in, its projection on
    each n-gram adds a per-n-gram offset to every score that says nothing about the pair. A single row
    centres to 0 (all its scores equal: the loss is ln(1 + negatives) and gives no gradient)."""
    rows = rows.float()
    return rows - rows.mean(0, keepdim=True) if rows.shape[0] else rows


def dim_contrastive_loss(
    op: Callable[..., Tensor], sentences: Tensor, ngrams: Tensor, owner: Tensor, tau: float, normalize: bool,
    gather: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """L_DIM over the pairs (sentences[owner[m]], ngrams[m]), the mean number of negatives per pair,
    and the loss at chance, mean_m ln(1 + negatives_m) (every score equal: what L_DIM is until the
    representations tell pairs apart; the learning signal is L_DIM against it).

    sentences [S, H] (the span-masked [CLS] states), ngrams [M, H] (the n-grams' [CLS] states),
    owner [M] (each n-gram's sentence). Negatives of pair m: the n-grams of the other sentences of
    this micro-batch and, with `gather`, every n-gram of the other ranks (constants). A collective
    when `gather`: every rank must call it, also with M = 0.
    """
    remote = None
    if gather:
        remote = split_own_block(all_gather_row_blocks(ngrams.detach().float()))[1]
        remote = remote if remote.shape[0] else None
    # pairs per sentence by a scatter into S slots (static; `bincount` sizes its output by the data)
    same = torch.zeros(sentences.shape[0], dtype=owner.dtype, device=owner.device).scatter_add_(
        0, owner, torch.ones_like(owner))[owner]
    per_pair = owner.shape[0] - same + (0 if remote is None else remote.shape[0])
    loss = op(sentences[owner], ngrams, tau, remote, normalize=normalize, symmetric=False,
              same_view_negatives=False, groups=owner)
    if not per_pair.numel():
        zero = torch.zeros((), device=ngrams.device)
        return loss, zero, zero
    per_pair = per_pair.float()
    return loss, per_pair.mean(), torch.log1p(per_pair).mean()


#: n-gram inputs are padded to a multiple of this width: a few shapes for the compiled encoder,
#: not one per longest span (padding is masked, so the [CLS] state does not depend on it)
NGRAM_WIDTH_BUCKET = 8


def ngram_width(widths: np.ndarray, length: int) -> int:
    """Width of the [CLS] n-gram [SEP] rows of a batch of `length` columns whose host span widths
    are `widths` [B, S]: longest span + 2, rounded up to `NGRAM_WIDTH_BUCKET`, at most `length` (a
    span lies inside [CLS] ... [SEP], so longest + 2 <= length; position embeddings cover `length`)."""
    longest = int(widths.max()) if widths.size else 0
    return min(-(-(longest + 2) // NGRAM_WIDTH_BUCKET) * NGRAM_WIDTH_BUCKET, max(length, longest + 2))


def host_span_widths(batch: Mapping[str, Tensor]) -> np.ndarray:
    """The [B, S] span widths as host numbers: the collator's `span_widths` (a host key, so the sizes
    need no device read), else computed from `span_index` (read from the device: one sync). A
    `span_widths` that is not on the CPU (a batch moved to the device key by key, host keys included)
    is not trusted to be readable on the host: it is computed again from `span_index` like a
    hand-built batch's, instead of failing on `.numpy()` of a device tensor."""
    host = batch.get("span_widths")
    if host is not None and host.device.type == "cpu":
        return host.numpy()  # numpy: host numbers stay host numbers
    return span_widths(batch["span_index"].cpu().numpy())


def ngram_seqlens(widths: np.ndarray) -> Tensor:
    """[P] int64 host tensor: the real tokens of each [CLS] n-gram [SEP] row when every span of every
    row is encoded, in the row-major (sentence, span) order of the pairs (`nonzero_known`): the
    widths of the present spans (`widths > 0`, spans are numbered 0, 1, ... in each row) plus 2.
    With it the encoder can run the n-gram pass unpadded (`pipeline.model.attention`): about
    width / (mean span + 2) fewer tokens than the bucketed padded rows, and one flash kernel for every
    batch's shape instead of a masked pass whose shape changes every micro-batch."""
    return torch.from_numpy(np.ascontiguousarray(widths[widths > 0] + 2, dtype=np.int64))


def build_ngram_inputs(
    input_ids: Tensor, span_index: Tensor, chosen_span: Tensor, cls_id: int, sep_id: int, pad_id: int,
    width: Optional[int] = None,
) -> tuple[Tensor, Tensor]:
    """[CLS] n-gram [SEP] inputs, one row per sentence, left-aligned and padded.

    input_ids, span_index [B, L]; chosen_span [B] (the span number to extract for each row; every
    row must contain it, as one contiguous run, which the collator's spans are). `width`: the
    output width (>= its longest n-gram + 2, e.g. `ngram_width` of the batch's host `span_widths`);
    None reads the longest chosen n-gram from the device (a host sync). Static shapes otherwise:
    each n-gram is a gather from its first column. Returns (ids [B, width], attention_mask [B, width]).
    """
    in_span = span_index == chosen_span[:, None]  # [B, L]
    lengths = in_span.sum(1)
    if width is None:
        width = int(lengths.max().item()) + 2 if lengths.numel() else 2
    first = in_span.long().argmax(1)  # the first column of the span
    offsets = torch.arange(width - 2, device=input_ids.device)[None, :]
    source = (first[:, None] + offsets).clamp(max=input_ids.shape[1] - 1)
    body = torch.where(offsets < lengths[:, None], input_ids.gather(1, source), pad_id)
    positions = torch.arange(width, device=input_ids.device)[None, :]
    ids = torch.cat([torch.full_like(body[:, :1], cls_id), body, torch.full_like(body[:, :2], pad_id)], 1)[:, :width]
    ids = torch.where(positions == (lengths + 1)[:, None], sep_id, ids)
    mask = (positions <= (lengths + 1)[:, None]).long()
    return ids, mask


def nonzero_known(mask: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """(rows, cols) of the True entries of `mask` [B, C] in row-major order, when the host knows
    how many there are (`count`): a stable sort instead of `nonzero`, which would ask the device."""
    order = torch.argsort((~mask).reshape(-1).to(torch.uint8), stable=True)[:count]
    return order // mask.shape[1], order % mask.shape[1]


@register
class InfoWord(Objective):
    """InfoWord (see the module docstring). Options: lambda_mlm, lambda_dim, score, tau,
    ngrams_per_sentence, dim_negatives, negatives, num_negatives, track_accuracy, pool, center, nce_view."""

    name = "infoword"
    views = ("span_masked",)
    mlm_head = SAMPLED_SOFTMAX  # I_MLM is BERT-NCE (log q: `mlm_nce`)

    def __init__(
        self,
        encoder_config: EncoderConfig,
        special_tokens: Mapping[str, int],
        lambda_mlm: float = 1.0,
        lambda_dim: float = 1.0,
        score: str = "dot",
        tau: float = 1.0,
        ngrams_per_sentence: Union[int, str] = 1,
        dim_negatives: str = "global",
        negatives: str = "other_sequences",
        num_negatives: Union[int, str] = 128,
        track_accuracy: bool = True,
        pool: str = "cls",
        center: bool = False,
        nce_view: str = "span_masked",
    ) -> None:
        super().__init__()
        if nce_view not in NCE_VIEWS:
            raise ValueError(f"nce_view must be one of {NCE_VIEWS}, got {nce_view!r}")
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        if not isinstance(center, bool):
            raise ValueError(f"center must be true or false, got {center!r}")
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        if tau <= 0:
            raise ValueError(f"tau must be positive, got {tau}")
        k = ngrams_per_sentence
        if k != "all" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"ngrams_per_sentence must be an integer >= 1 or 'all', got {ngrams_per_sentence!r}")
        if dim_negatives not in DIM_NEGATIVES:
            raise ValueError(f"dim_negatives must be one of {DIM_NEGATIVES}, got {dim_negatives!r}")
        for key in ("cls", "sep", "pad"):
            if key not in special_tokens:
                raise ValueError(f"special_tokens: infoword needs the {key!r} token id")
        self.lambda_mlm, self.lambda_dim, self.score, self.tau = lambda_mlm, lambda_dim, score, tau
        self.ngrams_per_sentence, self.dim_negatives = ngrams_per_sentence, dim_negatives
        self.special = dict(special_tokens)
        self.sampler = NegativeTokenSampler(special_tokens, encoder_config.vocab_size, negatives, num_negatives)
        self.track_accuracy = track_accuracy
        self.pool, self.center = pool, center
        # the collator builds exactly the views the objectives name: a second (BERT-masked) view only when NCE reads it
        self.nce_keys = masked_view_keys(nce_view, NCE_VIEWS)
        self.views = tuple(dict.fromkeys(("span_masked", nce_view)))

    def dim_loss(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:
        """(L_DIM, metrics: sentences and pairs taking part, negatives per pair, the loss at chance)."""
        span_index = ctx.batch["span_index"]
        # the words of the masked sentence: its [MASK]ed spans included (they are part of the view)
        sentence = pooled_states(ctx.encode("span_masked_ids").last_hidden, content_tokens(ctx.batch), self.pool)
        widths = host_span_widths(ctx.batch)
        num_spans = widths.shape[1]
        present = torch.zeros(span_index.shape[0], num_spans + 1, dtype=torch.bool, device=span_index.device)
        present.scatter_(1, span_index.clamp(min=-1) + 1, True)  # column 0 collects "no span"
        k = num_spans if self.ngrams_per_sentence == "all" else self.ngrams_per_sentence
        chosen = sample_per_row(present[:, 1:], k, ctx.generator) if num_spans > 0 else present[:, 1:]
        spans_per_row = (widths > 0).sum(1)
        pairs = int(np.minimum(spans_per_row, k).sum())  # host numbers: min(k, spans) per sentence
        owner, span = nonzero_known(chosen, pairs)  # pairs, row-major
        if pairs:
            ids, mask = build_ngram_inputs(
                ctx.batch["input_ids"][owner], span_index[owner], span,
                self.special["cls"], self.special["sep"], self.special["pad"], ngram_width(widths, span_index.shape[1]),
            )
            words = mask.bool() & (ids != self.special["cls"]) & (ids != self.special["sep"])
            # every span taken: the host knows each n-gram row's length, so the pass can be unpadded
            seqlens = ngram_seqlens(widths) if k >= num_spans else None
            ngram = pooled_states(ctx.encoder(ids, mask, seqlens=seqlens).last_hidden, words, self.pool)
        else:  # no span anywhere: an empty (graph-connected) pair list; other ranks may still gather
            ngram = sentence[:0]
        if self.center:  # before the gather: other ranks' n-grams arrive centred on their own micro-batch
            sentence, ngram = centred(sentence), centred(ngram)
        loss, negatives, chance = dim_contrastive_loss(
            ctx.op("sequence_contrastive_loss"), sentence, ngram, owner, self.tau, self.score == "cosine",
            self.dim_negatives == "global",
        )
        device = sentence.device
        metrics = {
            "dim_sentences": scalar_metric(int((spans_per_row > 0).sum()), device),
            "dim_pairs": scalar_metric(owner.numel(), device),
            "dim_negatives": negatives,
            "dim_loss_chance": chance,
        }
        return loss, metrics

    def forward(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:
        mlm, metrics = nce_loss(ctx, *self.nce_keys, self.sampler, self.track_accuracy)
        dim, dim_metrics = self.dim_loss(ctx)
        metrics.update(nce_loss=mlm.detach(), dim_loss=dim.detach(), **dim_metrics)
        return self.lambda_mlm * mlm + self.lambda_dim * dim, metrics
