"""Loss functions of every objective, as pure functions of explicit tensors (the torch reference).

Each function receives everything it needs — hidden states, the (tied) weight, and every sampled
index (positives, negatives, replacements) — so it can be tested exactly against a loop written
from the paper, and swapped for a fused Triton kernel with the same signature
(`pipeline.kernels.get_op`). Sampling happens in the objective modules, never here.

Numerics: whatever the input dtype (bf16/fp16 under autocast), all logits, normalisations and
log-sum-exps are computed in float32 with autocast switched off, and the result is a float32
scalar. Contrastive logits at tau 0.05 reach |20|; `exp` of that overflows fp16, so nothing here
exponentiates without subtracting a max (`logsumexp` / `log_softmax`).

Empty inputs (no selected rows) give a zero that is still connected to the graph, so the
backward pass (and DeepSpeed's) works on a micro-batch that happens to select nothing.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "linear_cross_entropy",
    "linear_cross_entropy_with_accuracy",
    "sampled_softmax_cross_entropy",
    "corrective_lm_loss",
    "copy_loss",
    "replaced_token_detection_loss",
    "token_contrastive_loss",
    "sequence_contrastive_loss",
    "adaptive_temperature",
    "prediction_accuracy",
    "binary_auc",
]

_F = TypeVar("_F", bound=Callable[..., Tensor])

#: Reductions of the contrastive losses that offer one (`sequence_contrastive_loss`).
REDUCTIONS = ("mean", "sum")

#: Upper clamp of COCO-LM's copy probability inside the LM mixture: a saturated copy head
#: (sigmoid == 1.0 in fp32 for logits > ~17) would otherwise give log(0) for non-copied targets.
COPY_PROB_MAX = 1.0 - 1e-6


def _fp32_math(fn: _F) -> _F:
    """Run `fn` with autocast disabled on the device of its first tensor argument."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = next((a for a in args if isinstance(a, Tensor)), None)
        device_type = first.device.type if first is not None else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _mean_or_zero(values: Tensor, count: Tensor | int) -> Tensor:
    """sum(values) / max(count, 1): the mean, or a graph-connected 0 when nothing was selected."""
    if isinstance(count, Tensor):
        count = count.clamp(min=1)
    else:
        count = max(count, 1)
    return values.sum() / count


def _logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


@_fp32_math
def fp32_logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """`hidden @ weight^T + bias` in float32 with autocast off (for sampling and metrics, not losses)."""
    return _logits(hidden, weight, bias)


@_fp32_math
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    ignore_index: int = -100,
) -> Tensor:
    """Masked-LM cross-entropy at selected positions (BERT, Devlin et al. 2019).

        L = mean_{n : t_n != ignore_index} -log softmax(W h_n + b)_{t_n}

    hidden [N, H] are the (head-transformed) states of the selected positions only, weight [V, H]
    the tied word embeddings, bias [V], targets [N] int64. Logits are fp32 [N, V] for these N rows
    only. Returns 0 (graph-connected) when every row is ignored.
    """
    return _cross_entropy_and_logits(hidden, weight, bias, targets, ignore_index)[0]


def _cross_entropy_and_logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                              ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """(mean cross-entropy over counted rows, fp32 logits [N, V], counted-row mask [N])."""
    logits = _logits(hidden, weight, bias)
    keep = targets != ignore_index
    losses = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")
    return _mean_or_zero(losses, keep.sum()), logits, keep


@_fp32_math
def linear_cross_entropy_with_accuracy(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    ignore_index: int = -100,
) -> tuple[Tensor, Tensor]:
    """`linear_cross_entropy` plus, from the same logits, MLM accuracy (a metric, no gradient):

        acc = |{n counted : argmax_v (W h_n + b)_v = t_n}| / max(#counted, 1)

    argmax takes the first maximum, as `torch.argmax`. No second vocabulary projection is made.
    """
    loss, logits, keep = _cross_entropy_and_logits(hidden, weight, bias, targets, ignore_index)
    with torch.no_grad():
        correct = ((logits.argmax(-1) == targets) & keep).sum()
        accuracy = correct.float() / keep.sum().clamp(min=1).float()
    return loss, accuracy


@_fp32_math
def sampled_softmax_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    negative_ids: Tensor,
    negative_counts: Optional[Tensor] = None,
    anchor_groups: Optional[Tensor] = None,
) -> Tensor:
    """BERT-NCE: MLM with the softmax over the target and sampled negatives (InfoWord, Kong et al.
    2020, Sec. 4 "I_MLM"; the sampled-softmax form of noise-contrastive MLM).

        s_n(v) = w_v . h_n + b_v
        L = mean_n -log( exp s_n(t_n) / (exp s_n(t_n) + sum_{v in Neg_n} [v != t_n] exp s_n(v)) )

    Neg_n is a multiset of token ids, given in one of two layouts:
      * per row: negative_ids [N, K] — Neg_n = row n (K draws; repeats count);
      * shared: negative_ids [U], negative_counts [G, U] >= 0 and anchor_groups [N] in [0, G) —
        Neg_n holds id u_k negative_counts[g_n, k] times (a repeated id adds up). "Every token of the other
        sequences" is then one [N, U] score matrix (U <= V distinct ids) instead of an
        [N, K, H] gather over hundreds of thousands of occurrences:
        sum_{v in Neg_n} e^{s(v)} = sum_k c_{g_n k} e^{s(u_k)} = sum_k e^{s(u_k) + log c_{g_n k}}.
    hidden [N, H], weight [V, H], bias [V] or None, targets [N]. A negative equal to its row's
    target is masked out (score -inf): it is the positive itself, and counting it would push the
    target's own score down. Never builds [N, V] scores (per row: [N, K+1]; shared: [N, U+1]).
    """
    if negative_counts is not None or negative_ids.dim() == 1:
        return _shared_negatives_xent(hidden, weight, bias, targets, negative_ids, negative_counts, anchor_groups)
    candidates = torch.cat([targets[:, None], negative_ids], dim=1)  # [N, K+1], column 0 = target
    w = weight.float()[candidates]  # [N, K+1, H]
    scores = torch.einsum("nh,nkh->nk", hidden.float(), w)
    if bias is not None:
        scores = scores + bias.float()[candidates]
    duplicate = torch.cat([torch.zeros_like(targets[:, None], dtype=torch.bool), negative_ids == targets[:, None]], 1)
    scores = scores.masked_fill(duplicate, float("-inf"))
    losses = torch.logsumexp(scores, dim=1) - scores[:, 0]
    return _mean_or_zero(losses, targets.shape[0])


def check_shared_negatives(targets: Tensor, negative_ids: Tensor, negative_counts: Optional[Tensor],
                           anchor_groups: Optional[Tensor]) -> None:
    """Shapes of the shared layout of `sampled_softmax_cross_entropy` (shared with the kernel)."""
    if negative_ids.dim() != 1 or negative_counts is None or anchor_groups is None:
        raise ValueError("sampled_softmax_cross_entropy: the shared layout needs negative_ids [U], "
                         "negative_counts [G, U] and anchor_groups [N]")
    if negative_counts.dim() != 2 or negative_counts.shape[1] != negative_ids.shape[0]:
        raise ValueError(f"sampled_softmax_cross_entropy: negative_counts must be [G, {negative_ids.shape[0]}], "
                         f"got {tuple(negative_counts.shape)}")
    if anchor_groups.shape != targets.shape:
        raise ValueError(f"sampled_softmax_cross_entropy: anchor_groups must be [{targets.shape[0]}], "
                         f"got {tuple(anchor_groups.shape)}")


def shared_negative_offsets(targets: Tensor, negative_ids: Tensor, negative_counts: Tensor,
                            anchor_groups: Tensor) -> Tensor:
    """[N, U] fp32 log c_{g_n k}: -inf where the count is 0 or u_k is the row's own target."""
    log_counts = torch.log(negative_counts.float())[anchor_groups]  # log 0 = -inf
    return log_counts.masked_fill(negative_ids[None, :] == targets[:, None], float("-inf"))


def _shared_negatives_xent(hidden, weight, bias, targets, negative_ids, negative_counts, anchor_groups) -> Tensor:
    check_shared_negatives(targets, negative_ids, negative_counts, anchor_groups)
    h = hidden.float()
    w_t, w_u = weight.float()[targets], weight.float()[negative_ids]
    positive = (h * w_t).sum(-1, keepdim=True)  # [N, 1]
    negatives = h @ w_u.T  # [N, U]
    if bias is not None:
        positive = positive + bias.float()[targets][:, None]
        negatives = negatives + bias.float()[negative_ids][None, :]
    offsets = shared_negative_offsets(targets, negative_ids, negative_counts, anchor_groups)
    scores = torch.cat([positive, negatives + offsets], 1)
    losses = torch.logsumexp(scores, dim=1) - scores[:, 0]
    return _mean_or_zero(losses, targets.shape[0])


@_fp32_math
def corrective_lm_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    copy_prob: Tensor,
    corrupted_ids: Tensor,
    targets: Tensor,
) -> Tensor:
    """COCO-LM corrective LM, the LM part (Meng et al. 2021, Sec. 3.1, "Corrective Language Modeling").

        p_LM(t | h_n) = 1[t == x^MLM_n] * sg(p_copy_n) + (1 - sg(p_copy_n)) * softmax(W h_n + b)_t
        L = mean_n -log p_LM(x^orig_n | h_n)

    hidden [N, H] (head-transformed states at the masked positions), weight [V, H] tied embeddings,
    copy_prob [N] = sigmoid(copy head) (stop-gradient is applied here), corrupted_ids [N] = x^MLM,
    targets [N] = x^orig. Computed in log space:
    log p = logaddexp(log p_copy if t == x^MLM else -inf, log(1 - p_copy) + log_softmax_t), with
    p_copy clamped to at most `COPY_PROB_MAX` so a saturated copy head cannot give log(0).
    """
    log_probs = F.log_softmax(_logits(hidden, weight, bias), dim=-1)
    lm_term = log_probs.gather(1, targets[:, None]).squeeze(1)
    p_copy = copy_prob.detach().float().clamp(0.0, COPY_PROB_MAX)
    copy_term = torch.where(corrupted_ids == targets, torch.log(p_copy), torch.full_like(p_copy, float("-inf")))
    log_p = torch.logaddexp(copy_term, torch.log1p(-p_copy) + lm_term)
    return _mean_or_zero(-log_p, targets.shape[0])


def _masked_binary_cross_entropy(logits: Tensor, targets: Tensor, keep: Optional[Tensor]) -> Tensor:
    """mean_{n : keep_n} BCE(sigmoid(logits_n), targets_n), from logits (`binary_cross_entropy_with_logits`,
    stable); keep [N] bool or 1/0, all rows when None — a mask rather than a gather, so the count never has
    to be known on the host. The one home of the per-token binary losses (COCO-LM's copy head, ELECTRA's
    discriminator)."""
    losses = F.binary_cross_entropy_with_logits(logits.float(), targets.float(), reduction="none")
    if keep is None:
        return _mean_or_zero(losses, logits.shape[0])
    weight = keep.float()
    return _mean_or_zero(losses * weight, weight.sum())


@_fp32_math
def copy_loss(copy_logits: Tensor, is_original: Tensor, keep: Optional[Tensor] = None) -> Tensor:
    """COCO-LM copy mechanism loss (Meng et al. 2021, Sec. 3.1):

        L_copy = mean_{n : keep_n} BCE( sigmoid(w . h_n), 1[x^MLM_n == x^orig_n] )

    copy_logits [N] = w . h_n, is_original [N] bool; keep [N] (bool or 1/0) marks the positions
    that take part (COCO-LM: the non-pad tokens), all of them when None.
    """
    return _masked_binary_cross_entropy(copy_logits, is_original, keep)


@_fp32_math
def replaced_token_detection_loss(logits: Tensor, is_replaced: Tensor, keep: Optional[Tensor] = None) -> Tensor:
    """ELECTRA's discriminator loss (Clark et al. 2020, Sec. 2):

        L_Disc = mean_{n : keep_n} BCE( sigmoid(D(x^corrupt)_n), 1[x^corrupt_n != x_n] )
               = mean_{n : keep_n} -( y_n log sigmoid(D_n) + (1 - y_n) log(1 - sigmoid(D_n)) ),  y_n = replaced

    logits [N] = D_n = w^T GELU(W h_n + b) + c (`discriminator_predictions`), is_replaced [N] bool; keep
    [N] the positions that take part (ELECTRA: every non-pad token), all when None. The paper writes a
    sum over positions; its public code (`run_pretraining.py`) and `transformers.ElectraForPreTraining`
    average over the non-pad tokens, as here. A sampled token equal to the original is not replaced.
    """
    return _masked_binary_cross_entropy(logits, is_replaced, keep)


@_fp32_math
def token_contrastive_loss(
    g: Tensor,
    anchor_idx: Tensor,
    positive_idx: Tensor,
    negative_idx: Tensor,
    tau: float,
    detach_candidates: bool = True,
) -> Tensor:
    """TACO token-alignment contrastive loss (Fu et al. 2022, Eq. 6-8).

        f(a, b) = cos(a, b) / tau
        L = mean_n -log( exp f(g_{x_n}, g_{c_n}) / (exp f(g_{x_n}, g_{c_n}) + sum_k exp f(g_{x_n}, g_{k_n}^-)) )

    g [T, H] are the global biases g = h - e of all T tokens of the batch, flattened; anchor_idx
    [N], positive_idx [N] and negative_idx [N, K] index rows of g. With detach_candidates (the
    public reference code's choice) positives and negatives are constants: the gradient reaches g
    only through the anchor rows.
    """
    unit = F.normalize(g.float(), dim=-1, eps=1e-8)
    candidates = unit.detach() if detach_candidates else unit
    anchors = unit[anchor_idx]  # [N, H]
    pos = (anchors * candidates[positive_idx]).sum(-1, keepdim=True)  # [N, 1]
    neg = torch.einsum("nh,nkh->nk", anchors, candidates[negative_idx])  # [N, K]
    logits = torch.cat([pos, neg], dim=1) / tau
    losses = torch.logsumexp(logits, dim=1) - logits[:, 0]
    return _mean_or_zero(losses, anchor_idx.shape[0])


@_fp32_math
def sequence_contrastive_loss(
    a: Tensor,
    b: Tensor,
    tau: float,
    queue: Optional[Tensor] = None,
    normalize: bool = True,
    symmetric: bool = True,
    same_view_negatives: bool = True,
    groups: Optional[Tensor] = None,
    reduction: str = "mean",
) -> Tensor:
    """Sequence-level InfoNCE between two views; covers CAPT, COCO-LM SCL and InfoWord DIM.

    For anchor a_i the positive is b_i; the negatives are b_j (j != i), plus a_j (j != i) when
    `same_view_negatives`, plus every queue row q:

        L_a(i) = -log( exp(a_i.b_i/tau) / ( sum_j exp(a_i.b_j/tau)
                                            + [same_view] sum_{j!=i} exp(a_i.a_j/tau)
                                            + sum_q exp(a_i.q/tau) ) )

    `groups` [B] int (optional): pairs i != j with groups[i] == groups[j] are not negatives of
    each other (neither b_j nor a_j) — InfoWord's several n-grams of one sentence.
    `symmetric` adds L_b(i) (the same with a and b swapped). `reduction` "mean" returns
    mean_i L_a(i) (symmetric: the mean over all 2B terms, (L_a + L_b) / 2); "sum" returns the sum
    over the B (or 2B) terms — CAPT's Eq. 4. `normalize` l2-normalises a, b and the queue first.
      - CAPT (Luo et al. 2021, Eq. 2-4): normalize, symmetric, same_view_negatives, queue.
      - COCO-LM SCL (Meng et al. 2021, Sec. 3.2): NT-Xent over 2N = the same without a queue.
      - InfoWord DIM (Kong et al. 2020, Sec. 4): dot product (normalize=False), symmetric=False,
        same_view_negatives=False; a = masked sentence, b = n-gram; groups = the sentence.
    The queue is a constant (no gradient): also where other ranks' rows are extra negatives.
    a, b [B, D]; queue [Q, D].
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"sequence_contrastive_loss: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    a, b = a.float(), b.float()
    q = None if queue is None else queue.detach().float()
    if normalize:
        a, b = F.normalize(a, dim=-1, eps=1e-8), F.normalize(b, dim=-1, eps=1e-8)
        q = None if q is None else F.normalize(q, dim=-1, eps=1e-8)
    eye = torch.eye(a.shape[0], dtype=torch.bool, device=a.device)
    same_group = eye if groups is None else (groups[:, None] == groups[None, :])
    not_negative = same_group & ~eye  # pairs of one group: neither positive nor negative

    def one_direction(x: Tensor, y: Tensor) -> Tensor:
        blocks = [(x @ y.T).masked_fill(not_negative, float("-inf"))]  # [B, B], positives on the diagonal
        if same_view_negatives:
            blocks.append((x @ x.T).masked_fill(same_group, float("-inf")))
        if q is not None:
            blocks.append(x @ q.T)
        logits = torch.cat(blocks, dim=1) / tau
        return torch.logsumexp(logits, dim=1) - torch.diagonal(logits[:, : x.shape[0]])  # [B]

    losses = one_direction(a, b)
    if symmetric:
        losses = torch.cat([losses, one_direction(b, a)])
    return losses.sum() if reduction == "sum" else _mean_or_zero(losses, losses.shape[0])


@torch.no_grad()
def prediction_accuracy(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, chunk_rows: int = 2048
) -> Tensor:
    """Metric, not a loss: fraction of rows whose argmax over the full vocabulary is the target.

    Computed without gradient in chunks of `chunk_rows`, so at most [chunk_rows, V] logits exist,
    in the training dtype (`hidden`'s: bf16 under bf16 training, no fp32 copy of the weight; an
    argmax needs no fp32 log-sum-exp). Objectives call it only on logged steps.
    """
    if targets.numel() == 0:
        return torch.zeros((), device=hidden.device)
    correct = torch.zeros((), device=hidden.device)
    w = weight.to(hidden.dtype)
    b = None if bias is None else bias.to(hidden.dtype)
    for start in range(0, targets.numel(), chunk_rows):
        rows = slice(start, start + chunk_rows)
        correct += (F.linear(hidden[rows], w, b).argmax(-1) == targets[rows]).sum()
    return correct / targets.numel()


#: The minimum of CAPT's adaptive temperature (Eq. 6), reached at mid-training.
ADAPTIVE_TAU_FLOOR = 0.05


@torch.no_grad()
def binary_auc(scores: Tensor, positive: Tensor, keep: Optional[Tensor] = None) -> Tensor:
    """Metric, not a loss: ROC AUC of `scores` for the positive class, ties counted half (the
    Mann-Whitney U statistic over the pairs, = the rank-sum AUC with tied scores given their mean rank):

        AUC = (1 / (P N)) sum_{i pos} sum_{j neg} ( 1[s_i > s_j] + 1/2 1[s_i == s_j] )
            = (sum_{i pos} midrank_i - P (P + 1) / 2) / (P N)

    scores [T], positive [T] bool, keep [T] bool or 1/0 (the rows that take part; all when None).
    Computed on the device with no host read: one sort, then for every row the number of kept
    negatives scoring below it and tied with it from `searchsorted` on the sorted scores and a
    prefix count of the negatives in sorted order — a row left out has weight 0 rather than being
    gathered away (a boolean gather would make the host wait for its size). 0.5 = chance; nan when
    either class is empty. float32 0-d tensor.
    """
    s = scores.detach().reshape(-1).float()
    pos = positive.reshape(-1).to(torch.bool)
    weight = torch.ones_like(s) if keep is None else keep.reshape(-1).to(s.dtype)
    pos_weight = weight * pos.to(s.dtype)
    neg_weight = weight - pos_weight
    order = torch.argsort(s)
    sorted_s = s[order]
    neg_before = F.pad(torch.cumsum(neg_weight[order], 0), (1, 0))  # [T + 1]: negatives among the first k sorted
    below = neg_before[torch.searchsorted(sorted_s, s, right=False)]  # negatives scoring < s_i
    up_to = neg_before[torch.searchsorted(sorted_s, s, right=True)]  # negatives scoring <= s_i
    wins = (pos_weight * (below + 0.5 * (up_to - below))).sum()
    pairs = pos_weight.sum() * neg_weight.sum()
    return torch.where(pairs > 0, wins / pairs.clamp(min=1), torch.full_like(wins, float("nan")))


def adaptive_temperature(step: int, total_steps: int) -> float:
    """CAPT's inverted-triangle temperature (Luo et al. 2021, Eq. 6):

        tau(t) = |t - T/2| / T + 0.05

    0.55 at t = 0 and t = T, 0.05 (`ADAPTIVE_TAU_FLOOR`) at t = T/2.
    """
    if total_steps <= 0:
        raise ValueError(f"adaptive_temperature: total_steps must be positive, got {total_steps}")
    return abs(step - total_steps / 2) / total_steps + ADAPTIVE_TAU_FLOOR
