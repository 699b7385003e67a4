"""Interrupted runs resume to the same per-step metrics as uninterrupted ones, bitwise (CPU, fp32):
`kill -9` mid-run (the last complete checkpoint takes over), SIGTERM (checkpoint at the next step
boundary, exit 75), and SIGUSR1 delivered to one rank of two (both ranks checkpoint and exit 75)."""
from __future__ import annotations

import signal

from pipeline.train.preemption import REQUEUE_EXIT_CODE
from tests.train.runs import (
    latest,
    losses,
    metric_rows,
    output_of,
    run_inprocess,
    start_ranks,
    start_subprocess,
    tag_dir,
    wait_all,
    wait_for_step,
)


def test_kill_9_then_resume(tiny_shards_dir, tmp_path):
    steps = ["train.total_steps=24", "train.checkpoint_every=4"]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    assert run_inprocess("tiny-capt", tiny_shards_dir, reference, *steps) == 0

    proc = start_subprocess("tiny-capt", tiny_shards_dir, killed, *steps)
    wait_for_step(killed, 6, proc)
    proc.kill()  # SIGKILL: no handler runs, no checkpoint is written
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    assert latest(killed) is not None and max(losses(killed)) > int(latest(killed).name[5:])

    assert run_inprocess("tiny-capt", tiny_shards_dir, killed, *steps) == 0  # resume="auto"
    assert metric_rows(killed) == metric_rows(reference)


def test_sigterm_checkpoints_and_exits_75(tiny_shards_dir, tmp_path):
    steps = ["train.total_steps=24", "train.checkpoint_every=1000"]
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    assert run_inprocess("tiny-taco", tiny_shards_dir, reference, *steps) == 0

    proc = start_subprocess("tiny-taco", tiny_shards_dir, stopped, *steps)
    wait_for_step(stopped, 4, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == REQUEUE_EXIT_CODE, output_of(proc)[-3000:]
    last = max(losses(stopped))
    assert last < 24 and latest(stopped) == tag_dir(stopped, last)  # checkpoint at the step boundary

    assert run_inprocess("tiny-taco", tiny_shards_dir, stopped, *steps) == 0
    assert metric_rows(stopped) == metric_rows(reference)


def test_sigusr1_on_one_of_two_ranks(tiny_shards_dir, tmp_path):
    """2 ranks (env launch, as srun), ZeRO-2, CAPT's queue gathered across ranks, dropout on."""
    steps = ["train.total_steps=16", "train.checkpoint_every=1000", "deepspeed.config=zero2"]
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    procs = start_ranks("tiny-capt", tiny_shards_dir, reference, *steps)
    assert wait_all(procs) == [0, 0], output_of(procs[0])[-3000:]

    procs = start_ranks("tiny-capt", tiny_shards_dir, stopped, *steps)
    wait_for_step(stopped, 3, procs[0])
    procs[1].send_signal(signal.SIGUSR1)  # only rank 1 is told; rank 0 learns it at the step boundary
    assert wait_all(procs) == [REQUEUE_EXIT_CODE] * 2, output_of(procs[0])[-3000:]
    last = max(losses(stopped))
    assert last < 16 and latest(stopped) == tag_dir(stopped, last)

    procs = start_ranks("tiny-capt", tiny_shards_dir, stopped, *steps)
    assert wait_all(procs) == [0, 0], output_of(procs[0])[-3000:]
    assert metric_rows(stopped) == metric_rows(reference)
