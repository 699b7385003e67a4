"""Our MLM trains like `transformers.BertForMaskedLM`: the real `pipeline.train` MLM and `BertForMaskedLM` in a
plain loop agree step for step from the same weights and batches, and the comparison catches a real training
difference. The arms (`mlm_vs_hf_arms.py`, beside this file) were the retired benchmark
`benchmarks/throughput/mlm_vs_hf.py` (its 250-step results: benchmarks/results/mlm_vs_hf.*, commit 5ba4f69)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.mlm_vs_hf_arms import agree, compare, recipe_overrides, run_pipeline, train_hf

STEPS = 5
#: A model small enough for seconds on one core; dropout off (HF and our layers draw dropout masks
#: in different orders, so with it on equal models would not give equal losses); micro-batch 4 of 8
#: per step, so gradient accumulation is compared too.
TINY = ("model.size=tiny", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.ffn_size=64",
        "data.global_batch_size=8", "data.micro_batch_size=4", "optim.lr=2e-3", "train.deterministic=true")


@pytest.mark.timeout(120)
def test_arms_agree_and_a_changed_lr_or_init_is_detected(tmp_path: Path, tiny_shards_dir: Path) -> None:
    overrides = recipe_overrides(tiny_shards_dir, 7, STEPS, tmp_path / "run", TINY)
    ours = run_pipeline(overrides, tmp_path / "run")
    assert [r["step"] for r in ours["records"]] == list(range(1, STEPS + 1))
    assert "pipeline.train --config tiny-mlm" in ours["command"] and "model.mlm_bias_init=zero" in ours["command"]

    same = compare(ours["records"], train_hf(overrides)["records"])
    assert same["max_diff_all"] < 1e-5, same
    assert same["grad_norm_rel_diff_step1"] < 1e-5, same
    assert same["first_step_diff_gt_1e-05"] is None and agree(same)

    # the learning rate of the HF arm doubled: step 1 (before any update) still agrees, later steps must not
    faster = compare(ours["records"], train_hf(overrides, lr_scale=2.0)["records"])
    assert faster["first_step_diff_gt_1e-05"] == 2 and faster["max_diff_all"] > 1e-3, faster
    assert not agree(faster)

    # other initial weights (same batches): different from step 1
    other_init = compare(ours["records"], train_hf(overrides, init_seed=8)["records"])
    assert other_init["first_step_diff_gt_1e-05"] == 1 and not agree(other_init), other_init


def test_compare_reports_thresholds_and_windows() -> None:
    ours = [{"step": s, "loss": 5.0, "grad_norm": 2.0} for s in range(1, 61)]
    hf = [{"step": s, "loss": 5.0 + (0.0 if s < 12 else 3e-3 * (s - 11)), "grad_norm": 2.0} for s in range(1, 61)]
    out = compare(ours, hf)
    assert out["first_step_diff_gt_1e-05"] == 12 and out["first_step_diff_gt_0.001"] == 12
    assert out["first_step_diff_gt_0.01"] == 15
    assert out["max_diff_steps_1_10"] == 0.0 and agree(out)
    assert out["max_diff_steps_1_50"] == pytest.approx(3e-3 * 39)
    assert out["max_diff_all"] == pytest.approx(3e-3 * 49)
    with pytest.raises(ValueError, match="no common step"):
        compare(ours, [])

