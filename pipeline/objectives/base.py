"""The objective contract: `loss, metrics = objective(ctx)`, a registry, and the per-step context.

Every objective is an `nn.Module` (so its heads are trained and checkpointed with the encoder)
registered under a config name. It declares the batch views it needs (`views`); the collator
builds exactly those. Encoder passes are shared between objectives through `StepContext.encode`,
so MLM + TACO costs one forward of the masked view, not two.

Sampling inside objectives (TACO positives/negatives, COCO-LM replacements, NCE negatives) uses
`ctx.generator`, a `torch.Generator` seeded from (run seed, first global sample index of the
micro-batch): deterministic, independent of the rank count, and exactly reproduced on resume
without saving RNG state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar, Optional

import torch
from torch import Tensor, nn

from pipeline.model import EncoderOutput

if TYPE_CHECKING:
    from pipeline.pretrainer import PretrainModel

#: Batch views the collator can build (see `pipeline.corruption`). Keys each view adds to the batch:
#:   original:    input_ids, attention_mask, special_mask, word_starts (always present)
#:   masked:      masked_ids, mlm_labels (-100 where not selected)                 BERT 15% 80/10/10
#:   wwm_masked:  masked_ids, mlm_labels, built with whole-word masking instead
#:   span_masked: span_masked_ids, span_labels (-100 elsewhere), span_index (-1 or span number)
#:   crop:        crop_ids, crop_attention_mask                                    COCO-LM crop
#:   shuffled:    shuffled_ids                                                     CAPT window-3 shuffle
VIEWS = ("original", "masked", "wwm_masked", "span_masked", "crop", "shuffled")


@dataclass
class StepContext:
    """What one forward pass of the pretraining model shares between its objectives."""

    model: "PretrainModel"
    batch: dict[str, Tensor]
    step: int
    total_steps: int
    generator: torch.Generator
    kernels: str = "auto"
    _cache: dict[tuple[str, str], EncoderOutput] = field(default_factory=dict)

    def encode(self, ids_key: str, mask_key: str = "attention_mask") -> EncoderOutput:
        """Encoder output for `batch[ids_key]`, computed once per step and shared."""
        key = (ids_key, mask_key)
        if key not in self._cache:
            self._cache[key] = self.model.bert(self.batch[ids_key], self.batch[mask_key])
        return self._cache[key]

    def op(self, name: str) -> Callable:
        """Loss op `name` (torch reference or Triton kernel, per the `kernels` switch)."""
        from pipeline.kernels import get_op

        return get_op(name, self.kernels)


class Objective(nn.Module):
    """Base class. Subclasses set `name`, `views`, and implement `forward(ctx) -> (loss, metrics)`.

    `loss` is a float32 scalar; `metrics` maps short names to detached scalars (logged as
    `<objective>/<metric>`).
    """

    name: ClassVar[str] = ""
    views: ClassVar[tuple[str, ...]] = ("original",)

    def forward(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def extra_state_for_checkpoint(self) -> Optional[dict]:
        """Non-parameter state that must survive a resume (e.g. a memory queue); None if none."""
        return None

    def load_extra_state_from_checkpoint(self, state: dict) -> None:
        """Inverse of `extra_state_for_checkpoint`."""


#: name -> objective class. Filled by `register`.
OBJECTIVES: dict[str, type[Objective]] = {}


def register(cls: type[Objective]) -> type[Objective]:
    """Class decorator: make an objective available under `cls.name` in configs."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    if cls.name in OBJECTIVES and OBJECTIVES[cls.name] is not cls:
        raise ValueError(f"objective name {cls.name!r} registered twice")
    for v in cls.views:
        if v not in VIEWS:
            raise ValueError(f"{cls.__qualname__} asks for unknown view {v!r}; known: {VIEWS}")
    OBJECTIVES[cls.name] = cls
    return cls
