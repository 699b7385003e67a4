"""Interrupted runs resume to the same per-step metrics as uninterrupted ones, bitwise (CPU, fp32):
`kill -9` mid-run (the last complete checkpoint takes over), SIGTERM (checkpoint at the next step
boundary, exit 75), and SIGUSR1 delivered to one rank of two (both ranks checkpoint and exit 75).
A signal at any other moment ends the run just as cleanly: during start-up (exit 75, nothing
written), during the last step or after the final checkpoint (exit 0: the run is complete)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from pipeline.model.pretrainer import PretrainModel
from pipeline.train.preemption import REQUEUE_EXIT_CODE
from tests.train.runs import (
    DEADLINE_S,
    REPO,
    _env,
    kill_after_a_checkpoint,
    latest,
    losses,
    metric_rows,
    output_of,
    run_inprocess,
    start_ranks,
    start_subprocess,
    tag_dir,
    train_command,
    wait_all,
    wait_for_handler,
    wait_for_step,
)


def test_kill_9_then_resume(tiny_shards_dir, tmp_path):
    steps = ["train.total_steps=24", "train.checkpoint_every=4"]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    assert run_inprocess("tiny-capt", tiny_shards_dir, reference, *steps) == 0

    proc = start_subprocess("tiny-capt", tiny_shards_dir, killed, *steps)
    saved = kill_after_a_checkpoint(killed, 6, proc)  # SIGKILL: no handler runs, no checkpoint is written
    assert latest(killed) == tag_dir(killed, saved) and max(losses(killed)) > saved  # steps to redo

    assert run_inprocess("tiny-capt", tiny_shards_dir, killed, *steps) == 0  # resume="auto"
    assert metric_rows(killed) == metric_rows(reference)


def test_sigterm_checkpoints_and_exits_75(tiny_shards_dir, tmp_path):
    steps = ["train.total_steps=24", "train.checkpoint_every=1000"]
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    assert run_inprocess("tiny-taco", tiny_shards_dir, reference, *steps) == 0

    proc = start_subprocess("tiny-taco", tiny_shards_dir, stopped, *steps)
    wait_for_step(stopped, 4, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=DEADLINE_S) == REQUEUE_EXIT_CODE, output_of(proc)[-3000:]
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


def test_the_entry_point_installs_its_handler_before_torch_is_imported():
    """`python -m pipeline.train` catches SIGTERM/SIGUSR1 from before its seconds-long torch import
    until it exits; right before exiting it ignores them (its exit code is decided)."""
    probe = textwrap.dedent("""
        import importlib.abc, runpy, signal, sys
        seen = []
        class Spy(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" and not seen:
                    seen.append([getattr(signal.getsignal(s), "__qualname__", str(signal.getsignal(s)))
                                 for s in (signal.SIGUSR1, signal.SIGTERM)])
        sys.meta_path.insert(0, Spy())
        sys.argv = ["pipeline.train", "--help-config"]
        try:
            runpy.run_module("pipeline.train", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            print(seen[0], exit.code, signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN)
    """)
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=DEADLINE_S)
    assert out.stdout.split("\n")[-2] == "['PreemptionHandler._handle', 'PreemptionHandler._handle'] 0 True", out


def test_signal_during_startup_reaching_one_of_two_ranks(tiny_shards_dir, tmp_path):
    """SIGUSR1 to rank 1 while it is still importing torch: it survives (handler installed first),
    both ranks agree before the first step and exit 75; nothing was computed or written, so the
    resume point (here: a fresh start) is untouched."""
    out = tmp_path / "run"
    procs = start_ranks("tiny-mlm", tiny_shards_dir, out, "train.total_steps=4")
    wait_for_handler(procs[1])
    procs[1].send_signal(signal.SIGUSR1)
    codes = wait_all(procs)
    logs = [output_of(p) for p in procs]
    assert codes == [REQUEUE_EXIT_CODE] * 2, logs[0][-3000:] + logs[1][-3000:]
    assert "during start-up, before step 1: nothing new to save" in logs[0]
    assert latest(out) is None and losses(out) == {}


def test_signal_during_the_last_step_completes_the_run(monkeypatch, tiny_shards_dir, tmp_path):
    original = PretrainModel.forward

    def forward(self, batch, progress=None, sampling_seed=None):
        if progress is not None and progress.step == progress.total_steps:
            os.kill(os.getpid(), signal.SIGUSR1)  # the last step: its checkpoint is the final one
        return original(self, batch, progress, sampling_seed)

    monkeypatch.setattr(PretrainModel, "forward", forward)
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=3") == 0
    assert latest(out) == tag_dir(out, 3) and max(losses(out)) == 3


def test_signals_after_the_final_checkpoint_leave_the_run_successful(tiny_shards_dir, tmp_path):
    """SIGUSR1 once `main` has returned (final checkpoint written) and SIGTERM from an atexit hook
    (interpreter teardown) do not turn a finished run into "killed by a signal"."""
    out = tmp_path / "run"
    args = train_command("tiny-mlm", tiny_shards_dir, out, "train.total_steps=3")[3:]  # after `python -m pipeline.train`
    wrapper = textwrap.dedent(f"""
        import atexit, os, runpy, signal, sys
        import pipeline.train.cli as cli
        main = cli.main
        def main_then_signal(argv=None):
            code = main(argv)
            os.kill(os.getpid(), signal.SIGUSR1)
            return code
        cli.main = main_then_signal
        atexit.register(os.kill, os.getpid(), signal.SIGTERM)
        sys.argv = ["pipeline.train", *{args!r}]
        runpy.run_module("pipeline.train", run_name="__main__", alter_sys=True)
    """)
    proc = subprocess.run([sys.executable, "-c", wrapper], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=DEADLINE_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert latest(out) == tag_dir(out, 3)
