"""Two runs on one directory: the second refuses before any compute (exit 2) with one line naming the
holder; the first goes on undisturbed, and whatever way it ends (SIGTERM or `kill -9`) its lock goes with it,
so the next run (its requeue) resumes. A requeue whose predecessor still holds the lock waits for it;
on a filesystem without record locks the file is the lock, and deleting it is the documented way to break it."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from pipeline.train.checkpoint import run_lock
from pipeline.train.cli import EXIT_CONFIG_ERROR
from pipeline.train.metrics import read_jsonl
from pipeline.train.preemption import REQUEUE_EXIT_CODE
from tests.faults.faults import error_line, resumes_to_the_end
from tests.train.runs import (REPO, _env, kill_after_a_checkpoint, latest, run_inprocess, start_subprocess,
                              wait_for_step)

HOLDER = ("import sys; from pipeline.train.checkpoint.run_lock import hold_run_dir; hold_run_dir(sys.argv[1], 0); "
          "print('held', flush=True); sys.stdin.read()")


@pytest.mark.parametrize("ending", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_holder(ending, tiny_shards_dir, tmp_path, capsys):
    out = tmp_path / "run"
    first = start_subprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=100000", "train.checkpoint_every=2")
    try:
        wait_for_step(out, 3, first)
        steps_before = [r["step"] for r in read_jsonl(out / "metrics.jsonl")]
        assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=100000") == EXIT_CONFIG_ERROR
        message = error_line(capsys.readouterr().err)
        assert message.startswith(f"train.output_dir={out} is in use by another run (host {socket.gethostname()}, "
                                  f"pid {first.pid}, since "), message
        assert message.endswith(f"; lock file {out / 'run.lock'}); wait for it to end or choose another "
                                "train.output_dir"), message
        if ending == signal.SIGKILL:  # once `latest` names a checkpoint (it moves on the finisher's thread)
            kill_after_a_checkpoint(out, 3, first)
        else:
            first.send_signal(ending)
        code = first.wait(timeout=600)
    finally:
        first.kill()
    assert code == (REQUEUE_EXIT_CODE if ending == signal.SIGTERM else -signal.SIGKILL)
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl")]
    assert steps[: len(steps_before)] == steps_before and steps == sorted(set(steps))  # one writer: no interleaving
    assert (out / "run.lock").exists() == (ending == signal.SIGKILL)  # a killed run's record stays, its lock does not
    newest = int(latest(out).name.split("_")[-1])  # the next run takes the lock over and resumes (2 more steps)
    resumes_to_the_end("tiny-mlm", tiny_shards_dir, out, f"train.total_steps={newest + 2}",
                       "train.allow_config_change=true")
    assert not (out / "run.lock").exists()


def _hold(directory, job_id: str) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], cwd=REPO, env=_env({"SLURM_JOB_ID": job_id}),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_requeue_waits_for_its_predecessor_and_another_job_does_not(monkeypatch, tmp_path):
    holder = _hold(tmp_path, "4242")
    try:
        record = json.loads((tmp_path / "run.lock").read_text())
        assert (record["host"], record["pid"], record["slurm_job_id"]) == (socket.gethostname(), holder.pid, "4242")
        monkeypatch.setenv("SLURM_JOB_ID", "777")  # another job: refused at once, however long the wait allowed
        monkeypatch.setenv(run_lock.WAIT_ENV, "600")
        with pytest.raises(run_lock.RunLockHeld, match=rf"in use by another run \(host .*, pid {holder.pid}, SLURM job 4242"):
            run_lock.hold_run_dir(tmp_path, 0)
        assert run_lock.hold_run_dir(tmp_path, 1) is None  # only rank 0 locks
        monkeypatch.setenv("SLURM_JOB_ID", "4242")  # the same job, requeued: waits until the predecessor exits
        threading.Timer(1.0, holder.stdin.close).start()
        with run_lock.released_at_exit():
            lock = run_lock.hold_run_dir(tmp_path, 0)
            assert holder.poll() is not None and lock.record()["pid"] == os.getpid()
            assert lock.os_lock
        assert not (tmp_path / "run.lock").exists()
    finally:
        holder.kill()


def test_without_record_locks_the_file_is_the_lock_and_deleting_it_breaks_it(monkeypatch, tmp_path):
    def unsupported(fd, operation, *args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "lockf", unsupported)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    other = {"host": "node-17", "pid": 4321, "slurm_job_id": "99", "started": "2026-01-01T00:00:00+00:00"}
    (tmp_path / "run.lock").write_text(json.dumps(other))
    with pytest.raises(run_lock.RunLockHeld) as refused:
        run_lock.hold_run_dir(tmp_path, 0)
    assert str(refused.value) == (
        f"train.output_dir={tmp_path} is in use by another run (host node-17, pid 4321, SLURM job 99, since "
        f"2026-01-01T00:00:00+00:00; lock file {tmp_path / 'run.lock'}); wait for it to end or choose another "
        "train.output_dir; record locks are not available on this filesystem: once that run is known to have ended, "
        f"delete {tmp_path / 'run.lock'} to break the lock")
    (tmp_path / "run.lock").unlink()  # the documented way to break it
    with run_lock.released_at_exit():
        lock = run_lock.hold_run_dir(tmp_path, 0)
        assert not lock.os_lock and lock.record()["pid"] == os.getpid()
    assert not (tmp_path / "run.lock").exists()
    # a record left by an ended process of this host is taken over without help
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout)}))
    with run_lock.released_at_exit():
        run_lock.hold_run_dir(tmp_path, 0)


@pytest.mark.parametrize("second_writer", [False, True], ids=["deleted", "deleted-and-taken"])
def test_a_run_whose_lock_file_is_deleted_stops_at_its_next_save(second_writer, tiny_shards_dir, tmp_path):
    """Deleting `run.lock` under a running run lets a second run lock a new file of the same name: the
    holder sees at its next save that the file is no longer the one it locked and stops, exit 4, naming
    what happened (and the new holder); it writes no more checkpoints, and leaves the other run's file."""
    from pipeline.train.cli import EXIT_SAVE_FAILED

    out = tmp_path / "run"
    first = start_subprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=40", "train.checkpoint_every=2")
    second = None
    try:
        wait_for_step(out, 3, first)
        (out / "run.lock").unlink()
        second = run_lock.RunLock(out).acquire(0) if second_writer else None  # at once: before the next save
        code = first.wait(timeout=600)
        output = first.stdout.read()
    finally:
        first.kill()
    try:
        assert code == EXIT_SAVE_FAILED, output
        message = error_line(output)
        if second_writer:
            assert message.startswith(f"{out / 'run.lock'} was deleted while this run held it and is now another file "
                                      f"(host {socket.gethostname()}, pid {os.getpid()}"), message
            assert second.record()["pid"] == os.getpid()  # the other run's file stays, its lock too
        else:
            assert message.startswith(f"{out / 'run.lock'} was deleted while this run held it, so another run can "
                                      f"take train.output_dir={out} too"), message
        assert message.endswith("; stopping before saving (two writers would mix checkpoints and metrics). Make sure "
                                "only one run uses the directory, then resume"), message
        last_step = max(r["step"] for r in read_jsonl(out / "metrics.jsonl"))
        assert int(latest(out).name.split("_")[-1]) < last_step  # the step it stopped at was not saved
    finally:
        if second is not None:
            second.release()
