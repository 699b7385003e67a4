"""`deepspeed.*`: the engine settings file, precision and extra engine keys, and the one place the
final DeepSpeed JSON is assembled (`build_deepspeed_config`).

Engine files (`ds_configs/<name>.json`, shipped as package data) hold ZeRO stage, buckets, offload
and communication settings only; batch sizes, clipping, optimizer and precision belong to the run
config (`RUN_OWNED_ENGINE_KEYS`), so one recipe runs under any engine file unchanged.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ds_configs import ENGINE_DIR
from pipeline.config.checks import ConfigError, check_choice, did_you_mean
from pipeline.data.config import BatchPlan

PRECISIONS = ("fp32", "bf16", "fp16")

#: DeepSpeed keys that belong to the run config, never to an engine file.
RUN_OWNED_ENGINE_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer",
    "scheduler",
    "bf16",
    "fp16",
)

#: fp16 dynamic loss scaling (DeepSpeed's defaults, spelled out); an engine file may override
#: any of these under `fp16_loss_scaling`.
FP16_LOSS_SCALING = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                     "min_loss_scale": 1}


@dataclass
class DeepSpeedConfig:
    config: str = "zero1"
    """Engine settings: a name in `ds_configs/` (zero1, zero2, zero3, zero3-offload) or a JSON path."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (fp16 uses DeepSpeed's dynamic loss scaling)."""
    extra: dict = field(default_factory=dict)
    """Engine keys deep-merged over the engine file (e.g. `{zero_optimization: {reduce_bucket_size: 5e7}}`)."""
    tf32: bool = True
    """TF32 tensor cores for the fp32 matmuls and convolutions that remain on CUDA (the fp32 losses,
    an fp32 run): ~8x the fp32 matmul rate of an A100/H100 at a 10-bit mantissa, which the
    contrastive logits (fp32 for their range, not for their last digits) do not need. No effect on
    the CPU."""

    def check(self) -> None:
        """Stage-1 checks (the config alone)."""
        check_choice(self.precision, PRECISIONS, "deepspeed.precision")

    def stage_source(self) -> str:
        """The setting the ZeRO stage comes from, for error messages: `deepspeed.extra` when it
        overrides `zero_optimization.stage`, else the engine file."""
        if "stage" in (self.extra.get("zero_optimization") or {}):
            return (f"deepspeed.extra.zero_optimization.stage={self.extra['zero_optimization']['stage']!r} "
                    f"(over deepspeed.config={self.config})")
        return f"deepspeed.config={self.config}"

    def load_engine(self, cuda: bool) -> dict:
        """Stage 2: the engine file + `extra`, checked (valid JSON, no run-owned keys, ZeRO stage 0-3,
        precision and offload usable on this machine)."""
        path = resolve_engine_file(self.config)
        try:
            engine = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: invalid JSON ({err})") from err
        engine = _deep_merge(engine, self.extra)
        source = f"{path} (+ deepspeed.extra)" if self.extra else str(path)
        owned = [k for k in RUN_OWNED_ENGINE_KEYS if k in engine]
        if owned:
            raise ConfigError(f"{source}: {owned} belong to the run config (data.*, optim.*, deepspeed.precision), "
                              "not to engine settings; remove them")
        stage = engine.get("zero_optimization", {}).get("stage", 0)
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"{self.stage_source()}: zero_optimization.stage={stage!r}; DeepSpeed ZeRO stages are "
                              "0, 1, 2, 3")
        if self.precision in ("bf16", "fp16") and not cuda:
            raise ConfigError(f"deepspeed.precision={self.precision} needs a GPU; use deepspeed.precision=fp32 on CPU")
        zero = engine.get("zero_optimization", {})
        if not cuda and any(zero.get(k, {}).get("device", "none") != "none" for k in ("offload_optimizer", "offload_param")):
            raise ConfigError(f"deepspeed.config={self.config}: CPU offload needs a GPU run; use zero3 on CPU")
        return engine


def set_tf32(enabled: bool) -> tuple[bool, bool]:
    """Switch TF32 for CUDA fp32 matmuls and cuDNN convolutions (`deepspeed.tf32`); returns the previous
    (matmul, cudnn) settings, for `restore_tf32`."""
    previous = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return previous


def restore_tf32(previous: tuple[bool, bool]) -> None:
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def resolve_engine_file(name_or_path: str) -> Path:
    """An engine name (`zero2`) or a JSON path -> the file; clear error with suggestions."""
    path = Path(name_or_path)
    if path.suffix == ".json" or os.sep in name_or_path:
        if not path.is_file():
            raise ConfigError(f"deepspeed.config={name_or_path}: no such file")
        return path
    candidate = ENGINE_DIR / f"{name_or_path}.json"
    if not candidate.is_file():
        names = sorted(p.stem for p in ENGINE_DIR.glob("*.json"))
        raise ConfigError(f"deepspeed.config={name_or_path!r}: no {candidate}{did_you_mean(name_or_path, names)}; "
                          f"available: {names}")
    return candidate


def zero_stage_of(engine: dict) -> int:
    return int(engine.get("zero_optimization", {}).get("stage", 0))


def optimizer_offloaded(engine: dict) -> bool:
    return engine.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"


def _deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_deepspeed_config(engine: dict, batch: BatchPlan, precision: str, grad_clip: float,
                           load_universal: bool = False) -> dict:
    """The final DeepSpeed JSON: engine settings + the run's batch sizes, clipping and precision."""
    out = copy.deepcopy(engine)
    fp16_scaling = {**FP16_LOSS_SCALING, **out.pop("fp16_loss_scaling", {})}
    out.update(
        train_batch_size=batch.global_batch_size,
        train_micro_batch_size_per_gpu=batch.micro_batch_size,
        gradient_accumulation_steps=batch.grad_accum,
        gradient_clipping=grad_clip,
        zero_allow_untested_optimizer=True,  # torch AdamW on CPU / apex optimizers
        steps_per_print=2**31 - 1,  # our metrics writer logs; keep DeepSpeed quiet
    )
    out["bf16"] = {"enabled": precision == "bf16"}
    if precision == "bf16":
        # Gradients accumulate over micro-batches in fp32, not bf16 (8-bit mantissa: a sum of 8+
        # micro-batches loses the small ones). DeepSpeed 0.19.8 honours it at ZeRO-0/1 (BF16_Optimizer's
        # fp32 buffers) and ZeRO-2/3 (fp32 gradient partitions): measured in
        # tests/train/test_engine_fast_path.py. `deepspeed.extra.data_types` overrides it.
        out.setdefault("data_types", {"grad_accum_dtype": "fp32"})
    out["fp16"] = {"enabled": precision == "fp16", **(fp16_scaling if precision == "fp16" else {})}
    if load_universal:
        out.setdefault("checkpoint", {})["load_universal"] = True
    return out
