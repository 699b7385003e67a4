"""`mlm`: BERT masked language modelling (Devlin et al. 2019), the baseline of every recipe.

    L_MLM = mean_{i in M} -log softmax(E T(h_i) + b)_{x_i}

with T the `cls.predictions.transform` (dense -> GELU -> LayerNorm) and E the tied word
embeddings. Only the selected positions M (`mlm_labels != -100`, 15% with 80/10/10 corruption,
re-drawn by the collator every time a sequence is seen; their flat positions come from the
collator, `mlm_positions`) are gathered before the head, so no [tokens, vocab] logits tensor
exists for unselected positions; with the Triton op none exists at all. The accuracy metric is
the argmax of the logits the loss computes anyway (`linear_cross_entropy_with_accuracy`), not a
second projection. The projection runs inside `model.cls` so ZeRO-3 has gathered the tied weight.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

from torch import Tensor

from pipeline.data.batch import gather_selected, masked_view_keys, positions_key
from pipeline.model.encoder import EncoderConfig
from pipeline.kernels import functional
from pipeline.objectives.base import FULL_SOFTMAX, Objective, StepContext, register, scalar_metric


def with_accuracy(op: Callable[..., Tensor], track_accuracy: bool,
                  log_proposal: Optional[Tensor] = None) -> Callable[..., tuple[Tensor, Optional[Tensor]]]:
    """Wrap a loss op that does not score the whole vocabulary (BERT-NCE's sampled softmax) so that
    it also returns the full-vocabulary argmax accuracy — one extra no-grad projection of the
    selected rows, inside the head's forward, where the tied weight is available under ZeRO-3.
    MLM does not need it: its loss op returns the accuracy of its own logits.

    `log_proposal` [V] (log q of the negatives' proposal, `mlm_nce.NegativeTokenSampler`): the accuracy
    is then that of argmax_v (s(v, c) + log q(v)), the masked LM the head implies and conversion exports
    (`pipeline.export` adds log q to the bias). argmax_v s(v, c) alone is an argmax of log p(v | c) - log q(v):
    it favours rare tokens, and at the study's size it read 0.076 at [MASK] positions where the exported
    head reads 0.112, and 0.84 at the unchanged ones (0.48), so copying made most of the logged accuracy
    (issue 29)."""

    def loss_and_accuracy(hidden, weight, bias, targets, *args):
        loss = op(hidden, weight, bias, targets, *args)
        acc = None
        if track_accuracy:
            offset = bias if log_proposal is None else (log_proposal if bias is None else bias.float() + log_proposal)
            acc = functional.prediction_accuracy(hidden.detach(), weight.detach(), offset, targets)
        return loss, acc

    return loss_and_accuracy


@register
class MaskedLanguageModeling(Objective):
    """BERT MLM on the `masked` (or `wwm_masked`) view.

    Options: view ("masked" | "wwm_masked"), track_accuracy (log `mlm/accuracy`, the argmax of
    the loss's own logits, on the steps whose metrics are logged: `StepProgress.record_metrics`).
    """

    name = "mlm"
    views = ("masked",)
    mlm_head = FULL_SOFTMAX

    def __init__(
        self,
        encoder_config: EncoderConfig,
        special_tokens: Mapping[str, int],
        view: str = "masked",
        track_accuracy: bool = True,
    ) -> None:
        super().__init__()
        self.ids_key, self.labels_key = masked_view_keys(view, ("masked", "wwm_masked"))  # spans are infoword's
        self.views = (view,)
        self.track_accuracy = track_accuracy

    def forward(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:
        hidden = ctx.encode(self.ids_key).last_hidden
        labels = ctx.batch[self.labels_key]
        h_sel, targets, _ = gather_selected(hidden, labels, ctx.batch.get(positions_key(self.labels_key)))
        acc: Optional[Tensor] = None
        if self.track_accuracy and ctx.progress.record_metrics:  # the argmax pass only when it is logged
            loss, acc = ctx.head(h_sel, ctx.op("linear_cross_entropy_with_accuracy"), targets)
        else:
            loss = ctx.head(h_sel, ctx.op("linear_cross_entropy"), targets)
        metrics = {"selected_tokens": scalar_metric(targets.numel(), hidden.device)}
        if acc is not None:
            metrics["accuracy"] = acc
        return loss, metrics
