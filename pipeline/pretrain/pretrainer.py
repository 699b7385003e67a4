"""`PretrainModel`: encoder + MLM head + the configured objectives, as one `nn.Module`.

This is what DeepSpeed wraps. `forward(batch, progress, sampling_seed)` returns `(loss, metrics)`
with `loss = sum_k weight_k * loss_k` over the configured objectives, plus the representation-health
metrics of `pipeline.monitor.health.step_health` (read from the encoder outputs the step already has). State-dict keys of the encoder
and MLM head are exactly `BertForMaskedLM`'s (`bert.*`, `cls.*`); objective-only heads live
under `objectives.<name>.*`.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np
import torch
from torch import Tensor, nn

from pipeline import seeding
from pipeline.data.batch import STRUCTURE_TOKENS, special_ids
from pipeline.monitor.health import step_health, unigram_log_probs
from pipeline.model.arch import AnyEncoderConfig, build_encoder_and_head, configure_stacks, init_weights
from pipeline.model.checkpointing import checkpoint_period
from pipeline.objectives.base import StepContext, StepProgress
from pipeline.objectives.registry import build_objective


class PretrainModel(nn.Module):
    def __init__(
        self,
        encoder_config: AnyEncoderConfig,
        objectives: Mapping[str, float],
        special_tokens: Mapping[str, int],
        objective_options: Mapping[str, Mapping[str, Any]] | None = None,
        seed: int = 0,
        kernels: str = "auto",
        attention: str = "auto",
        compile_layers: bool = False,
        activation_checkpointing: str = "none",
    ) -> None:
        """
        objectives: name -> loss weight (e.g. {"mlm": 1.0, "taco": 1.0}).
        special_tokens: {"pad", "cls", "sep", "mask", "unk"} -> token id (from the shard manifest).
        objective_options: name -> keyword arguments of that objective's constructor.
        seed: the run seed (objective sampling streams derive from it, `pipeline.seeding`).
        attention / compile_layers: `model.attention` and `model.compile` for every layer stack
        (the encoder's and any objective's generator), `pipeline.model.encoder.configure_layer_stacks`.
        activation_checkpointing: `model.activation_checkpointing` (`none`, `all` or k: every k-th layer of
        every stack; `pipeline.model.checkpointing`).
        """
        super().__init__()
        if not objectives:
            raise ValueError("objectives: at least one objective is required")
        self.config = encoder_config
        # `model.arch` (`pipeline.model.arch`): BERT, or ModernBERT under the same `bert` / `cls` slots
        self.bert, self.cls = build_encoder_and_head(encoder_config)
        options = dict(objective_options or {})
        self.weights = dict(objectives)
        self.objectives = nn.ModuleDict(
            {name: build_objective(name, encoder_config, special_tokens, options.get(name, {})) for name in objectives}
        )
        self.special_tokens = dict(special_tokens)
        self.seed = seed
        self.kernels = kernels
        # On the model's device from the start (moves with it, never saved): a host list turned into a
        # device tensor every step would be a host-to-device copy, and a sync, inside the step.
        self.register_buffer("structure_ids", torch.tensor(special_ids(special_tokens, STRUCTURE_TOKENS)),
                             persistent=False)
        #: most frequent training token (`health/unigram_accuracy`); set by the training loop, None: not logged
        self.health_top_token: Optional[int] = None
        #: log q [V] of the smoothed unigram distribution (`health/unigram_entropy`); a non-persistent buffer
        #: so it moves with the model (a host tensor indexed on the device would be a copy in the step)
        self.register_buffer("health_log_unigram", None, persistent=False)
        init_weights(self, encoder_config)
        for obj in self.objectives.values():
            reset = getattr(obj, "reset_parameters", None)
            if reset is not None:
                reset()
        period = checkpoint_period(activation_checkpointing, encoder_config.num_layers)
        configure_stacks(self, encoder_config, attention, compile_layers, period)

    def set_health_unigram(self, counts: np.ndarray) -> None:
        """The unigram references of the health metrics from the shards' token counts
        (`pipeline.monitor.health.unigram_counts`): the plateau's top token and the entropy's log q."""
        self.health_top_token = int(counts.argmax())
        device = self.structure_ids.device
        self.health_log_unigram = unigram_log_probs(counts).float().to(device)

    @property
    def views(self) -> set[str]:
        """Union of the batch views the configured objectives need."""
        return {"original"}.union(*(o.views for o in self.objectives.values()))

    def host_plans(self) -> list[Any]:
        """The objectives' `host_plan`s, for the collator (`CorruptionCollator(plans=...)`)."""
        return [plan for o in self.objectives.values() if (plan := o.host_plan) is not None]

    def forward(self, batch: dict[str, Tensor], progress: Optional[StepProgress] = None,
                sampling_seed: Optional[int] = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Weighted sum of the objectives' losses on one micro-batch.

        progress: the optimizer step (CAPT's temperature); sampling_seed: the micro-batch's sampling
        stream (`pipeline.seeding.sampling_seed`). The training loop computes it on the host before
        the batch moves to the device; when omitted it is derived here from `sample_index`.
        """
        if sampling_seed is None:
            first = int(batch["sample_index"][0]) if "sample_index" in batch else 0
            sampling_seed = seeding.sampling_seed(self.seed, first)
        device = batch["input_ids"].device
        generator = seeding.sampling_generator(sampling_seed, device)
        ctx = StepContext(self.bert, self.cls, batch, progress or StepProgress(), generator, self.kernels)
        total = torch.zeros((), device=device, dtype=torch.float32)
        metrics: dict[str, Tensor] = {}
        for name, objective in self.objectives.items():
            loss, parts = objective(ctx)
            total = total + self.weights[name] * loss.float()
            metrics[f"{name}/loss"] = loss.detach().float()
            metrics.update({f"{name}/{k}": v.detach().float() for k, v in parts.items()})
        if ctx.progress.record_metrics:  # health reads fp32 copies of hidden states: logged steps only
            metrics.update(step_health(ctx.cached_outputs(), {**batch, **ctx.private_inputs}, self.structure_ids,
                                       self.health_top_token, self.health_log_unigram))
        metrics["loss"] = total.detach()
        return total, metrics

    def extra_state_for_checkpoint(self) -> dict:
        return {n: s for n, o in self.objectives.items() if (s := o.extra_state_for_checkpoint()) is not None}

    def load_extra_state_from_checkpoint(self, state: Mapping[str, dict]) -> None:
        for name, s in state.items():
            self.objectives[name].load_extra_state_from_checkpoint(s)
