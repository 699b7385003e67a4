"""The earlier fault classes, driven to the same three-part ending as the new ones: the exit code,
one `error:` line (where the run reports one), and the newest remaining checkpoint loads and
resumes to the end. (Bitwise-exact resumes after each signal and kill, on one and two ranks, are
tests/train/test_preemption.py's; this suite checks what the operator sees and keeps.)"""
from __future__ import annotations

import os
import signal
import time

import pytest

import pipeline.train.checkpoint.checkpointer as checkpointer

from pipeline.data.shards import read_manifest
from pipeline.pretrain.pretrainer import PretrainModel
from pipeline.train.cli import EXIT_CONFIG_ERROR, EXIT_NONFINITE
from pipeline.train.checkpoint.tags import verify_checkpoint
from pipeline.train.preemption import REQUEUE_EXIT_CODE
from tests.faults.faults import copy_shards, error_line, resumes_to_the_end
from tests.train.runs import (DEADLINE_S, latest, losses, output_of, run_inprocess, start_subprocess, tag_dir,
                              wait_for_handler, wait_for_step)

STEPS = ["train.total_steps=8", "train.checkpoint_every=2", "train.keep_last=2"]


def test_nan_streak(monkeypatch, tiny_shards_dir, tmp_path, capsys):
    original = PretrainModel.forward

    def forward(self, batch, progress=None, sampling_seed=None):
        loss, metrics = original(self, batch, progress, sampling_seed)
        return (loss * float("nan") if progress is not None and progress.step >= 5 else loss), metrics

    monkeypatch.setattr(PretrainModel, "forward", forward)
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS, "train.max_nonfinite_steps=2") == EXIT_NONFINITE
    message = error_line(capsys.readouterr().err)
    assert message.startswith("2 consecutive steps (up to step 6) had a non-finite loss"), message
    assert latest(out) == tag_dir(out, 4)  # nothing saved inside the streak
    monkeypatch.setattr(PretrainModel, "forward", original)
    resumes_to_the_end("tiny-mlm", tiny_shards_dir, out, *STEPS)
    assert max(losses(out)) == 8


def test_shard_damaged_between_runs(tiny_shards_dir, tmp_path, capsys):
    shards = copy_shards(tiny_shards_dir, tmp_path / "shards")
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", shards, out, *STEPS[1:], "train.total_steps=4") == 0
    victim = shards / read_manifest(shards).shards[0].name
    good = victim.read_bytes()
    victim.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    capsys.readouterr()
    assert run_inprocess("tiny-mlm", shards, out, *STEPS, "train.allow_config_change=true") == EXIT_CONFIG_ERROR
    message = error_line(capsys.readouterr().err)
    assert f"{victim}: its xxh3-64 hash differs from manifest.json" in message and "nothing was computed" in message
    victim.write_bytes(good)  # restored from a copy
    resumes_to_the_end("tiny-mlm", shards, out, *STEPS, "train.allow_config_change=true")
    assert max(losses(out)) == 8


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_signal_or_kill_during_the_steps(how, tiny_shards_dir, tmp_path):
    out = tmp_path / "run"
    steps = ["train.total_steps=40", "train.checkpoint_every=3", "train.keep_last=2"]
    proc = start_subprocess("tiny-mlm", tiny_shards_dir, out, *steps)
    wait_for_step(out, 4, proc)
    deadline = time.monotonic() + DEADLINE_S
    while latest(out) is None and time.monotonic() < deadline:  # step 3's checkpoint is complete
        time.sleep(0.01)
    proc.send_signal(getattr(signal, how))
    code = proc.wait(timeout=DEADLINE_S)
    assert code == (REQUEUE_EXIT_CODE if how == "SIGTERM" else -signal.SIGKILL), output_of(proc)[-3000:]
    assert "error:" not in output_of(proc)
    resumes_to_the_end("tiny-mlm", tiny_shards_dir, out, *steps)
    assert max(losses(out)) == 40


def test_signal_during_a_save(monkeypatch, tiny_shards_dir, tmp_path):
    """SIGTERM while step 4's checkpoint is being written: that save completes (not cut short, not
    corrupted); the signal is acted on at the next step boundary, as at any other moment (the ranks
    agree on it in the step's all-reduce): step 5 is checkpointed, the run exits 75, and it resumes
    to the end."""
    original = checkpointer.save_checkpoint

    def save_with_a_signal(engine, root, state, *args, **kwargs):
        if state.step == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of the save
        return original(engine, root, state, *args, **kwargs)

    monkeypatch.setattr(checkpointer, "save_checkpoint", save_with_a_signal)
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS) == REQUEUE_EXIT_CODE
    assert latest(out) == tag_dir(out, 5) and max(losses(out)) == 5
    verify_checkpoint(tag_dir(out, 4), check_hashes=True)  # the save the signal interrupted is whole
    monkeypatch.setattr(checkpointer, "save_checkpoint", original)
    resumes_to_the_end("tiny-mlm", tiny_shards_dir, out, *STEPS)
    assert max(losses(out)) == 8


def test_signal_during_the_start_up_of_a_resume(tiny_shards_dir, tmp_path):
    """SIGTERM while a resumed run is still starting (before its first step): exit 75, nothing new
    written, the resume point unchanged, and it still resumes to the end."""
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS[1:], "train.total_steps=4") == 0
    before = latest(out)
    proc = start_subprocess("tiny-mlm", tiny_shards_dir, out, *STEPS, "train.allow_config_change=true")
    wait_for_handler(proc, signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=DEADLINE_S)
    assert code == REQUEUE_EXIT_CODE, output_of(proc)[-3000:]
    assert "error:" not in output_of(proc)
    assert latest(out) == before == tag_dir(out, 4) and max(losses(out)) == 4
    resumes_to_the_end("tiny-mlm", tiny_shards_dir, out, *STEPS, "train.allow_config_change=true")
    assert max(losses(out)) == 8
