"""The objective contract: `loss, metrics = objective(ctx)`, the registry, and the per-step context.

Every objective is an `nn.Module` (so its heads are trained and checkpointed with the encoder)
registered under a config name. It declares the batch views it needs (`views`, see
`pipeline.data.batch`); the collator builds exactly those. Encoder passes are shared between objectives
through `StepContext.encode`, so MLM + TACO costs one forward of the masked view, not two.

An objective sees the encoder and the MLM head through the context, never the whole
`PretrainModel`: that is all any of them needs, and it keeps objectives independent of the model
that combines them. Sampling inside objectives (TACO positives/negatives, COCO-LM replacements,
NCE negatives, InfoWord n-grams) uses `ctx.generator`, the micro-batch's stream of
`pipeline.seeding` (exactly reproduced on resume, independent of the rank count).

The registry's users (config checks, model construction) go through `pipeline.objectives.registry`,
which imports every objective module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional

import torch
from torch import Tensor, nn

from pipeline.data.batch import VIEW_INPUTS, VIEWS, seqlens_key
from pipeline.model.encoder import BertEncoder, EncoderOutput
from pipeline.model.heads import MLMHead


@dataclass(frozen=True)
class StepProgress:
    """Where the run is: optimizer step `step` (1-based) of `total_steps` (CAPT's temperature uses it),
    and `micro_batches`, the number of micro-batches whose gradients the engine averages into one
    step (ranks x accumulation steps; a loss that is a sum over the global batch uses it).
    `record_metrics`: this step's metrics are logged (`train.log_every`); on other steps the
    objectives skip the work that only feeds metrics (full-vocabulary accuracy, health)."""

    step: int = 0
    total_steps: int = 1
    micro_batches: int = 1
    record_metrics: bool = True


@dataclass
class StepContext:
    """What one forward pass of the pretraining model shares between its objectives."""

    encoder: BertEncoder
    head: MLMHead
    batch: dict[str, Tensor]
    progress: StepProgress
    generator: torch.Generator
    kernels: str = "auto"
    _cache: dict[tuple[str, str], EncoderOutput] = field(default_factory=dict)
    #: inputs an objective built itself and encoded through `encode_private` (ELECTRA's X^corrupt), by name
    private_inputs: dict[str, Tensor] = field(default_factory=dict)

    def encode(self, ids_key: str, mask_key: str = "attention_mask") -> EncoderOutput:
        """Encoder output for `batch[ids_key]`, computed once per step and shared."""
        key = (ids_key, mask_key)
        if key not in self._cache:
            self._cache[key] = self.encoder(self.batch[ids_key], self.batch[mask_key], seqlens=self.seqlens(mask_key))
        return self._cache[key]

    def encode_private(self, name: str, ids: Tensor, mask_key: str = "attention_mask") -> EncoderOutput:
        """Encoder output of `ids`, an input the objective built itself with the batch's `mask_key` mask
        (ELECTRA's X^corrupt), cached like `encode` under (`name`, `mask_key`) with `ids` kept in
        `private_inputs[name]`, so the step's health metrics (`pipeline.monitor.health.step_health`) can
        read it as they read the batch's views."""
        key = (name, mask_key)
        if key not in self._cache:
            self.private_inputs[name] = ids
            self._cache[key] = self.encoder(ids, self.batch[mask_key], seqlens=self.seqlens(mask_key))
        return self._cache[key]

    def seqlens(self, mask_key: str = "attention_mask") -> Optional[Tensor]:
        """Host-side real-token counts of the view masked by `mask_key`, if the collator provided them."""
        return self.batch.get(seqlens_key(mask_key))

    def cached_outputs(self) -> dict[tuple[str, str], EncoderOutput]:
        """The encoder outputs computed so far this step, by (ids key, mask key) (read-only use)."""
        return dict(self._cache)

    def encode_view(self, view: str) -> EncoderOutput:
        """Encoder output of a batch view (`pipeline.data.batch.VIEW_INPUTS`), shared like `encode`."""
        return self.encode(*VIEW_INPUTS[view])

    def op(self, name: str) -> Callable:
        """Loss op `name` (torch reference or Triton kernel, per the `kernels` switch)."""
        from pipeline.kernels import get_op

        return get_op(name, self.kernels)


def scalar_metric(value: float, device: torch.device) -> Tensor:
    """A host number as a float32 metric scalar on `device`, written by a fill kernel: unlike
    `torch.tensor(value, device=...)` (a blocking copy) it does not make the host wait."""
    return torch.full((), float(value), dtype=torch.float32, device=device)


#: `Objective.mlm_head` values: the shared MLM head is trained by a softmax over the whole vocabulary
#: (its scores are a masked LM's logits), or over sampled negatives (scores log p - log q, `mlm_nce`).
FULL_SOFTMAX = "full_softmax"
SAMPLED_SOFTMAX = "sampled_softmax"


class Objective(nn.Module):
    """Base class. Subclasses set `name`, `views`, and implement `forward(ctx) -> (loss, metrics)`.

    `loss` is a float32 scalar; `metrics` maps short names to detached scalars (logged as
    `<objective>/<metric>`). An objective that cannot run with partitioned parameters sets
    `max_zero_stage`. One that trains the shared MLM head (`ctx.head`, `cls.predictions`) says how
    in `mlm_head` (`FULL_SOFTMAX` / `SAMPLED_SOFTMAX`; None: it does not use the head): conversion
    decides from it what the exported head's softmax means.
    """

    name: ClassVar[str] = ""
    views: ClassVar[tuple[str, ...]] = ("original",)
    max_zero_stage: ClassVar[int] = 3
    mlm_head: ClassVar[Optional[str]] = None

    def forward(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def host_plan(self) -> Optional[Callable[[dict[str, Tensor]], dict[str, Tensor]]]:
        """A picklable callable the collator runs on every collated batch (host tensors) whose keys
        join the batch: the indices whose sizes only the data knows, built in the loader's worker
        processes instead of read back from the device in the step (`pipeline.data.batch`). None: none."""
        return None

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
