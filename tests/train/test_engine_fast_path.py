"""DeepSpeed settings of the fast path: fp32 gradient accumulation for bf16 (accepted by the
installed DeepSpeed's own config parser, and honoured by its engine at every ZeRO stage: measured),
no `overlap_comm` in ZeRO-1/2 engine files (it makes the engine synchronise the device every
micro-batch, ds_configs/README.md), ZeRO-1 in every large preset, and the TF32 switch."""
from __future__ import annotations

import json

import pytest
import torch

from ds_configs import ENGINE_DIR
from pipeline.config.loader import available_presets
from pipeline.train.run_config import load_config
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


#: every preset with "-large" in its name (found, not listed: a new large preset is covered at once)
LARGE_PRESETS = sorted(p for p in available_presets() if "-large" in p)


def test_every_large_preset_is_found():
    assert {"capt-large", "cocolm-large", "infoword-large", "mlm-capt-large", "modernbert-large",
            "modernbert-large-24"} <= set(LARGE_PRESETS)


@pytest.mark.parametrize("preset", LARGE_PRESETS)
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


#: 16 micro-batches: the first contributes a gradient of 1, the other 15 contribute 2^-8 each — below half
#: of bf16's spacing at 1 (2^-7), so a bf16 running sum drops every one of them.
ACCUM, SMALL = 16, 2.0 ** -8


def _accumulated_gradients(rank: int, out_path: str) -> None:
    """Per engine file and bf16 grad-accumulation setting: the gradient the optimizer applied after
    ACCUM micro-batches (plain SGD, lr 1: the update is the accumulated gradient)."""
    import os

    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="1")  # DeepSpeed reads them
    results = {}
    for name in ("zero1", "zero2", "zero3"):
        for accum_dtype in ("fp32", "bf16"):
            engine_file = json.loads((ENGINE_DIR / f"{name}.json").read_text())
            engine_file["data_types"] = {"grad_accum_dtype": accum_dtype}
            ds = build_deepspeed_config(engine_file, BatchPlan(1, ACCUM, 1), "bf16", 0.0)
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1, bias=False)
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
            before = safe_get_full_fp32_param(engine.module.weight).detach().clone()
            for micro in range(ACCUM):
                x = torch.zeros(1, 4, dtype=torch.bfloat16)
                # DeepSpeed scales each micro-batch's loss by 1 / ACCUM: d(loss)/dw_0 = x_0 / ACCUM
                x[0, 0] = ACCUM * (1.0 if micro == 0 else SMALL)
                engine.backward(engine(x).sum())
                engine.step()
            after = safe_get_full_fp32_param(engine.module.weight).detach()
            results[f"{name} {accum_dtype}"] = float(before[0, 0] - after[0, 0])
            engine.destroy()
    with open(out_path, "w") as f:
        json.dump(results, f)


@pytest.mark.slow
def test_installed_deepspeed_accumulates_bf16_gradients_in_fp32_at_every_zero_stage(tmp_path):
    """What `build_deepspeed_config`'s `data_types.grad_accum_dtype: fp32` does in the installed
    DeepSpeed, measured: at ZeRO-1, 2 and 3 the small micro-batch gradients survive the sum (ZeRO-1's
    BF16_Optimizer sums in fp32 and rounds the sum to bf16 once, for its reduction; ZeRO-2/3 keep the
    fp32 sum exactly), and with bf16 accumulation every one of them is lost — so the setting is
    honoured by every stage, not only ZeRO-1 (ds_configs/README.md)."""
    from tests.gloo_ranks import spawn_gloo_ranks

    out = tmp_path / "grads.json"
    spawn_gloo_ranks(_accumulated_gradients, 1, str(out))
    applied = json.loads(out.read_text())
    exact = 1.0 + (ACCUM - 1) * SMALL
    for name in ("zero1", "zero2", "zero3"):
        assert applied[f"{name} bf16"] == 1.0, applied  # bf16 running sum: 1 + 2^-8 rounds back to 1
        assert abs(applied[f"{name} fp32"] - exact) <= 2.0 ** -8, applied  # within half a bf16 step of 1.06
    assert applied["zero2 fp32"] == pytest.approx(exact, abs=1e-6) and applied["zero3 fp32"] == pytest.approx(exact, abs=1e-6)
