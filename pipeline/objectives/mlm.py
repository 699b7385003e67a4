"""`mlm`: BERT masked language modelling (Devlin et al. 2019), the baseline of every recipe.

    L_MLM = mean_{i in M} -log softmax(E T(h_i) + b)_{x_i}

with T the `cls.predictions.transform` (dense -> GELU -> LayerNorm) and E the tied word
embeddings. Only the selected positions M (`mlm_labels != -100`, 15% with 80/10/10 corruption,
re-drawn by the collator every time a sequence is seen) are gathered before the head, so no
[tokens, vocab] logits tensor exists for unselected positions; with the Triton op none exists at
all. The projection runs inside `model.cls` so ZeRO-3 has gathered the tied weight.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
from torch import Tensor

from pipeline.batch import gather_selected, masked_view_keys
from pipeline.model.encoder import EncoderConfig
from pipeline.objectives import functional
from pipeline.objectives.base import Objective, StepContext, register


def with_accuracy(op: Callable[..., Tensor], track_accuracy: bool) -> Callable[..., tuple[Tensor, Optional[Tensor]]]:
    """Wrap a vocabulary loss op so that it also returns the full-vocabulary argmax accuracy
    (computed inside the head's forward, where the tied weight is available under ZeRO-3)."""

    def loss_and_accuracy(hidden, weight, bias, targets, *args):
        loss = op(hidden, weight, bias, targets, *args)
        acc = functional.prediction_accuracy(hidden.detach(), weight.detach(), bias, targets) if track_accuracy else None
        return loss, acc

    return loss_and_accuracy


@register
class MaskedLanguageModeling(Objective):
    """BERT MLM on the `masked` (or `wwm_masked`) view.

    Options: view ("masked" | "wwm_masked"), track_accuracy (log `mlm/accuracy`, one extra
    no-grad projection of the selected rows).
    """

    name = "mlm"
    views = ("masked",)

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
        h_sel, targets, _ = gather_selected(hidden, ctx.batch[self.labels_key])
        op = with_accuracy(ctx.op("linear_cross_entropy"), self.track_accuracy)
        loss, acc = ctx.head(h_sel, op, targets)
        metrics = {"selected_tokens": torch.tensor(float(targets.numel()), device=hidden.device)}
        if acc is not None:
            metrics["accuracy"] = acc
        return loss, metrics
