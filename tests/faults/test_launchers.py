"""Class 5, launchers lose the story: a rank killed under a raw-environment launch (srun-style: each
process gets RANK/WORLD_SIZE) ends the job with one line naming it and exit 5 (`EXIT_RANK_LOST`),
at the next collective (a hung rank: after `train.dist_timeout_s`, tests/train/test_hung_rank.py);
the newest checkpoint then resumes. Under torchrun, `pipeline.launch_requeue` passes the ranks'
requeue code 75 on to the scheduler (torchrun itself exits 1). DeepSpeed's launcher passes 75 on
when the ranks are signalled; `pipeline.launch_requeue --deepspeed` makes a signal to the launcher
do the same (DeepSpeed alone would kill the ranks and exit 1)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.train.cli import EXIT_RANK_LOST
from pipeline.train.preemption import REQUEUE_EXIT_CODE
from tests.faults.faults import error_line
from tests.gloo_ranks import free_port
from tests.train.runs import (DEADLINE_S, REPO, _env, latest, output_of, overrides, start_ranks, tag_dir, wait_all,
                              wait_for_step)

TIMEOUT_S = 60  # train.dist_timeout_s: far above what a killed rank takes to be noticed


def test_a_killed_rank_is_named_and_the_run_resumes(tiny_shards_dir, tmp_path):
    out = tmp_path / "run"
    steps = ["train.total_steps=400", "train.checkpoint_every=2", "train.keep_last=2", f"train.dist_timeout_s={TIMEOUT_S}"]
    procs = start_ranks("tiny-mlm", tiny_shards_dir, out, *steps)
    try:
        wait_for_step(out, 3, procs[0])
        procs[1].kill()  # kill -9
        killed = time.monotonic()
        code = procs[0].wait(timeout=DEADLINE_S)
        waited = time.monotonic() - killed
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    log = output_of(procs[0])
    assert code == EXIT_RANK_LOST, log[-3000:]
    message = error_line(log)
    assert message.startswith("rank 0: a collective with the other ranks failed: rank(s) [1] stopped answering"), message
    assert f"train.dist_timeout_s={TIMEOUT_S}s" in message and waited < TIMEOUT_S, waited
    newest = latest(out)
    assert newest is not None
    end = int(newest.name.split("_")[1]) + 2  # two more steps from the newest checkpoint, on two ranks again
    procs = start_ranks("tiny-mlm", tiny_shards_dir, out, *steps[1:], f"train.total_steps={end}",
                        "train.allow_config_change=true")
    assert wait_all(procs) == [0, 0], output_of(procs[0])[-3000:]
    assert latest(out) == tag_dir(out, end)


def test_requeue_code_passes_through_torchrun(tiny_shards_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline.launch_requeue", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "pipeline.train", "--config", "tiny-mlm",
           *overrides(tiny_shards_dir, out, "train.total_steps=400", "train.checkpoint_every=1000")]
    launcher = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    def signal_the_ranks(launcher):  # the scheduler's preemption signal reaches every process of the job step
        ranks = subprocess.run(["pgrep", "-f", "-P", str(launcher.pid), "pipeline.train"], capture_output=True,
                               text=True).stdout.split()
        assert ranks, "no rank processes found under torchrun"
        for pid in ranks:
            subprocess.run(["kill", "-USR1", pid], check=True)

    log = requeued_at_step_2(out, launcher, signal_the_ranks)
    assert "exit code 75 of every rank" in log


def test_the_wrappers_exit_code_rules():
    from types import SimpleNamespace

    from pipeline.launch_requeue import exit_code_of

    def failures(*codes):
        return {rank: SimpleNamespace(exitcode=code) for rank, code in enumerate(codes)}

    assert exit_code_of(failures(75, 75)) == 75
    assert exit_code_of(failures(5)) == 5 and exit_code_of(failures(75, 5)) == 1 and exit_code_of(failures(-9)) == 1


def start_deepspeed(shards: Path, out: Path, *extra: str, wrapper: bool = False) -> subprocess.Popen:
    """`deepspeed --num_gpus 2 --module pipeline.train ...` (two gloo ranks on a CPU machine), or the
    same through `python -m pipeline.launch_requeue --deepspeed`, in a session of its own."""
    args = ["--num_gpus", "2", "--master_port", str(free_port()), "--module", "pipeline.train", "--config", "tiny-mlm",
            *overrides(shards, out, *extra)]
    head = ["-m", "pipeline.launch_requeue", "--deepspeed"] if wrapper else ["-m", "deepspeed.launcher.runner"]
    return subprocess.Popen([sys.executable, *head, *args], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def requeued_at_step_2(out: Path, launcher: subprocess.Popen, signal_it) -> str:
    """Wait for step 2, `signal_it(launcher)`, expect exit 75 and a checkpoint. Returns the launcher's output."""
    try:
        wait_for_step(out, 2, launcher)
        signal_it(launcher)
        code = launcher.wait(timeout=DEADLINE_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    log = output_of(launcher)
    assert code == REQUEUE_EXIT_CODE, log[-3000:]
    assert latest(out) is not None, log[-3000:]
    return log


def preempt_and_resume(shards: Path, out: Path, launcher: subprocess.Popen, signal_it) -> str:
    """`requeued_at_step_2`, then two ranks resume from the checkpoint and finish two more steps.
    Returns the launcher's output."""
    log = requeued_at_step_2(out, launcher, signal_it)
    newest = latest(out)
    end = int(newest.name.split("_")[1]) + 2
    procs = start_ranks("tiny-mlm", shards, out, f"train.total_steps={end}", "train.allow_config_change=true")
    assert wait_all(procs) == [0, 0], output_of(procs[0])[-3000:]
    assert latest(out) == tag_dir(out, end)
    return log


def test_requeue_code_passes_through_the_deepspeed_launcher_when_the_ranks_are_signalled(tiny_shards_dir, tmp_path):
    from pipeline.launch_requeue import deepspeed_ranks

    out = tmp_path / "run"

    def signal_the_ranks(launcher):  # as a scheduler's step signal does
        ranks = deepspeed_ranks(launcher.pid)
        assert len(ranks) == 2, [r.cmdline() for r in ranks]
        for rank in ranks:
            rank.send_signal(signal.SIGUSR1)

    launcher = start_deepspeed(tiny_shards_dir, out, "train.total_steps=400", "train.checkpoint_every=1000")
    preempt_and_resume(tiny_shards_dir, out, launcher, signal_the_ranks)


def test_the_deepspeed_wrapper_turns_a_signal_to_the_launcher_into_a_requeue(tiny_shards_dir, tmp_path):
    out = tmp_path / "run"
    launcher = start_deepspeed(tiny_shards_dir, out, "train.total_steps=400", "train.checkpoint_every=1000",
                               wrapper=True)
    log = preempt_and_resume(tiny_shards_dir, out, launcher, lambda proc: proc.send_signal(signal.SIGTERM))
    assert log.count("launch_requeue: got SIGTERM; sent SIGUSR1 to rank pid") == 2, log[-3000:]
    assert "deepspeed exited 75 (the ranks checkpointed: requeue)" in log
