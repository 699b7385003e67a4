"""Operator-facing behaviour of the SLURM scripts on the two-node test cluster: a failed stage of a
chain cancels the stages after it, and a hung rank ends its job within a bounded time with every
rank's exit status explained in the job log."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.slurm.cluster import SlurmCluster
from tests.slurm.jobs import job_log, metrics, pretrain_env, submit, wait_for

pytestmark = pytest.mark.slurm


def test_a_failed_stage_cancels_the_rest_of_the_chain(slurm_cluster: SlurmCluster, tiny_shards_dir: Path,
                                                     tmp_path: Path) -> None:
    (tmp_path / "inputs.txt").write_text(f"{tmp_path / 'no_such_corpus.txt'}\n")
    env = {
        **pretrain_env(tmp_path / "run", tiny_shards_dir), "INPUT_LIST": str(tmp_path / "inputs.txt"),
        "PREP_DIR": str(tmp_path / "prep"), "HF_DIR": str(tmp_path / "hf" / "model"),
    }
    jobs = submit(slurm_cluster, "chain", env)
    tokenizer = slurm_cluster.wait_job(jobs["tokenizer"])
    assert tokenizer.state == "FAILED"
    for name in ("shards", "merge", "pretrain", "convert"):  # --kill-on-invalid-dep=yes: none waits forever
        result = slurm_cluster.wait_job(jobs[name])
        assert result.state == "CANCELLED", (name, result.fields)
    assert "no_such_corpus.txt" in (tmp_path / "prep" / "logs" / f"cpt-prep-tokenizer-{jobs['tokenizer']}.out").read_text()


def test_a_hung_rank_ends_the_job_within_the_timeouts(slurm_cluster: SlurmCluster, tiny_shards_dir: Path,
                                                     tmp_path: Path) -> None:
    """Rank 1 stops answering (SIGSTOP) mid-run: rank 0's next collective fails after
    train.dist_timeout_s and it exits 5 naming rank 1, srun ends rank 1 EXIT_WAIT seconds later, and the
    job log explains both."""
    run_dir, timeout_s, exit_wait = tmp_path / "run", 20, 10
    env = pretrain_env(run_dir, tiny_shards_dir, extra=f"train.total_steps=100000 train.dist_timeout_s={timeout_s}",
                       EXIT_WAIT=str(exit_wait))
    job = submit(slurm_cluster, "pretrain", env, "--nodes=2", "--ntasks-per-node=1")["pretrain"]
    wait_for("step 2 of the run", lambda: len(metrics(run_dir)) >= 2, lambda: job_log(run_dir, job))
    rank1_log = (run_dir / "logs" / job / "rank1.log").read_text()
    pid = int(re.search(r"rank 1: command pid (\d+)", rank1_log).group(1))
    os.kill(pid, signal.SIGSTOP)  # a process of this test's own job
    stopped = time.monotonic()
    result = slurm_cluster.wait_job(job)
    ended_after = time.monotonic() - stopped
    log = job_log(run_dir, job)
    assert result.state == "FAILED" and result.restarts == 0, log
    # Bounded: the collective timeout, srun's wait, SLURM's KillWait (10 s) and polling; generous for a busy machine.
    assert timeout_s <= ended_after < timeout_s + exit_wait + 10 + 240, f"{ended_after:.0f}s\n{log}"
    job_out = (run_dir / "logs" / f"cpt-pretrain-{job}.out").read_text()
    assert re.search(r"rank 0: exit 5 \(another rank died or hung: the message names it\): "
                     r"error: rank 0: a collective with the other ranks failed: rank\(s\) \[1\] stopped answering",
                     job_out), job_out
    assert re.search(r"rank 1: exit (none|137|143) \((no exit status|killed by SIG(KILL|TERM))", job_out), job_out
