"""`capt`: CAPT's sequence-level contrast between x and its corrupted x-hat (Luo et al. 2021,
"Rethinking Denoised Auto-Encoding in Language Pre-Training", Eq. 1-6).

    s = l2_normalize(A(h_[CLS](x))),   s^ = l2_normalize(A(h_[CLS](x^)))
    L(x_i)  = -log( e^{s_i.s^_i/tau} / (sum_j e^{s_i.s^_j/tau} + sum_{j!=i} e^{s_i.s_j/tau} + sum_q e^{s_i.q/tau}) )
    L(x^_i) = the same with s and s^ swapped
    L_CAPT  = sum_{i=1..n} (L(x_i) + L(x^_i))                       (Eq. 4: a sum over the 2n terms)

Reduction (`reduction`, an explicit choice). Averaging is *not* a learning-rate rescaling: the
training loss is L_MLM + L_CAPT (Sec. 3.1, "the sum of the above two"), so dividing L_CAPT by 2n
changes CAPT's weight against MLM by 2n (with Adam, whose update ignores the overall scale, that
relative weight is all the reduction changes).
  - "mean" (default): mean over the 2n terms; CAPT's weight against the per-token MLM mean is
    `objectives.capt`, whatever the batch size. Chosen because the paper does not say how its MLM
    term is normalised: with BERT's and RoBERTa's per-masked-token mean, the literal Eq. 4 weights
    CAPT 2n times a mean term (4,096 at capt-small's batch of 2,048, 16,384 at capt-large's 8,192),
    and that weight would move with the batch size; `mean` with `objectives.capt: 2n` is the same
    gradient as `sum`.
  - "sum": Eq. 4 over the *global* batch: each micro-batch's loss is (ranks x accumulation steps)
    x the sum of its 2b terms, so that after the engine averages the micro-batch gradients the
    step's gradient is that of Eq. 4 summed over all n sequences of the step (independent of how
    the batch is split into ranks and micro-batches).

A is an MLP with one hidden layer: hidden -> FFN size -> hidden (Sec. 3.1), GELU in between
(*choice*: the paper says "nonlinear projection"). q runs over a `MemoryQueue` of 8192 rows into
which both views of the whole global batch are enqueued (detached, FIFO, gathered across ranks)
after each micro-batch's loss. tau follows the inverted triangle of Eq. 6,
tau(t) = |t - T/2| / T + 0.05, from `ctx.progress`; pass a number as `tau` for a fixed temperature.

The queue joins at `queue_start` x T (*deviation at small scale*; default 0, the paper's queue from
the first step; `tiny-capt` used 0.2 and now gates on `queue_spread`, below). What went wrong (issue 29, at the time-to-quality study's
size: 2 x 128, 32 x 64 tokens, 300 steps, lr 1e-3, queue 64; `docs/objectives.md#capt` has the
tables): at initialisation every sequence has the same representation (BERT's 0.02-std init leaves
h_[CLS] nearly input-independent: mean cosine of different sequences' s 0.99995), so the loss
starts at chance, ln(2b - 1 + Q). In that state the queue's rows are constants that are
near-copies of one point: pushing the anchors away from them pushes every anchor the same way (it
spreads nothing), while they take Q / (2b - 1 + Q) of the softmax mass from the in-batch negatives,
the only ones whose repulsion spreads the sequences. The positive's pull then wins, and the
cheapest way to make x and x^ agree is to ignore the input: with the queue from step 0 the spread
went to zero, the token states followed (token cosine >= 0.9 on 274, 264, 105 of 300 steps, seeds
1-3), the loss sat at chance and MLM on the unigram plateau. Not the cause: Eq. 6 (a fixed tau of
0.1 collapses alike; the collapse starts at tau ~0.45), CAPT's weight against MLM or the learning
rate (weight 0.1 or lr 5e-4 keep the token states apart through MLM, but the sequence contrast
stays at chance). Without the queue the loss leaves chance within ~40 steps; with the queue joining
at 0.2 x T, after the in-batch contrast has spread the sequences, no seed of 1-5 collapsed and the
loss ends at 0.67-0.74x chance. XBM (Wang et al. 2020) names the condition for a memory of past
embeddings to stand in for current ones, "slow drift"; a memory of a degenerate configuration
drifts nowhere and is still no set of negatives. A fraction of the run, like Eq. 6's schedule, so
a preset keeps its shape at any run length.

`queue_spread` (*deviation at small scale*, default null = off) gates the reading of the queue on
the condition itself rather than on a fraction of the run: the queue is read only once the
in-batch views of different sequences have spread, i.e. from the first micro-batch whose

    negative_cosine = mean over ordered pairs of views of different sequences of u . v  < queue_spread

(latched: it never closes again; measured on the all-gathered views when the queue is gathered, so
every rank decides alike; saved with the queue, so a resumed run keeps it). A fixed `queue_start`
encodes how long the spreading takes, which moves with CAPT's weight and the data: with
`objectives.capt: 0.1` the in-batch contrast needed ~90 of 300 steps on the tiny test shards
(~55 at weight 1), so `queue_start: 0.2` collapsed there, while on the study's WikiText-2 shards
it did not. Until the host has seen the latch open (it reads it on logged steps only, where the
step's metrics are read anyway) the loss is computed both with and without the queue rows and
`torch.where` picks on the device (the sequence contrast is O(b (2b + Q) D), small beside the
encoder); from then on only with them. The queue is filled from `queue_start` on either way.

Logged learning signals (the contract of `pipeline.monitor.signals`): `loss` with `loss_chance` =
ln(2b - 1 + extra rows), the loss when every candidate scores alike (x 2b x micro-batches for
`reduction: sum`); with the adaptive tau, also `floor_tau_loss` / `floor_tau_loss_chance`, the same
candidates scored at tau's fixed minimum 0.05, because Eq. 6 makes the loss itself rise again over
the run's second half; and the collapse diagnosis `negative_cosine` (mean cosine of different
sequences' views) and `queue_cosine` (views against queue rows). All on logged steps only.

In-batch negatives (`batch_negatives`): "local" (default) contrasts each pair with the other 2b - 2
views of its own micro-batch; "global" adds the views of every other rank's micro-batch (all-gathered,
detached: gradient flows through this rank's views only), the paper's "training batch" of Eq. 2
across data-parallel ranks. Default "local": Sec. 5.1 / Fig. 3 (left) puts "the absence of memory
queue" at 128 negatives while the small model's batch is 2k (Table 4), so the paper's in-batch
negatives were a small share of the batch (the paper does not name its device count; a per-device
share is the likely reading), and the queue (global here) supplies the rest.

Both views are encoded in the same step by the same encoder; x^ is the `masked` view (BERT 15%),
or `shuffled` (window-3 shuffle, the paper's Sec. 5.2 ablation) via `corruption`. The paper's
recipe is `objectives: {mlm: 1, capt: 1}`; MLM then reuses the masked pass.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.data.batch import VIEW_INPUTS, choose_view
from pipeline.distributed import all_gather_row_blocks, split_own_block
from pipeline.model.encoder import EncoderConfig
from pipeline.objectives.base import Objective, StepContext, register, scalar_metric
from pipeline.kernels.functional import ADAPTIVE_TAU_FLOOR as TAU_FLOOR, REDUCTIONS, adaptive_temperature
from pipeline.objectives.memory_queue import MemoryQueue

CORRUPTIONS = ("masked", "wwm_masked", "shuffled")
BATCH_NEGATIVES = ("local", "global")


class AggregationMLP(nn.Module):
    """CAPT's aggregation layer A on the [CLS] state: Linear(H, F) -> GELU -> Linear(F, H)."""

    def __init__(self, hidden_size: int, inner_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, inner_size)
        self.out_proj = nn.Linear(inner_size, hidden_size)

    def forward(self, cls_state: Tensor) -> Tensor:
        return self.out_proj(F.gelu(self.dense(cls_state)))


@register
class ContrastivePretraining(Objective):
    """CAPT (see the module docstring). Options: corruption, tau (None = adaptive Eq. 6),
    queue_size (0 disables the queue), gather_queue (all-gather across ranks), reduction
    ("mean" | "sum"), batch_negatives ("local" | "global"), queue_start (fraction of the run before
    which the queue is neither filled nor read), queue_spread (the in-batch negative cosine below
    which the queue starts to be read; None: read as soon as it is filled)."""

    name = "capt"
    views = ("masked",)

    def __init__(
        self,
        encoder_config: EncoderConfig,
        special_tokens: Mapping[str, int],
        corruption: str = "masked",
        tau: Optional[float] = None,
        queue_size: int = 8192,
        gather_queue: bool = True,
        reduction: str = "mean",
        batch_negatives: str = "local",
        queue_start: float = 0.0,
        queue_spread: Optional[float] = None,
    ) -> None:
        super().__init__()
        choose_view("corruption", corruption, CORRUPTIONS)
        if tau is not None and tau <= 0:
            raise ValueError(f"tau must be positive (or null for the adaptive schedule), got {tau}")
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {queue_size}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if not 0.0 <= queue_start < 1.0:
            raise ValueError(f"queue_start must be a fraction of the run in [0, 1), got {queue_start}")
        if queue_spread is not None and not -1.0 < queue_spread < 1.0:
            raise ValueError(f"queue_spread must be a cosine in (-1, 1), or null for no spread gate; got {queue_spread}")
        if queue_spread is not None and not queue_size:
            raise ValueError("queue_spread gates the reading of the memory queue: it needs queue_size > 0")
        if batch_negatives not in BATCH_NEGATIVES:
            raise ValueError(f"batch_negatives must be one of {BATCH_NEGATIVES}, got {batch_negatives!r}")
        self.views = ("original", corruption)
        self.corrupted_key = VIEW_INPUTS[corruption][0]
        self.tau = tau
        self.aggregation = AggregationMLP(encoder_config.hidden_size, encoder_config.ffn_size)
        self.queue = MemoryQueue(queue_size, encoder_config.hidden_size) if queue_size else None
        self.gather_queue = gather_queue
        self.reduction, self.batch_negatives = reduction, batch_negatives
        self.queue_start, self.queue_spread = queue_start, queue_spread
        # the spread gate's latch, on the device (read by the host only at a checkpoint save)
        self.register_buffer("spread_reached", torch.zeros((), dtype=torch.bool), persistent=False)
        # the host's copy once it has seen the latch open (read on logged steps, set on load): from then
        # on only the loss with the queue is computed (the same values: `where` picked it already)
        self.spread_known_open = False

    def queue_active(self, step: int, total_steps: int) -> bool:
        """Whether the queue is filled and read at optimizer step `step` of `total_steps`:
        from step queue_start x T on (every step when queue_start is 0, the paper's recipe)."""
        return self.queue is not None and step >= self.queue_start * total_steps

    def temperature(self, step: int, total_steps: int) -> float:
        return self.tau if self.tau is not None else adaptive_temperature(step, total_steps)

    def represent(self, cls_state: Tensor) -> Tensor:
        """s = l2_normalize(A(h_cls)), in float32."""
        return F.normalize(self.aggregation(cls_state).float(), dim=-1, eps=1e-8)

    def forward(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:
        s = self.represent(ctx.encode("input_ids").last_hidden[:, 0])
        s_hat = self.represent(ctx.encode(self.corrupted_key).last_hidden[:, 0])
        tau = self.temperature(ctx.progress.step, ctx.progress.total_steps)
        views = torch.cat([s, s_hat]).detach()
        use_queue = self.queue_active(ctx.progress.step, ctx.progress.total_steps)
        gathered = None
        if self.batch_negatives == "global" or (use_queue and self.gather_queue and self.training):
            gathered = all_gather_row_blocks(views)  # one collective serves both the negatives and the queue
        extra = []
        if self.batch_negatives == "global":
            extra.append(split_own_block(gathered)[1])  # the other ranks' views of this step
        queued = self.queue.negatives(s.device) if use_queue else None
        in_batch = torch.cat(extra) if extra else None
        if queued is not None:
            extra.append(queued)
        negatives = torch.cat(extra) if extra else None
        contrast = ctx.op("sequence_contrastive_loss")
        gate = self.update_spread_gate(s, s_hat, gathered, ctx.progress.record_metrics) if queued is not None else None

        def gated(tau_: float, **options) -> Tensor:
            """The loss over `negatives`, or over the in-batch ones only while the spread gate is closed."""
            with_queue = contrast(s, s_hat, tau_, negatives, normalize=True, symmetric=True,
                                  same_view_negatives=True, **options)
            if gate is None:
                return with_queue
            return torch.where(gate, with_queue, contrast(s, s_hat, tau_, in_batch, normalize=True, symmetric=True,
                                                          same_view_negatives=True, **options))

        loss = gated(tau, reduction=self.reduction)
        if self.reduction == "sum":
            loss = loss * ctx.progress.micro_batches  # Eq. 4 over the global batch (module docstring)
        # per anchor: the other 2b - 2 views of the batch, the positive excluded, and the extra rows
        extra_rows = self.gated_count(0 if negatives is None else negatives.shape[0],
                                      0 if in_batch is None else in_batch.shape[0], gate, s.device)
        metrics = {
            "tau": scalar_metric(tau, s.device),
            "positive_cosine": (s * s_hat).sum(-1).mean().detach(),
            "queue_rows": scalar_metric(len(self.queue) if self.queue else 0, s.device),
            "queue_read": scalar_metric(float(queued is not None), s.device) if gate is None else gate.float(),
            "negatives": 2 * s.shape[0] - 2 + extra_rows,
        }
        if ctx.progress.record_metrics:
            # Chance level of the loss: every candidate scored alike, each term is ln(candidates per anchor)
            # = ln(negatives + 1); a sum reduction sums 2b such terms, scaled like the loss.
            chance = torch.log(2 * s.shape[0] - 1 + extra_rows)
            terms = 2 * s.shape[0] * ctx.progress.micro_batches if self.reduction == "sum" else 1
            metrics["loss_chance"] = terms * chance
            metrics.update(self.spread_metrics(s, s_hat, queued))
            if self.tau is None:
                # The adaptive tau makes the loss rise again over the last half by construction (its floor
                # grows with tau); the same candidates scored at tau's fixed minimum show whether the
                # representations still improve. Per term (mean), so its chance is ln(candidates).
                with torch.no_grad():
                    metrics["floor_tau_loss"] = gated(TAU_FLOOR)
                metrics["floor_tau_loss_chance"] = chance
        if use_queue and self.training:  # last: `queued` may be the queue's own storage, which this overwrites
            rows = torch.cat(gathered) if gathered is not None and self.gather_queue else views
            self.queue.enqueue(rows, gather=False)
        return loss, metrics

    @torch.no_grad()
    def update_spread_gate(self, s: Tensor, s_hat: Tensor, gathered: Optional[list[Tensor]],
                           logged_step: bool = False) -> Optional[Tensor]:
        """The spread gate (module docstring): None without `queue_spread` or once the host has seen it
        open (read on a logged step); else the latch, first closed and opened for good by a micro-batch
        (a training one) whose in-batch negative cosine is below `queue_spread`, measured over every
        rank's views when they were gathered (`gathered`, blocks of [s; s^]), so that every rank decides
        alike (and reads the same latch on the same logged steps)."""
        if self.queue_spread is None or self.spread_known_open:
            return None
        if logged_step:  # the host may wait here (a logged step reads its metrics anyway)
            self.spread_known_open = bool(self.spread_reached)
            if self.spread_known_open:
                return None
        if self.training:
            pairs = [(s, s_hat)] if gathered is None else [block.chunk(2) for block in gathered]
            spread = negative_cosine(pairs)
            if spread is not None:
                self.spread_reached |= spread < self.queue_spread
        return self.spread_reached

    @staticmethod
    def gated_count(with_queue: int, without: int, gate: Optional[Tensor], device: torch.device) -> Tensor:
        """A row count as a float32 device scalar: `with_queue`, or `without` while the gate is closed."""
        if gate is None:
            return scalar_metric(with_queue, device)
        return torch.where(gate, scalar_metric(with_queue, device), scalar_metric(without, device))

    @staticmethod
    @torch.no_grad()
    def spread_metrics(s: Tensor, s_hat: Tensor, queued: Optional[Tensor]) -> dict[str, Tensor]:
        """How far apart the representations are (the collapse diagnosis of the module docstring):

            negative_cosine = mean over ordered pairs of views of different sequences of u . v
            queue_cosine    = mean over (view of this batch, queue row) of u . q

        from the sums of the unit vectors, O(b D): with U the 2b views, |sum U|^2 counts every
        ordered pair once, the 2b self-pairs (1 each) and the 2b positive pairs (2 sum_i s_i . s^_i)."""
        views = torch.cat([s, s_hat])
        n, total = views.shape[0], views.sum(0)
        metrics = {}
        spread = negative_cosine([(s, s_hat)])
        if spread is not None:  # one sequence has no in-batch negative
            metrics["negative_cosine"] = spread
        if queued is not None:
            metrics["queue_cosine"] = total @ F.normalize(queued.float(), dim=-1, eps=1e-8).sum(0) / (n * queued.shape[0])
        return metrics

    def extra_state_for_checkpoint(self) -> Optional[dict]:
        if self.queue is None:
            return None
        state = {"queue": self.queue.state_dict()}
        if self.queue_spread is not None:
            state["spread_reached"] = bool(self.spread_reached)
        return state

    def load_extra_state_from_checkpoint(self, state: dict) -> None:
        if self.queue is None:
            if state.get("queue") is not None:
                raise ValueError("the checkpoint holds a CAPT memory queue but this run has objective_options.capt.queue_size=0")
            return
        self.queue.load_state_dict(state["queue"])
        if self.queue_spread is not None:
            # a checkpoint written without the gate read its queue as soon as it was filled
            self.spread_reached.fill_(bool(state.get("spread_reached", True)))
            self.spread_known_open = bool(self.spread_reached)


def negative_cosine(pairs: list[tuple[Tensor, Tensor]]) -> Optional[Tensor]:
    """Mean cosine of the views of different sequences over the unit rows of every (s, s^) pair block,

        negative_cosine = (|sum U|^2 - n - 2 sum_i s_i . s^_i) / (n (n - 2)),   U the n = 2b views,

    O(b D): |sum U|^2 counts every ordered pair once, the n self-pairs (1 each) and the 2b positive
    pairs. None when there is one sequence (no negative)."""
    total = sum(u.sum(0) + v.sum(0) for u, v in pairs)
    n = sum(2 * u.shape[0] for u, _ in pairs)
    if n <= 2:
        return None
    positives = sum((u * v).sum() for u, v in pairs)
    return (total @ total - n - 2 * positives) / (n * (n - 2))
