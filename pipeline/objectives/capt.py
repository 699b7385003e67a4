"""`capt`: CAPT's sequence-level contrast between x and its corrupted x-hat (Luo et al. 2021,
"Rethinking Denoised Auto-Encoding in Language Pre-Training", Eq. 1-6).

    s = l2_normalize(A(h_[CLS](x))),   s^ = l2_normalize(A(h_[CLS](x^)))
    L(x_i)  = -log( e^{s_i.s^_i/tau} / (sum_j e^{s_i.s^_j/tau} + sum_{j!=i} e^{s_i.s_j/tau} + sum_q e^{s_i.q/tau}) )
    L(x^_i) = the same with s and s^ swapped;   L_CAPT = mean_i (L(x_i) + L(x^_i)) / 2

(Eq. 4 sums; we average, which only rescales the learning rate.) A is an MLP with one hidden
layer: hidden -> FFN size -> hidden (Sec. 3.1), GELU in between (*choice*: the paper says
"nonlinear projection"). q runs over a `MemoryQueue` of 8192 rows into which both views of the
whole global batch are enqueued (detached, FIFO, gathered across ranks) after each micro-batch's
loss. tau follows the inverted triangle of Eq. 6, tau(t) = |t - T/2| / T + 0.05, from
`ctx.progress`; pass a number as `tau` for a fixed temperature.

Both views are encoded in the same step by the same encoder; x^ is the `masked` view (BERT 15%),
or `shuffled` (window-3 shuffle, the paper's Sec. 5.2 ablation) via `corruption`. The paper's
recipe is `objectives: {mlm: 1, capt: 1}`; MLM then reuses the masked pass.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.batch import VIEW_INPUTS, choose_view
from pipeline.model.encoder import EncoderConfig
from pipeline.objectives.base import Objective, StepContext, register, scalar_metric
from pipeline.objectives.functional import adaptive_temperature
from pipeline.objectives.memory_queue import MemoryQueue

CORRUPTIONS = ("masked", "wwm_masked", "shuffled")


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
    queue_size (0 disables the queue), gather_queue (all-gather across ranks)."""

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
    ) -> None:
        super().__init__()
        choose_view("corruption", corruption, CORRUPTIONS)
        if tau is not None and tau <= 0:
            raise ValueError(f"tau must be positive (or null for the adaptive schedule), got {tau}")
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {queue_size}")
        self.views = ("original", corruption)
        self.corrupted_key = VIEW_INPUTS[corruption][0]
        self.tau = tau
        self.aggregation = AggregationMLP(encoder_config.hidden_size, encoder_config.ffn_size)
        self.queue = MemoryQueue(queue_size, encoder_config.hidden_size) if queue_size else None
        self.gather_queue = gather_queue

    def temperature(self, step: int, total_steps: int) -> float:
        return self.tau if self.tau is not None else adaptive_temperature(step, total_steps)

    def represent(self, cls_state: Tensor) -> Tensor:
        """s = l2_normalize(A(h_cls)), in float32."""
        return F.normalize(self.aggregation(cls_state).float(), dim=-1, eps=1e-8)

    def forward(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:
        s = self.represent(ctx.encode("input_ids").last_hidden[:, 0])
        s_hat = self.represent(ctx.encode(self.corrupted_key).last_hidden[:, 0])
        tau = self.temperature(ctx.progress.step, ctx.progress.total_steps)
        queue = self.queue.negatives(s.device) if self.queue is not None else None
        loss = ctx.op("sequence_contrastive_loss")(
            s, s_hat, tau, queue, normalize=True, symmetric=True, same_view_negatives=True
        )
        if self.queue is not None and self.training:
            self.queue.enqueue(torch.cat([s, s_hat]).detach(), gather=self.gather_queue)
        metrics = {
            "tau": scalar_metric(tau, s.device),
            "positive_cosine": (s * s_hat).sum(-1).mean().detach(),
            "queue_rows": scalar_metric(len(self.queue) if self.queue else 0, s.device),
        }
        return loss, metrics

    def extra_state_for_checkpoint(self) -> Optional[dict]:
        return None if self.queue is None else {"queue": self.queue.state_dict()}

    def load_extra_state_from_checkpoint(self, state: dict) -> None:
        if self.queue is None:
            if state.get("queue") is not None:
                raise ValueError("the checkpoint holds a CAPT memory queue but this run has objective_options.capt.queue_size=0")
            return
        self.queue.load_state_dict(state["queue"])
