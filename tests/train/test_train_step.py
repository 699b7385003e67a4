"""`Run.train_step` is the loop's one step, and `build_run` + `train_step` (how benchmarks drive a run)
trains exactly what `cpt-train` trains: same losses, learning rates and token counts, bit for bit,
also across a phase change with its own LR segment."""
from __future__ import annotations

import json

import torch

from pipeline.config.run import load_config
from tests.train.runs import QUIET, metric_rows, run_inprocess


def driven_steps(shards, out, *extra: str) -> list:
    from pipeline.train.loop import build_run, torch_process_state

    cfg = load_config("tiny-mlm", [f"data.shards_dir={shards}", f"train.output_dir={out}", *QUIET, *extra])
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch_process_state(cfg.train.deterministic, cfg.deepspeed.tf32):
            run = build_run(cfg)
            try:
                return [run.train_step(step) for step in range(1, cfg.train.total_steps + 1)]
            finally:
                run.close()
    finally:
        torch.set_num_threads(previous)


def test_build_run_and_train_step_repeat_the_loop(tiny_shards_dir, tmp_path):
    length = ["train.total_steps=4", "train.checkpoint_every=100"]
    assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path / "loop", *length) == 0
    rows = metric_rows(tmp_path / "loop")
    results = driven_steps(tiny_shards_dir, tmp_path / "driven", *length)
    assert [r.step for r in results] == [1, 2, 3, 4]
    assert [r.loss for r in results] == [rows[s]["loss"] for s in (1, 2, 3, 4)]
    assert [r.lr for r in results] == [rows[s]["lr"] for s in (1, 2, 3, 4)]
    assert [sum(r.tokens for r in results[:s]) for s in (1, 2, 3, 4)] == [rows[s]["tokens_seen"] for s in (1, 2, 3, 4)]
    assert all(r.logged and not r.bad and not r.diverged and not r.stop_requested for r in results)
    assert all(r.accum == 2 and r.flops > 0 for r in results)
    assert not (tmp_path / "driven" / "checkpoints").exists()  # train_step saves nothing


def test_train_step_takes_a_phase_lr_segment_and_its_batch(tiny_shards_dir, tmp_path):
    """Phase 2 on its own LR segment and batch: the driven steps use them (not the run's one schedule)."""
    phases = [{"name": "a", "steps": 2},
              {"name": "b", "steps": 2, "global_batch_size": 4, "micro_batch_size": 2,
               "optim": {"lr": 5.0e-4, "warmup_steps": 1, "min_lr_ratio": 0.0}}]
    length = ["train.total_steps=4", "train.checkpoint_every=100", "phases=" + json.dumps(phases)]
    assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path / "loop", *length) == 0
    rows = metric_rows(tmp_path / "loop")
    results = driven_steps(tiny_shards_dir, tmp_path / "driven", *length)
    assert [r.lr for r in results] == [rows[s]["lr"] for s in (1, 2, 3, 4)]
    assert results[2].lr == 5.0e-4  # the segment's peak after its one warm-up step
    assert [r.loss for r in results] == [rows[s]["loss"] for s in (1, 2, 3, 4)]
    assert [r.accum for r in results] == [2, 2, 2, 2] and [rows[s]["phase"] for s in (1, 3)] == [0, 1]
