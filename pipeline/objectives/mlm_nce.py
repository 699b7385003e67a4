"""`mlm-nce` (BERT-NCE): masked-token prediction with the softmax over sampled negatives.

InfoWord (Kong et al. 2020, Sec. 4, I_MLM and the BERT-NCE baseline of Sec. 5.1):

    L = mean_{i in M} -log( exp s_i(x_i) / (exp s_i(x_i) + sum_{v in Neg_i} exp s_i(v)) ),
    s_i(v) = E_v . T(h_i) + b_v

The negatives Neg_i replace the full vocabulary. The paper takes them from "words from other
sequences in the same batch" (Sec. 5.2: "approximately 70,000 subwords ... in a batch") and
mentions a unigram distribution (Sec. 4); *choice* `negatives` (the pool):
  - "other_sequences" (default): the non-special tokens of the *other* sequences (their original
    ids) — the batch's empirical unigram distribution, minus the anchor's own sequence;
  - "other_targets": the masked (selected) tokens of the other sequences, i.e. the positives of
    the other anchors — InfoNCE's in-batch negatives. The paper's count fits this reading: 15% of
    a batch of 1,024 x 512 tokens is ~79k, close to its "approximately 70,000 subwords";
  - "batch": the non-special tokens of the whole batch (own sequence included);
  - "uniform": the vocabulary ids that are not special tokens.
`num_negatives` K:
  - an integer (default 128): K draws per masked position, uniform over the pool of this
    micro-batch (`ctx.generator`), scored by per-row gathers;
  - "all": Neg_i = every token of the pool across the *global* batch — all ranks' current
    micro-batches, the ids all-gathered (cheap: integers; the tied weight is shared, so every
    negative gets its gradient) — each occurrence counted once ("uniform": every non-special id
    once, i.e. a full softmax without the special tokens). No sampling; scored as one shared
    [N, V] matrix over the vocabulary with log-multiplicity offsets (count 0: -inf; exact, see
    `functional.sampled_softmax_cross_entropy`; the counts are summed over the ranks by one
    all-reduce), so its cost is about a full-vocabulary MLM head.
A negative equal to the target is masked out inside the loss. The negatives per masked position
are logged (`negatives`), and on logged steps the loss at chance, `loss_chance` = mean_i
ln(1 + |Neg_i|) (every score equal; `pipeline.monitor.signals` calls the term learned at <= 0.85x it). Uses the same head as `mlm` (`cls.predictions`).

What the head learns (and why conversion corrects its bias). With negatives drawn from a
proposal q, the InfoNCE optimum is s(v, c) = log p(v | c) - log q(v) + const(c) (Oord et al.
2018, "Representation Learning with Contrastive Predictive Coding", Sec. 2.3; Ma & Collins 2018,
"Noise Contrastive Estimation and Negative Sampling for Conditional Models"); with "all" the
log-multiplicity offsets are the same log q. So s is not a masked LM's logit: its argmax favours
rare tokens. The implied masked LM is p(v | c) ∝ q(v) exp s(v, c). The sampler keeps log q as the
persistent buffer `log_proposal` [V] (float32): for the unigram pools ("other_sequences",
"other_targets", "batch", whose negatives follow the corpus unigram distribution) the add-one
smoothed, centred log frequency of the training shards (`pipeline.pretrain.build.unigram_bias`,
filled by `fill_unigram_tensors` when the run model is built); zeros for "uniform" (q constant).
It never enters the loss (the objective is the paper's); `pipeline.export` adds it to the
converted MLM head's bias when only sampled-softmax objectives trained that head, and the logged
`accuracy` is that exported masked LM's, argmax_v s(v, c) + log q(v) (`mlm.with_accuracy`).

At small scale (issue 29; docs/objectives.md#bert-nce has the numbers). At the time-to-quality
study's size (2 x 128, 300 steps x 32 x 64 tokens), started with its head's bias at log p, BERT-NCE
learned nothing at [MASK] positions (held-out loss 1.03x chance there, accuracy at the plateau).
All its gain came from copying the unchanged 10% of the selected tokens. Adam moves the bias by
about lr per step, so the encoder had to cancel the doubled frequency prior itself. Started at the
optimum log p - log q (`pipeline.pretrain.build.context_free_head_bias`), it learns at [MASK] exactly
what a full-softmax MLM learns (LM loss 6.323 vs 6.324, accuracy 0.090 vs 0.091, plateau 0.051),
with 16, 128 or "all" negatives alike. Its loss still ends near 0.91x ln(K + 1): by the InfoNCE bound
L >= ln(K + 1) - I, with I the context information MLM extracts at that budget (0.085 nats at
[MASK]), it cannot end below ~0.89x. It reaches 0.85x after ~600 steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch
from torch import Tensor, nn

from pipeline.data.batch import (IGNORE_INDEX, content_tokens, gather_selected, masked_view_keys, positions_key,
                            special_ids)
from pipeline.data.shards import SPECIAL_TOKEN_NAMES
from pipeline.distributed import all_reduce_sum
from pipeline.model.encoder import EncoderConfig
from pipeline.objectives.base import SAMPLED_SOFTMAX, Objective, StepContext, register, scalar_metric
from pipeline.objectives.mlm import with_accuracy
from pipeline.objectives.sampling import sample_from_other_groups

NEGATIVE_SOURCES = ("other_sequences", "other_targets", "batch", "uniform")
#: The state-dict name of the sampler's log q buffer (under its module's prefix).
LOG_PROPOSAL = "log_proposal"


@dataclass
class Negatives:
    """The negatives of N masked positions, in one of the two layouts of
    `functional.sampled_softmax_cross_entropy`: per row (`ids` [N, K]) or shared (`ids` [U] sorted
    distinct, `counts` [G, U], `groups` [N])."""

    ids: Tensor
    counts: Optional[Tensor] = None
    groups: Optional[Tensor] = None

    def op_args(self) -> tuple[Tensor, ...]:
        return (self.ids,) if self.counts is None else (self.ids, self.counts, self.groups)

    def sizes(self, targets: Tensor) -> Tensor:
        """|Neg_i| [N] (float32): the negatives of each position, copies of its target excluded (the
        loss masks them out), counted with multiplicity in the shared layout (the offsets log c_v
        weigh each distinct id by its count)."""
        if self.counts is None:
            return (self.ids != targets[:, None]).sum(1).float()
        total = self.counts.sum(1).float()[self.groups]  # look the target up: no [N, U] tensor
        if self.ids.numel() == 0:
            return total
        pos = torch.searchsorted(self.ids, targets).clamp(max=self.ids.numel() - 1)
        own = torch.where(self.ids[pos] == targets, self.counts[self.groups, pos].float(), torch.zeros_like(total))
        return total - own

    def per_anchor(self, targets: Tensor) -> Tensor:
        """Mean size of Neg_i over the N positions, copies of the target excluded (a metric)."""
        if targets.numel() == 0:
            return torch.zeros((), device=targets.device)
        return self.sizes(targets).mean()

    def chance_loss(self, targets: Tensor) -> Tensor:
        """The loss at chance, mean_i ln(1 + |Neg_i|): with every score equal, -log of the positive's
        share of the 1 + |Neg_i| candidates (`pipeline.monitor.signals`: "learned" at <= 0.85x this)."""
        if targets.numel() == 0:
            return torch.zeros((), device=targets.device)
        return torch.log1p(self.sizes(targets)).mean()


class NegativeTokenSampler(nn.Module):
    """Draws the negatives of N masked positions, and holds log q of its pool, `log_proposal` [V]
    (see the module docstring). A module only for that buffer: it has no parameters."""

    def __init__(self, special_tokens: Mapping[str, int], vocab_size: int, source: str, k: Union[int, str]) -> None:
        super().__init__()
        if source not in NEGATIVE_SOURCES:
            raise ValueError(f"negatives must be one of {NEGATIVE_SOURCES}, got {source!r}")
        if k != "all" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"num_negatives must be an integer >= 1 or 'all', got {k!r}")
        self.source, self.k = source, k
        special = torch.tensor(special_ids(special_tokens, SPECIAL_TOKEN_NAMES), dtype=torch.long)
        keep = torch.ones(vocab_size, dtype=torch.bool)
        keep[special[special < vocab_size]] = False
        # a (non-persistent) buffer, so it lives on the model's device: a host tensor copied to the
        # device every step would be a blocking host-to-device copy
        self.register_buffer("non_special_ids", torch.nonzero(keep).squeeze(1), persistent=False)
        # Persistent (checkpointed, so a resumed run keeps the value it started with), float32 (DeepSpeed
        # casts parameters, not buffers, to bf16/fp16): log q only ever serves the conversion.
        self.register_buffer(LOG_PROPOSAL, torch.zeros(vocab_size, dtype=torch.float32))

    @property
    def proposal(self) -> str:
        """"uniform" (q constant over the non-special ids) or "unigram" (the corpus token frequencies)."""
        return "uniform" if self.source == "uniform" else "unigram"

    @torch.no_grad()
    def set_log_proposal(self, unigram_log_q: Tensor) -> None:
        """log q from the shards' `unigram_bias` [V]: itself for the unigram pools, zeros for "uniform"."""
        if unigram_log_q.shape != self.log_proposal.shape:
            raise ValueError(f"log_proposal: got shape {tuple(unigram_log_q.shape)}, vocabulary {self.log_proposal.numel()}")
        self.log_proposal.copy_(unigram_log_q if self.proposal == "unigram" else torch.zeros_like(unigram_log_q))

    def _load_from_state_dict(self, state_dict: Mapping[str, Tensor], prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """A checkpoint written before the buffer existed still loads strictly (resume of an older run):
        the buffer then keeps the value the run model was built with (`fill_unigram_tensors`, from the
        run's shards; `pipeline.train.loop.build_run_model`)."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + LOG_PROPOSAL not in state_dict and prefix + LOG_PROPOSAL in missing_keys:
            missing_keys.remove(prefix + LOG_PROPOSAL)

    def forward(self, batch: Mapping[str, Tensor], labels: Tensor, flat_positions: Tensor,
                generator: torch.Generator) -> Negatives:
        """labels [B, L] (the view's labels); flat_positions [N] index the [B*L] flattened batch."""
        ids = batch["input_ids"]
        n, device = flat_positions.numel(), ids.device
        if self.source == "uniform":
            pool = self.non_special_ids.to(device)
            if self.k == "all":  # every non-special id once, over the whole vocabulary (static [V])
                vocab = self.log_proposal.numel()
                counts = torch.zeros(1, vocab, dtype=torch.long, device=device).index_fill_(1, pool, 1)
                return Negatives(torch.arange(vocab, device=device), counts, torch.zeros(n, dtype=torch.long, device=device))
            return Negatives(pool[torch.randint(pool.numel(), (n, self.k), generator=generator, device=device)])
        length = ids.shape[1]
        if self.source == "other_targets":  # the pool is the selected positions themselves
            pool_pos, pool_values = flat_positions, labels
        else:  # the collator's content positions; a hand-built batch finds them on the device
            pool_pos, pool_values = batch.get("content_positions"), ids
            if pool_pos is None:
                pool_pos = torch.nonzero(content_tokens(batch).reshape(-1)).squeeze(1)
        pool_ids = pool_values.reshape(-1)[pool_pos]  # row-major, so rows are sorted
        if self.k == "all":
            return self._all(pool_ids, pool_pos // length, flat_positions // length, ids.shape[0])
        if n == 0:
            return Negatives(torch.zeros(0, self.k, dtype=torch.long, device=device))
        if self.source == "batch":
            pick = torch.randint(pool_pos.numel(), (n, self.k), generator=generator, device=device)
        else:
            pick = sample_from_other_groups(pool_pos // length, flat_positions // length, ids.shape[0], self.k, generator)
        return Negatives(pool_ids[pick])

    def _all(self, pool_ids: Tensor, pool_rows: Tensor, anchor_rows: Tensor, rows: int) -> Negatives:
        """Every pool token of the global batch as a shared multiset over the whole vocabulary: ids
        [V], counts summed over the ranks (one all-reduce of a [V] vector). Static shapes: a
        `unique` over the gathered ids would size the result by the data (a device sync); an id
        that does not occur has count 0, i.e. offset log 0 = -inf, and adds nothing to the softmax."""
        vocab, device = self.log_proposal.numel(), pool_ids.device
        ones = torch.ones_like(pool_ids)
        local = torch.zeros(vocab, dtype=torch.long, device=device).scatter_add_(0, pool_ids, ones)
        total = all_reduce_sum(local.clone())
        distinct = torch.arange(vocab, device=device)
        if self.source == "batch":
            return Negatives(distinct, total[None, :], torch.zeros_like(anchor_rows))
        own = torch.zeros(rows, vocab, dtype=torch.long, device=device)
        own.index_put_((pool_rows, pool_ids), ones, accumulate=True)
        return Negatives(distinct, total[None, :] - own, anchor_rows)


def log_proposal_samplers(model: nn.Module) -> dict[str, NegativeTokenSampler]:
    """Module name -> every NCE negative sampler in `model` (the state-dict key of its log q is
    `<name>.log_proposal`)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, NegativeTokenSampler)}


@register
class MaskedLanguageModelingNCE(Objective):
    """BERT-NCE. Options: view ("masked" | "wwm_masked" | "span_masked"), negatives, num_negatives
    (an integer or "all"), track_accuracy (full-vocabulary argmax accuracy of s + log q, the implied
    masked LM's, no gradient)."""

    name = "mlm-nce"
    views = ("masked",)
    mlm_head = SAMPLED_SOFTMAX

    def __init__(
        self,
        encoder_config: EncoderConfig,
        special_tokens: Mapping[str, int],
        view: str = "masked",
        negatives: str = "other_sequences",
        num_negatives: Union[int, str] = 128,
        track_accuracy: bool = True,
    ) -> None:
        super().__init__()
        self.ids_key, self.labels_key = masked_view_keys(view)
        self.views = (view,)
        self.sampler = NegativeTokenSampler(special_tokens, encoder_config.vocab_size, negatives, num_negatives)
        self.track_accuracy = track_accuracy

    def forward(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:
        return nce_loss(ctx, self.ids_key, self.labels_key, self.sampler, self.track_accuracy, chance_key="loss_chance")


def nce_loss(
    ctx: StepContext, ids_key: str, labels_key: str, sampler: NegativeTokenSampler, track_accuracy: bool,
    chance_key: str = "nce_loss_chance",
) -> tuple[Tensor, dict[str, Tensor]]:
    """BERT-NCE on the selected positions of `ids_key` (shared by `mlm-nce` and `infoword`).

    On logged steps the metrics carry `chance_key`, the loss at chance (`Negatives.chance_loss`),
    named after the metric the caller logs the loss under plus `_chance` (the contract of
    `pipeline.monitor.signals`): `loss_chance` for `mlm-nce` (its loss is the objective's), the default
    `nce_loss_chance` for InfoWord's `nce_loss` term."""
    hidden = ctx.encode(ids_key).last_hidden
    labels = ctx.batch[labels_key]
    h_sel, targets, flat = gather_selected(hidden, labels, ctx.batch.get(positions_key(labels_key)))
    negatives = sampler(ctx.batch, labels, flat, ctx.generator)
    # the full-vocabulary accuracy pass only on the steps whose metrics are logged
    # the accuracy of the masked LM the head implies, argmax of s + log q (what conversion exports)
    op = with_accuracy(ctx.op("sampled_softmax_cross_entropy"), track_accuracy and ctx.progress.record_metrics,
                       sampler.log_proposal)
    loss, acc = ctx.head(h_sel, op, targets, *negatives.op_args())
    metrics = {
        "selected_tokens": scalar_metric(targets.numel(), hidden.device),
        "negatives": negatives.per_anchor(targets),
    }
    if acc is not None:
        metrics["accuracy"] = acc
    if ctx.progress.record_metrics:  # a metric only: no work on the steps that are not logged
        metrics[chance_key] = negatives.chance_loss(targets)
    return loss, metrics
