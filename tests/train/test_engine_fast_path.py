"""DeepSpeed settings of the fast path: fp32 gradient accumulation for bf16 (accepted by the
installed DeepSpeed's own config parser), no `overlap_comm` in ZeRO-1/2 engine files (it makes
the engine synchronise the device every micro-batch, ds_configs/README.md), ZeRO-1 in the large
presets, and the TF32 switch."""
from __future__ import annotations

import json

import pytest
import torch

from ds_configs import ENGINE_DIR
from pipeline.config.run import load_config
from pipeline.data.config import BatchPlan
from pipeline.train.engine import build_deepspeed_config, restore_tf32, set_tf32


@pytest.mark.parametrize("precision, expected", [("bf16", "fp32"), ("fp16", None), ("fp32", None)])
def test_bf16_accumulates_gradients_in_fp32_as_deepspeed_reads_it(precision, expected):
    from deepspeed.runtime.config import DeepSpeedConfig

    engine = json.loads((ENGINE_DIR / "zero1.json").read_text())
    ds = build_deepspeed_config(engine, BatchPlan(4, 2, 1), precision, 1.0)
    assert DeepSpeedConfig(ds).grad_accum_dtype == expected
    # an explicit choice in the engine file / deepspeed.extra wins
    engine["data_types"] = {"grad_accum_dtype": "bf16"}
    assert build_deepspeed_config(engine, BatchPlan(4, 2, 1), "bf16", 1.0)["data_types"] == {"grad_accum_dtype": "bf16"}


def test_no_zero12_engine_file_overlaps_communication():
    for path in sorted(ENGINE_DIR.glob("*.json")):
        zero = json.loads(path.read_text()).get("zero_optimization", {})
        if zero.get("stage", 0) in (1, 2):
            assert zero.get("overlap_comm", False) is False, path.name


@pytest.mark.parametrize("preset", ["capt-large", "cocolm-large", "infoword-large"])
def test_large_presets_use_zero1(preset):
    assert load_config(preset).deepspeed.config == "zero1"


def test_tf32_must_be_a_boolean():
    from pipeline.config.checks import ConfigError

    with pytest.raises(ConfigError, match=r"deepspeed.tf32: expected bool, got 'sometimes'"):
        load_config("tiny-mlm", ["deepspeed.tf32=sometimes"])


def test_tf32_switch_is_on_by_default_and_restored():
    assert load_config("tiny-mlm").deepspeed.tf32 is True
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    previous = set_tf32(True)
    assert previous == before
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    set_tf32(False)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    restore_tf32(previous)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
