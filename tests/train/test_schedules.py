"""`optim.schedule` (issue 38): linear (today's, bit for bit), cosine and warmup-stable-decay with linear /
cosine / 1-sqrt decays — values at known steps, the refusals, and the check that a decay branched off
a stable-phase checkpoint changes no rate already trained (`pipeline.train.checkpoint.schedule_branch`)."""
from __future__ import annotations

import logging
from pathlib import Path
import math

import pytest

from pipeline.config.checks import ConfigError
from pipeline.train.run_config import load_config
from pipeline.train.optim import OptimConfig, decay_window, first_lr_change, lr_at
from pipeline.train.checkpoint.schedule_branch import schedule_branch


def rates(total: int, **fields) -> list[float]:
    cfg = OptimConfig(lr=1.0, warmup_steps=2, **fields)
    cfg.check()
    cfg.check_steps(total)
    return [lr_at(s, cfg, total) for s in range(1, total + 1)]


def test_linear_is_todays_formula_bit_for_bit():
    """The formula of commit e3c46db, copied: every step of several shapes of run, exactly."""
    def before(step, cfg, total):
        warmup = cfg.warmup_steps
        if step <= warmup:
            return cfg.lr * step / warmup
        span = max(1, total - warmup)
        remaining = min(1.0, max(0.0, (total - step + 1) / span))
        return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * remaining)

    for lr, warmup, ratio, total in [(1e-3, 2, 0.0, 20), (8e-4, 3000, 0.1, 400000), (3e-4, 0, 0.05, 7), (1e-4, 1, 0.0, 1)]:
        cfg = OptimConfig(lr=lr, warmup_steps=warmup, min_lr_ratio=ratio)
        steps = range(1 if warmup else 1, total + 3, max(1, total // 5000))
        assert all(lr_at(s, cfg, total) == before(s, cfg, total) for s in steps)


def test_values_at_known_steps():
    assert rates(10) == [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125]
    cosine = rates(10, schedule="cosine")
    assert cosine[:3] == [0.5, 1.0, 1.0] and cosine[6] == pytest.approx(0.5, abs=1e-15)  # a = 1/2 at step 7
    assert cosine[3] == pytest.approx((1 - math.cos(math.pi * 7 / 8)) / 2) and cosine[9] == pytest.approx((1 - math.cos(math.pi / 8)) / 2)
    wsd = rates(10, schedule="wsd", decay_steps=4)
    assert wsd == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25]
    cos_decay = rates(10, schedule="wsd", decay_steps=4, decay_shape="cosine")
    assert cos_decay[:7] == [0.5] + [1.0] * 6 and cos_decay[8] == pytest.approx(0.5, abs=1e-15)
    assert cos_decay[7] == pytest.approx((1 - math.cos(math.pi * 3 / 4)) / 2)
    sqrt_decay = rates(10, schedule="wsd", decay_steps=4, decay_shape="1-sqrt")
    assert sqrt_decay[:7] == [0.5] + [1.0] * 6
    assert sqrt_decay[7:] == pytest.approx([1 - math.sqrt(0.25), 1 - math.sqrt(0.5), 1 - math.sqrt(0.75)])
    # decay as a fraction of the run: round(0.2 * 20) = 4 steps, 17..20
    assert decay_window(OptimConfig(schedule="wsd", decay_fraction=0.2, warmup_steps=2), 20) == (16, 4)
    frac = rates(20, schedule="wsd", decay_fraction=0.2)
    assert frac[15] == 1.0 and frac[16:] == [1.0, 0.75, 0.5, 0.25]
    # min_lr_ratio is the floor of every decay: r + (1 - r) f
    floor = rates(10, schedule="wsd", decay_steps=4, decay_shape="1-sqrt", min_lr_ratio=0.1)
    assert floor[9] == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.75)))
    # wsd with the decay over every post-warm-up step is the linear / cosine schedule
    assert rates(10, schedule="wsd", decay_steps=8) == rates(10)
    assert rates(10, schedule="wsd", decay_steps=8, decay_shape="cosine") == rates(10, schedule="cosine")
    for values in (cosine, sqrt_decay, frac):  # monotone after the peak, never 0 on a trained step
        peak = values.index(1.0)
        assert all(a >= b > 0 for a, b in zip(values[peak:], values[peak + 1:]))


@pytest.mark.parametrize("overrides, message", [
    (["optim.schedule=step"], r"optim.schedule"),
    (["optim.schedule=wsd", "optim.decay_shape=sqrt"], r"optim.decay_shape"),
    (["optim.schedule=wsd", "optim.decay_fraction=0"], r"optim.decay_fraction=0.*\(0, 1\]"),
    (["optim.schedule=wsd", "optim.decay_steps=-1"], r"optim.decay_steps"),
    (["optim.decay_steps=5"], r"optim.decay_steps=5 applies to optim.schedule=wsd only"),
    (["optim.schedule=cosine", "optim.decay_shape=1-sqrt"], r"optim.decay_shape='1-sqrt' applies to optim.schedule=wsd"),
    (["optim.schedule=wsd", "optim.decay_steps=19"], r"optim.decay_steps=19: the WSD decay would start at step 2, inside the warm-up"),
    (["optim.schedule=wsd", "optim.decay_fraction=1.0"], r"optim.decay_fraction=1.0 \(20 steps\)"),
    (["optim.name=stable_adamw", "optim.impl=deepspeed"], r"optim.impl=deepspeed has no StableAdamW"),
    (["optim.warmup_steps=20"], r"optim.warmup_steps=20 must be < train.total_steps=20"),
])
def test_refusals_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny-mlm", ["data.shards_dir=/nowhere", *overrides])


def config(total: int, **optim) -> dict:
    cfg = load_config("tiny-mlm", ["data.shards_dir=/nowhere", f"train.total_steps={total}",
                                   *(f"optim.{k}={v}" for k, v in optim.items())])
    return cfg.to_dict()


def test_branch_of_a_stable_checkpoint_is_accepted_only_when_no_trained_rate_changes():
    stable = config(20, schedule="wsd", decay_steps=4)  # stable through step 16
    # a longer run, the decay moved later: every rate through step 10 is the same
    assert schedule_branch(stable, config(30, schedule="wsd", decay_steps=4), 10) == (True, "")
    assert schedule_branch(stable, config(20, schedule="wsd", decay_steps=8, decay_shape="1-sqrt"), 12) == (True, "")
    assert schedule_branch(stable, config(24, schedule="wsd", decay_fraction=0.25), 16) == (True, "")  # 18 + 6
    # the decay would run steps 13-20 (13 still at the peak), but step 14 was trained at the peak: refused
    ok, why = schedule_branch(stable, config(20, schedule="wsd", decay_steps=8), 14)
    assert not ok and "changes the learning rate of step 14, already trained (1.000000e-03 -> 8.750000e-04)" in why
    # a changed peak changes the warm-up's rates at once
    ok, why = schedule_branch(stable, config(30, schedule="wsd", decay_steps=4, lr=0.002), 10)
    assert not ok and "step 1" in why
    # not only a schedule change: no verdict (the usual refusal)
    other = load_config("tiny-mlm", ["data.shards_dir=/nowhere", "train.total_steps=30", "optim.schedule=wsd",
                                     "optim.decay_steps=4", "optim.weight_decay=0.1"]).to_dict()
    assert schedule_branch(stable, other, 10) == (False, "")
    # a new total read elsewhere (CAPT's t/T temperature) is refused with the reason
    capt = load_config("tiny-capt", ["data.shards_dir=/nowhere", "optim.schedule=wsd", "optim.decay_steps=4"]).to_dict()
    longer = load_config("tiny-capt", ["data.shards_dir=/nowhere", "optim.schedule=wsd", "optim.decay_steps=4",
                                       "train.total_steps=40"]).to_dict()
    ok, why = schedule_branch(capt, longer, 10)
    assert not ok and "objectives.capt" in why


def test_a_checkpoint_written_before_the_schedule_fields_resumes_as_linear():
    today = config(20)
    before = {**today, "optim": {k: v for k, v in today["optim"].items()
                                 if k not in ("schedule", "decay_shape", "decay_steps", "decay_fraction")}}
    assert schedule_branch(before, today, 10) == (True, "")


def test_first_lr_change_is_exact():
    a = OptimConfig(lr=1e-3, warmup_steps=2, schedule="wsd", decay_steps=4)
    assert first_lr_change(a, 20, a, 21, 17) is None  # the peak through 17 in both (17: the first decay step of T=20)
    assert first_lr_change(a, 20, a, 21, 18) == 18
    linear = OptimConfig(lr=1e-3, warmup_steps=2)  # extending a linear run re-stretches its decay from step 4 on
    assert first_lr_change(linear, 20, linear, 21, 3) is None and first_lr_change(linear, 20, linear, 21, 4) == 4


WSD = ["optim.schedule=wsd", "train.checkpoint_every=2", "train.keep_last=10"]


def test_a_decay_branched_off_a_stable_checkpoint_equals_the_same_decay_in_one_run(tiny_shards_dir, tmp_path, capsys,
                                                                                  caplog):
    """A stable run (8 steps, decay 7-8) branched at its step-6 checkpoint into a 10-step run decaying
    over steps 7-10, without `train.allow_config_change`: bit for bit the 10-step run done in one go."""
    from pipeline.train.run_meta import RunMeta
    from tests.train.runs import metric_rows, module_state, run_inprocess, tag_dir

    stable, one_run, branched = tmp_path / "stable", tmp_path / "one_run", tmp_path / "branched"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, stable, *WSD, "train.total_steps=8", "optim.decay_steps=2") == 0
    assert run_inprocess("tiny-mlm", tiny_shards_dir, one_run, *WSD, "train.total_steps=10", "optim.decay_steps=4") == 0
    meta = RunMeta.read(tag_dir(stable, 6))  # the checkpoint records the schedule it was trained under
    assert {k: meta.config["optim"][k] for k in ("schedule", "decay_steps", "decay_shape")} == \
        {"schedule": "wsd", "decay_steps": 2, "decay_shape": "linear"}

    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        assert run_inprocess("tiny-mlm", tiny_shards_dir, branched, *WSD, "train.total_steps=10", "optim.decay_steps=4",
                             f"train.resume={tag_dir(stable, 6)}") == 0
    assert "on a new LR schedule from step 7" in caplog.text and "despite changes" not in caplog.text
    expected, got = metric_rows(one_run), metric_rows(branched)
    assert sorted(got) == [7, 8, 9, 10]
    for step in got:
        assert got[step] == expected[step], f"step {step} differs"
    assert [expected[s]["lr"] for s in (6, 7, 8, 9, 10)] == [1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4]
    assert metric_rows(stable)[8]["lr"] == 5e-4  # the stable run's own decay differed from step 8 on
    final, again = module_state(tag_dir(one_run, 10)), module_state(tag_dir(branched, 10))
    assert final.keys() == again.keys() and all(torch_equal(final[k], again[k]) for k in final)

    # a decay that would have started before the checkpoint's step: refused, naming the step
    refused = tmp_path / "refused"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, refused, *WSD, "train.total_steps=10", "optim.decay_steps=6",
                         f"train.resume={tag_dir(stable, 6)}") == 2
    err = capsys.readouterr().err
    assert "optim.decay_steps: 2 -> 6" in err and "changes the learning rate of step 6, already trained" in err
    assert "train.allow_config_change=true" in err


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_a_wsd_branch_of_a_weight_only_mixture_is_a_schedule_change(tmp_path: Path) -> None:
    """Issue 49: a WSD decay branched off a weight-only mixture was refused with "train.total_steps also
    shapes data.sources"; weights set a per-block interleave whatever the run's length, so only token
    budgets (a share of total_steps x batch) make a new total more than an LR change."""
    from pipeline.train.run_config import load_config
    from pipeline.train.checkpoint.schedule_branch import schedule_branch

    def config(total: int, sources: str) -> dict:
        return load_config("tiny-mlm", [f"train.total_steps={total}", "optim.schedule=wsd", "optim.decay_steps=4",
                                        "optim.warmup_steps=2", "data.shards_dir=", f"data.sources={sources}"]).to_dict()

    weights = f"[{{path: {tmp_path / 'a'}, weight: 3}}, {{path: {tmp_path / 'b'}, weight: 1}}]"
    accepted, reason = schedule_branch(config(10, weights), config(20, weights), 6)
    assert accepted, reason
    budgets = f"[{{path: {tmp_path / 'a'}, tokens: 5000}}, {{path: {tmp_path / 'b'}, weight: 1}}]"
    accepted, reason = schedule_branch(config(10, budgets), config(20, budgets), 6)
    assert not accepted and "train.total_steps also shapes data.sources token budgets" in reason
