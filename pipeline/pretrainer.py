"""`PretrainModel`: encoder + MLM head + the configured objectives, as one `nn.Module`.

This is what DeepSpeed wraps. `forward(batch)` returns `(loss, metrics)` with
`loss = sum_k weight_k * loss_k` over the configured objectives. State-dict keys of the encoder
and MLM head are exactly `BertForMaskedLM`'s (`bert.*`, `cls.*`); objective-only heads live
under `objectives.<name>.*`.
"""
from __future__ import annotations

import hashlib
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from pipeline.model import BertEncoder, EncoderConfig, MLMHead, init_bert_weights
from pipeline.objectives.base import OBJECTIVES, Objective, StepContext


def micro_batch_seed(run_seed: int, first_sample_index: int) -> int:
    """Seed of the per-micro-batch sampling generator: a hash, so nearby seeds are unrelated.

    The first sample index is a position in the global sample stream, unique to one micro-batch of
    one rank; leaving the rank out makes the sampling independent of how many ranks there are."""
    digest = hashlib.blake2b(f"{run_seed}:{first_sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class PretrainModel(nn.Module):
    def __init__(
        self,
        encoder_config: EncoderConfig,
        objectives: Mapping[str, float],
        special_tokens: Mapping[str, int],
        objective_options: Mapping[str, Mapping[str, Any]] | None = None,
        seed: int = 0,
        kernels: str = "auto",
    ) -> None:
        """
        objectives: name -> loss weight (e.g. {"mlm": 1.0, "taco": 1.0}).
        special_tokens: {"pad", "cls", "sep", "mask", "unk"} -> token id (from the shard manifest).
        objective_options: name -> keyword arguments of that objective's constructor.
        Objectives are built as `OBJECTIVES[name](encoder_config, special_tokens, **options)`.
        """
        super().__init__()
        if not objectives:
            raise ValueError("objectives: at least one objective is required")
        unknown = sorted(set(objectives) - set(OBJECTIVES))
        if unknown:
            raise ValueError(f"objectives: unknown {unknown}; registered: {sorted(OBJECTIVES)}")
        self.config = encoder_config
        self.bert = BertEncoder(encoder_config)
        self.cls = MLMHead(encoder_config, self.bert.embeddings.word_embeddings)
        options = dict(objective_options or {})
        self.weights = dict(objectives)
        self.objectives = nn.ModuleDict(
            {name: OBJECTIVES[name](encoder_config, dict(special_tokens), **options.get(name, {})) for name in objectives}
        )
        self.special_tokens = dict(special_tokens)
        self.seed = seed
        self.kernels = kernels
        self.step = 0
        self.total_steps = 1
        init_bert_weights(self, encoder_config.initializer_range)
        for obj in self.objectives.values():
            reset = getattr(obj, "reset_parameters", None)
            if reset is not None:
                reset()

    @property
    def views(self) -> set[str]:
        """Union of the batch views the configured objectives need."""
        return {"original"}.union(*(o.views for o in self.objectives.values()))

    def set_progress(self, step: int, total_steps: int) -> None:
        """Called by the training loop before each step (CAPT's temperature depends on it)."""
        self.step, self.total_steps = step, total_steps

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        first = int(batch["sample_index"][0]) if "sample_index" in batch else self.step
        device = batch["input_ids"].device
        generator = torch.Generator(device=device)
        generator.manual_seed(micro_batch_seed(self.seed, first))
        ctx = StepContext(self, batch, self.step, self.total_steps, generator, self.kernels)
        total = torch.zeros((), device=device, dtype=torch.float32)
        metrics: dict[str, Tensor] = {}
        for name, objective in self.objectives.items():
            loss, parts = objective(ctx)
            total = total + self.weights[name] * loss.float()
            metrics[f"{name}/loss"] = loss.detach().float()
            metrics.update({f"{name}/{k}": v.detach().float() for k, v in parts.items()})
        metrics["loss"] = total.detach()
        return total, metrics

    def extra_state_for_checkpoint(self) -> dict:
        return {n: s for n, o in self.objectives.items() if (s := o.extra_state_for_checkpoint()) is not None}

    def load_extra_state_from_checkpoint(self, state: Mapping[str, dict]) -> None:
        for name, s in state.items():
            self.objectives[name].load_extra_state_from_checkpoint(s)
