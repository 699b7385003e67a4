"""`cpt-status` (`pipeline.status`) on real runs of the training entry point: a finished run, a run
read while it trains, the same run stopped with SIGTERM (exit 75), a diverged run (exit 3) and the
directory holding the three (a table); a torn last metrics line (a run mid-write) changes nothing."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pytest

from pipeline.train.preemption import REQUEUE_EXIT_CODE
from tests.train.runs import DEADLINE_S, REPO, _env, output_of, run_inprocess, train_command, wait_for_step

DIVERGE_FIRST = ["train.total_steps=4", "train.checkpoint_every=2", "train.keep_last=1"]
#: The resumed run's learning rate blows the loss up at step 6 (tests/faults/test_divergence.py).
DIVERGE_BLOW_UP = ["train.total_steps=12", "train.checkpoint_every=2", "train.keep_last=1", "optim.lr=10",
                   "train.allow_config_change=true"]


def status(*paths, json_output=True):
    """`python -m pipeline.status` (the `cpt-status` console script) as a subprocess."""
    cmd = [sys.executable, "-m", "pipeline.status", *map(str, paths), *(["--json"] if json_output else [])]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()] if json_output else proc.stdout


def train(shards, out, *extra):
    proc = subprocess.Popen(train_command("tiny-mlm", shards, out, *extra), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tiny_shards_dir):
    """A directory of three runs (finished, stopped for requeue, diverged), and the status of the
    stopped one read while it was training."""
    root = tmp_path_factory.mktemp("sweep")
    finished = train(tiny_shards_dir, root / "finished", "train.total_steps=6", "train.checkpoint_every=3")
    assert finished.wait(timeout=DEADLINE_S) == 0, output_of(finished)[-3000:]

    running = train(tiny_shards_dir, root / "stopped", "train.total_steps=5000", "train.checkpoint_every=1000")
    try:
        wait_for_step(root / "stopped", 4, running)
        (while_training,) = status(root / "stopped")
        assert running.poll() is None, "the run ended while its status was read"
    finally:
        running.send_signal(signal.SIGTERM)
    assert running.wait(timeout=DEADLINE_S) == REQUEUE_EXIT_CODE, output_of(running)[-3000:]

    assert run_inprocess("tiny-mlm", tiny_shards_dir, root / "diverged", *DIVERGE_FIRST) == 0
    diverged = train(tiny_shards_dir, root / "diverged", *DIVERGE_BLOW_UP)
    assert diverged.wait(timeout=DEADLINE_S) == 3, output_of(diverged)[-3000:]
    return root, while_training


def test_finished_run(sweep):
    root, _ = sweep
    (s,) = status(root / "finished")
    assert s["state"] == "finished" and s["exit_code"] == 0 and s["detail"] == "finished (exit 0)"
    assert (s["step"], s["total_steps"]) == (6, 6) and s["eta_s"] is None
    assert s["tokens_seen"] > 0 and s["tokens_per_s"] > 0 and s["loss"] > 0
    assert s["checkpoint_step"] == 6 and s["checkpoint"] == str(root / "finished" / "checkpoints" / "step_00000006")
    assert s["convert_command"] == f"cpt-convert {s['checkpoint']} {root / 'finished' / 'hf' / 'step6'}"
    assert s["checkpoint_bytes"] > 0 and s["loss_trend"] in ("falling", "flat", "rising")
    assert {sig["term"] for sig in s["signals"]} >= {"mlm/accuracy", "mlm/loss"}
    text = status(root / "finished", json_output=False)
    assert "state       finished (exit 0)" in text and "step        6/6 (100.0%)" in text
    assert f"convert     cpt-convert {s['checkpoint']}" in text


def test_running_run_read_while_it_trains(sweep):
    _, s = sweep
    assert s["state"] == "running" and s["detail"].startswith("running (pid ")
    assert s["exit_code"] is None and s["total_steps"] == 5000 and 4 <= s["step"] < 5000
    assert s["tokens_per_s"] > 0 and s["eta_s"] > 0 and s["checkpoint"] is None


def test_run_stopped_for_requeue(sweep):
    root, _ = sweep
    (s,) = status(root / "stopped")
    assert s["state"] == "stopped" and s["exit_code"] == REQUEUE_EXIT_CODE
    assert s["detail"].startswith("stopped for requeue (exit 75)")
    assert s["checkpoint_step"] == s["step"] < 5000 and s["eta_s"] > 0  # checkpointed at the step it stopped


def test_diverged_run(sweep):
    root, _ = sweep
    (s,) = status(root / "diverged")
    assert s["state"] == "diverged" and s["exit_code"] == 3
    assert s["error"].startswith("step 6: loss ") and "diverged" in s["error"]
    assert s["checkpoint_step"] == 4 and s["total_steps"] == 12 and s["eta_s"] is None


def test_directory_of_runs_is_a_table(sweep):
    root, _ = sweep
    states = {s["run_dir"]: s["state"] for s in status(root)}
    assert states == {str(root / "diverged"): "diverged", str(root / "finished"): "finished",
                      str(root / "stopped"): "stopped"}
    lines = status(root, json_output=False).splitlines()
    assert lines[0].split()[:3] == ["RUN", "STATE", "STEP"]
    rows = {line.split()[0]: line.split()[1:3] for line in lines[1:4]}
    assert rows == {"diverged": ["diverged", "(3)"], "finished": ["finished", "6/6"], "stopped": ["stopped", "(75)"]}
    assert lines[4].startswith("diverged: step 6: loss ")  # the error line under the table


def test_torn_last_metrics_line_is_skipped(sweep, tmp_path):
    root, _ = sweep
    copy = tmp_path / "finished"
    shutil.copytree(root / "finished", copy)
    with open(copy / "metrics.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"consumed_samples": 56, "grad_norm": 1.7, "lo')  # a writer caught mid-line
    (s,) = status(copy)
    (before,) = status(root / "finished")
    assert (s["state"], s["step"], s["loss"]) == ("finished", 6, before["loss"])


def test_not_a_run_directory(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipeline.status", str(tmp_path)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 2 and f"error: {tmp_path}: not a run directory" in proc.stderr


def test_every_exit_code_reads_as_its_state():
    """The mapping of `run_state.json` records to states (the runs above cover 0, 75 and 3 end to end)."""
    from pipeline.status import state_of

    exited = {"state": "exited", "host": "n1", "pid": 1}
    assert state_of({**exited, "exit_code": 4, "error": "no space left on device: /x"}, 5, 10, 4)[:3] == (
        "failed", "failed (exit 4, output not writable): no space left on device: /x", 4)
    assert state_of({**exited, "exit_code": 1, "error": "RuntimeError: boom"}, 5, 10, 4)[0:2] == (
        "failed", "failed (exit 1, error): RuntimeError: boom")
    assert state_of({"state": "running", "host": "elsewhere", "pid": 1}, 5, 10, None)[0] == "running"
    assert state_of(None, 10, 10, 10)[0] == "finished" and state_of(None, 5, 10, 4)[0] == "unknown"
