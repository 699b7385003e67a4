"""Class: a configured setting that silently does nothing. The ModernBERT presets' weight decay
(1e-5 under AdamW's rate-scaled convention: 8e-4 x 1e-5 = 8e-9 per step, and 1 - 8e-9 == 1.0 in
float32) left every weight bitwise unchanged; `optim.decoupled_wd` offers ModernBERT's fully
decoupled convention, the presets use it, and a decay too small for float32 is warned about
before compute."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

from pipeline.config.checks import ConfigError
from pipeline.train.run_config import load_config
from pipeline.train.optim import (OptimConfig, build_optimizer, group_weight_decay, ineffective_decay_warning,
                                  param_groups, warn_ineffective_decay)


def zero_gradient_steps(cfg: OptimConfig, steps: int = 50) -> tuple[dict, dict]:
    """(weights before, after) `steps` optimizer steps at the peak rate with all-zero gradients:
    only the weight decay can move a weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    optimizer = build_optimizer(model, cfg, "cpu")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
    return before, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("preset", ["modernbert-base", "modernbert-large", "modernbert-long", "modernbert-tiny"])
def test_the_modernbert_presets_weight_decay_moves_the_weights(preset):
    cfg = load_config(preset).optim
    assert cfg.decoupled_wd and cfg.weight_decay == 1e-5
    before, after = zero_gradient_steps(cfg)
    # the matrix decays by (1 - 1e-5) per step, ModernBERT's rate at the peak; biases / LayerNorm do not decay
    expected = before["0.weight"] * (1 - 1e-5) ** 50
    torch.testing.assert_close(after["0.weight"], expected, rtol=5e-6, atol=0)  # 50 roundings; decay 5e-4
    assert not torch.equal(after["0.weight"], before["0.weight"])
    assert torch.equal(after["0.bias"], before["0.bias"]) and torch.equal(after["1.weight"], before["1.weight"])
    assert ineffective_decay_warning(cfg) is None


def test_the_old_preset_setting_changed_nothing_and_is_warned_about(caplog):
    old = dataclasses.replace(load_config("modernbert-base").optim, decoupled_wd=False)
    before, after = zero_gradient_steps(old)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the silent no-op the issue found
    with caplog.at_level(logging.WARNING, logger="pipeline.train.optim"):
        warn_ineffective_decay(old)
    assert [r.getMessage() for r in caplog.records] == [
        "optim.weight_decay=1e-05 does nothing: the decay per step at the peak rate (lr x weight_decay = 0.0008 x "
        "1e-05 = 8e-09) is below float32's resolution at 1 (2.98e-08), so 1 - it == 1.0 and float32 weights never "
        "change by it; raise it, or set optim.decoupled_wd=true (decay λ per step)"]


def test_the_warning_threshold_is_float32s_half_ulp_below_one():
    at = OptimConfig(lr=1.0, weight_decay=2.0 ** -25)  # 1 - 2^-25 is a tie: rounds to even, 1.0
    above = OptimConfig(lr=1.0, weight_decay=2.0 ** -24)  # 1 - 2^-24 is float32's next value below 1
    assert ineffective_decay_warning(at) is not None and ineffective_decay_warning(above) is None
    assert ineffective_decay_warning(OptimConfig(lr=1.0, weight_decay=2.0 ** -25, decoupled_wd=True)) is not None
    assert ineffective_decay_warning(OptimConfig(lr=1e-9, weight_decay=1e-5, decoupled_wd=True)) is None
    assert ineffective_decay_warning(OptimConfig(weight_decay=0.0)) is None  # no decay asked for: nothing to warn


def test_the_warning_is_given_before_compute_by_check_run(tiny_shards_dir, caplog):
    from pipeline.train.run_config import check_run

    cfg = load_config("tiny-mlm", [f"data.shards_dir={tiny_shards_dir}", "optim.weight_decay=1e-6",
                                   "optim.lr=1e-3"])
    with caplog.at_level(logging.WARNING, logger="pipeline.train.optim"):
        check_run(cfg, world_size=1, cuda_available=False)
    assert any("optim.weight_decay=1e-06 does nothing" in r.getMessage() for r in caplog.records)


def test_the_adamw_default_is_bitwise_unchanged():
    """decoupled_wd defaults to false: the groups get λ itself, and the steps are torch AdamW's with λ."""
    cfg = OptimConfig(lr=1e-3, weight_decay=0.01)
    assert not cfg.decoupled_wd and group_weight_decay(cfg) == 0.01
    torch.manual_seed(1)
    model = nn.Linear(8, 8)
    reference = nn.Linear(8, 8)
    reference.load_state_dict(model.state_dict())
    ours = build_optimizer(model, cfg, "cpu")
    theirs = torch.optim.AdamW(param_groups(reference, 0.01), lr=1e-3, betas=cfg.betas, eps=cfg.eps)
    for step in range(5):
        grads = [torch.randn_like(p) for p in model.parameters()]
        for p, q, g in zip(model.parameters(), reference.parameters(), grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_decoupled_decay_is_lambda_times_the_schedule_multiplier():
    cfg = OptimConfig(lr=8e-4, weight_decay=1e-5, decoupled_wd=True)
    assert group_weight_decay(cfg) * cfg.lr == pytest.approx(1e-5, rel=1e-15)  # λ at the peak
    assert group_weight_decay(cfg) * cfg.lr / 2 == pytest.approx(5e-6, rel=1e-15)  # half the rate: half λ


def test_decoupled_decay_with_lamb_is_refused():
    with pytest.raises(ConfigError, match=r"^optim.decoupled_wd=true: LAMB"):
        OptimConfig(name="lamb", decoupled_wd=True).check()
