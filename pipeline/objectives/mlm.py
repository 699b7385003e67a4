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

from pipeline.model import EncoderConfig
from pipeline.objectives import functional
from pipeline.objectives.base import Objective, StepContext, register

IGNORE_INDEX = -100

#: view name -> (ids key, labels key) of the masked input it provides (see `base.VIEWS`).
MASKED_VIEWS: dict[str, tuple[str, str]] = {
    "masked": ("masked_ids", "mlm_labels"),
    "wwm_masked": ("masked_ids", "mlm_labels"),
    "span_masked": ("span_masked_ids", "span_labels"),
}


def check_masked_view(objective: str, view: str) -> tuple[str, str]:
    """(ids key, labels key) of `view`, or a clear error naming the option."""
    if view not in MASKED_VIEWS:
        raise ValueError(f"objective_options.{objective}.view must be one of {sorted(MASKED_VIEWS)}, got {view!r}")
    return MASKED_VIEWS[view]


def selected_positions(labels: Tensor) -> tuple[Tensor, Tensor]:
    """(targets [N], flat_positions [N]) of the selected positions (labels != -100), row-major
    into the flattened [B*L] batch."""
    flat = torch.nonzero(labels.reshape(-1) != IGNORE_INDEX).squeeze(1)
    return labels.reshape(-1)[flat], flat


def gather_selected(hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of `hidden` [B, L, H] at selected positions (labels != -100).

    Returns (hidden_selected [N, H], targets [N], flat_positions [N] into B*L, row-major).
    """
    targets, flat = selected_positions(labels)
    return hidden.reshape(-1, hidden.shape[-1])[flat], targets, flat


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
        if view == "span_masked":
            raise ValueError("objective_options.mlm.view: use 'masked' or 'wwm_masked' (span masking is infoword's)")
        self.ids_key, self.labels_key = check_masked_view(self.name, view)
        self.views = (view,)
        self.track_accuracy = track_accuracy

    def forward(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:
        hidden = ctx.encode(self.ids_key).last_hidden
        h_sel, targets, _ = gather_selected(hidden, ctx.batch[self.labels_key])
        op = with_accuracy(ctx.op("linear_cross_entropy"), self.track_accuracy)
        loss, acc = ctx.model.cls(h_sel, op, targets)
        metrics = {"selected_tokens": torch.tensor(float(targets.numel()), device=hidden.device)}
        if acc is not None:
            metrics["accuracy"] = acc
        return loss, metrics
