"""Batch-size warm-up (`data.batch_warmup`, `pipeline.data.config.BatchRamp`): the global batch grows
in micro x world multiples (gradient-accumulation steps ramp), the reader serves the samples of the
run without warm-up in the same order, tokens-seen and consumed samples follow the ramp, a resume
mid-ramp is bitwise, and bad settings are refused before compute, naming the field."""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from pipeline.config.checks import ConfigError
from pipeline.config.run import check_run, load_config
from pipeline.data.config import BatchPlan, BatchRamp
from tests.train.runs import metric_rows, module_state, run_inprocess, tag_dir

#: micro 2, target 8 (accumulation 4), from 2 over the first 24 samples' token positions (24 x 64)
WARMUP = ["data.micro_batch_size=2", "data.global_batch_size=8",
          "data.batch_warmup=" + json.dumps({"start_global_batch_size": 2, "tokens": 24 * 64})]
STEPS = ["train.total_steps=10", "train.checkpoint_every=3", "train.keep_last=10"]
#: the ramp by hand: accumulation floor(1 + c / 8) at c consumed samples (clamped to 1..4), 4 once c x 64 >= 1536
GLOBAL = [2, 2, 2, 2, 4, 4, 6, 6, 8, 8]


def test_ramp_values():
    ramp = BatchRamp(start=2, tokens=24 * 64, seq_len=64, final=BatchPlan(2, 4, 1))
    consumed, sizes = 0, []
    for _ in range(10):
        plan = ramp.plan_at(consumed)
        assert plan.micro_batch_size == 2 and plan.world_size == 1
        sizes.append(plan.global_batch_size)
        consumed += plan.global_batch_size
    assert sizes == GLOBAL
    # two ranks: multiples of micro x world = 4, from 4 to 16
    two = BatchRamp(start=4, tokens=1000, seq_len=10, final=BatchPlan(2, 4, 2))
    assert [two.plan_at(c).global_batch_size for c in (0, 33, 34, 50, 75, 99, 100)] == [4, 4, 8, 8, 12, 12, 16]


def test_the_sample_sequence_is_the_run_without_warmup(tiny_shards_dir):
    """The reader as the loop reopens it at every change of split (`loop.open_batches` at the consumed
    count) yields the same samples, same rows, same order, as one reader without warm-up."""
    from pipeline.train.loop import build_run_model, open_batches

    base = [f"data.shards_dir={tiny_shards_dir}", "train.total_steps=10", "data.num_workers=0"]
    cfg = load_config("tiny-mlm", [*base, *WARMUP])
    plan = check_run(cfg, 1, False)
    model = build_run_model(cfg, plan)
    phase = plan.schedule.phases[0]
    consumed, warm_index, warm_ids, batches, split = 0, [], [], None, None
    for _ in range(10):
        batch = plan.schedule.batch_at(phase, consumed)
        if batch != split:
            split = batch
            batches = open_batches(cfg, dataclasses.replace(plan, batch=batch), model, 0, consumed, False,
                                   batches.dataset if batches else None)
        for _ in range(batch.grad_accum):
            micro = next(batches)
            warm_index.append(micro["sample_index"].numpy())
            warm_ids.append(micro["input_ids"].numpy())
        consumed += batch.global_batch_size
    assert consumed == sum(GLOBAL)

    plain_cfg = load_config("tiny-mlm", [*base, "data.micro_batch_size=2", "data.global_batch_size=8"])
    plain_plan = check_run(plain_cfg, 1, False)
    assert [(p.name, p.ramp) for p in plain_plan.schedule.phases] == [("", None)]  # one implicit phase, no ramp
    plain = open_batches(plain_cfg, plain_plan, model, 0, 0, False)
    plain_index, plain_ids = [], []
    while sum(len(i) for i in plain_index) < consumed:
        micro = next(plain)
        plain_index.append(micro["sample_index"].numpy())
        plain_ids.append(micro["input_ids"].numpy())
    assert np.array_equal(np.concatenate(warm_index), np.arange(consumed))
    assert np.array_equal(np.concatenate(warm_index), np.concatenate(plain_index))
    assert np.array_equal(np.concatenate(warm_ids), np.concatenate(plain_ids))  # same rows, same masking


@pytest.fixture(scope="module")
def reference(tiny_shards_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("warmup") / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS, *WARMUP) == 0
    return out


def test_a_run_follows_the_ramp(reference, tiny_shards_dir):
    rows = metric_rows(reference)
    assert [rows[s]["global_batch_size"] for s in range(1, 11)] == GLOBAL
    assert [rows[s]["consumed_samples"] for s in range(1, 11)] == list(np.cumsum(GLOBAL))
    from pipeline.data.reader import ShardDataset
    from pipeline.seeding import epoch_permutation

    dataset = ShardDataset(tiny_shards_dir, verify=False)
    order = epoch_permutation(1234, 0, len(dataset))
    ids, _ = dataset.take(order[: sum(GLOBAL)])
    pad = dataset.special_tokens["pad"]
    assert rows[10]["tokens_seen"] == int((ids != pad).sum())  # every consumed sample's tokens, once


@pytest.mark.parametrize("resume_step", [3, 6])
def test_resume_mid_ramp_is_bitwise(reference, tiny_shards_dir, tmp_path, resume_step):
    run = shutil.copytree(reference, tmp_path / "run")
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *STEPS, *WARMUP,
                         f"train.resume={tag_dir(run, resume_step)}") == 0
    assert metric_rows(run) == metric_rows(reference)
    final, expected = module_state(tag_dir(run, 10)), module_state(tag_dir(reference, 10))
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_refusals_name_the_field(tiny_shards_dir):
    base = [f"data.shards_dir={tiny_shards_dir}", "data.micro_batch_size=2", "data.global_batch_size=8"]

    def refused(warmup: dict, stage: int = 1) -> str:
        with pytest.raises(ConfigError) as err:
            cfg = load_config("tiny-mlm", [*base, "data.batch_warmup=" + json.dumps(warmup)])
            assert stage == 2, "stage-1 refusal expected"
            check_run(cfg, 1, False)
        return str(err.value)

    assert "data.batch_warmup.start: unknown key" in refused({"start": 2, "tokens": 10})
    assert "data.batch_warmup.tokens=None: must be a positive integer" in refused({"start_global_batch_size": 2})
    assert "must be below data.global_batch_size=8" in refused({"start_global_batch_size": 8, "tokens": 10})
    assert "data.batch_warmup.start_global_batch_size=3 is not a multiple of data.micro_batch_size=2" in refused(
        {"start_global_batch_size": 3, "tokens": 10}, stage=2)


def test_a_ramped_step_is_the_step_of_a_run_at_that_batch(reference, tiny_shards_dir, tmp_path):
    """Step 7 of the warm-up run (global 6: three micro-batches, after DeepSpeed's accumulation count
    changed from 1 to 2 to 3) equals step 7 of a run at global batch 6 from the same checkpoint: one
    update at the right boundary, the gradient averaged over the step's 6 samples (same loss and
    gradient norm, bit for bit)."""
    run = shutil.copytree(reference, tmp_path / "run")
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *STEPS, "data.micro_batch_size=2",
                         "data.global_batch_size=6", f"train.resume={tag_dir(run, 6)}",
                         "train.allow_config_change=true") == 0
    ramped, plain = metric_rows(reference)[7], metric_rows(run)[7]
    assert ramped["consumed_samples"] == plain["consumed_samples"] == 22
    for key in ("loss", "grad_norm", "lr", "tokens_seen"):
        assert ramped[key] == plain[key], key
    states = torch.load(tag_dir(reference, 10) / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert states["global_steps"] == 10 and states["global_samples"] == sum(GLOBAL)  # one update per step
