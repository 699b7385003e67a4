"""A preemption signal at any moment of a `slurm/pretrain.sbatch` job, on the two-node test cluster:
during the ranks' start-up (the job requeues and then completes, and a chained `afterok` conversion
runs only after that), and after the final checkpoint, while the ranks and then the batch script
tear down (the job completes: exit 0, no requeue). The moments are made exact with
`pause_hook/sitecustomize.py`: the job's processes stop there until the signal is delivered."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from pipeline.train.preemption import REQUEUE_EXIT_CODE
from tests.fixtures_data import stdlib_documents, write_corpus
from tests.slurm.cluster import SlurmCluster
from tests.slurm.jobs import (
    TOTAL_STEPS,
    final_meta,
    job_log,
    metrics,
    pause_env,
    paused,
    pretrain_env,
    submit,
    wait_for,
)

pytestmark = pytest.mark.slurm
MAIL = ("--mail-type=END,FAIL", "--mail-user=ops@example.com")


def _rank_logs(run_dir: Path, job: str) -> list[str]:
    return [(run_dir / "logs" / job / f"rank{r}.log").read_text(errors="replace")
            if (run_dir / "logs" / job / f"rank{r}.log").is_file() else "" for r in (0, 1)]


def test_chain_with_a_signal_during_startup_requeues_and_converts_after_completion(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """One command: prep (tokenizer -> 2-part shard array -> merge) -> pretrain -> convert, mail options
    on every job. SIGUSR1 reaches the pretraining ranks while they import torch: they exit 75
    before step 1 without a checkpoint, the job requeues once (no progress, within
    MAX_IDLE_REQUEUES), completes, and only then does the conversion run."""
    documents = stdlib_documents()
    inputs = [write_corpus(tmp_path / f"corpus_{i}.txt", documents[i::3]) for i in range(3)]
    (tmp_path / "inputs.txt").write_text("\n".join(map(str, inputs)) + "\n")
    prep_dir, run_dir, hf_dir, pause_dir = tmp_path / "prep", tmp_path / "run", tmp_path / "hf" / "model", tmp_path / "pause"
    env = {
        **pretrain_env(run_dir, Path("unused"), extra=""), "OVERRIDES": f"deepspeed.config=zero2 train.total_steps={TOTAL_STEPS} "
        "train.checkpoint_every=8 train.tensorboard=false",
        "INPUT_LIST": str(tmp_path / "inputs.txt"), "PREP_DIR": str(prep_dir), "HF_DIR": str(hf_dir), "NUM_PARTS": "2",
        "SEQ_LEN": "64", "TOKENIZER_ARGS": "--vocab-size 800", "BUILD_ARGS": "--shard-size-mb 0.02",
        "PRETRAIN_FLAGS": "--nodes=2 --ntasks-per-node=1",
        **pause_env(pause_dir, "startup@import:torch@pipeline.train"),
    }
    (pause_dir / "arm-startup").touch()
    jobs = submit(slurm_cluster, "chain", env, *MAIL)
    assert list(jobs) == ["tokenizer", "shards", "merge", "pretrain", "convert"]
    pretrain = jobs["pretrain"]

    wait_for("both ranks held while importing torch", lambda: len(paused(pause_dir, "startup")) == 2,
             lambda: job_log(run_dir, pretrain) + job_log(prep_dir, jobs["merge"]))
    assert slurm_cluster.run(["scancel", "--batch", "--signal=USR1", pretrain]).returncode == 0
    wait_for("SIGUSR1 delivered to both ranks",
             lambda: all("received SIGUSR1, passed on to pid" in log for log in _rank_logs(run_dir, pretrain)),
             lambda: job_log(run_dir, pretrain))
    (pause_dir / "arm-startup").unlink()  # the requeued run starts without holding
    (pause_dir / "release-startup").touch()

    convert = slurm_cluster.wait_job(jobs["convert"])
    result = slurm_cluster.wait_job(pretrain)
    log = job_log(run_dir, pretrain)
    assert (result.state, result.exit_code, result.restarts) == ("COMPLETED", 0, 1), log
    assert (convert.state, convert.exit_code) == ("COMPLETED", 0), [p.read_text() for p in (hf_dir.parent / "logs").glob("*")]
    job_out = (run_dir / "logs" / f"cpt-pretrain-{pretrain}.out").read_text()
    assert "preempted before a newer checkpoint (resume point still step -1); requeueing" in job_out
    for rank, rank_log in enumerate(_rank_logs(run_dir, pretrain)):
        assert f"rank {rank} exit {REQUEUE_EXIT_CODE}" in rank_log and f"rank {rank} exit 0" in rank_log
    assert "preempted (SIGUSR1) during start-up, before step 1: nothing new to save" in _rank_logs(run_dir, pretrain)[0]
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, TOTAL_STEPS + 1))  # nothing computed twice
    assert final_meta(run_dir)["step"] == TOTAL_STEPS
    # The conversion ran after the requeued run had completed: it holds the final step.
    assert f"`step_{TOTAL_STEPS:08d}`" in (hf_dir / "README.md").read_text()  # the card names the tag
    for name, job in jobs.items():
        fields = slurm_cluster.job_fields(job)
        expected = {"pretrain": "cpt-pretrain", "convert": "cpt-convert"}.get(name, f"cpt-prep-{name}")
        assert (fields["JobName"], fields["MailUser"], fields["MailType"]) == (expected, "ops@example.com", "END,FAIL")
        if name != "tokenizer":
            assert fields.get("KillOInInvalidDependent") == "Yes", fields


def test_signals_after_the_final_checkpoint_complete_the_job(slurm_cluster: SlurmCluster, tiny_shards_dir: Path,
                                                            tmp_path: Path) -> None:
    """SIGUSR1 to the job while its ranks are exiting after the final checkpoint, then to the batch
    script while it is reporting: the job completes (exit 0, no requeue), so `afterok` chains run."""
    run_dir, pause_dir = tmp_path / "run", tmp_path / "pause"
    rules = f"ranks@exit@pipeline.train;batch@exit@{run_dir}/checkpoints"
    env = {**pretrain_env(run_dir, tiny_shards_dir), **pause_env(pause_dir, rules)}
    (pause_dir / "arm-ranks").touch()
    job = submit(slurm_cluster, "pretrain", env, "--nodes=2", "--ntasks-per-node=1")["pretrain"]

    wait_for("both ranks held at exit", lambda: len(paused(pause_dir, "ranks")) == 2, lambda: job_log(run_dir, job))
    assert final_meta(run_dir)["step"] == TOTAL_STEPS  # the final checkpoint is written and `latest`
    assert slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job]).returncode == 0
    wait_for("SIGUSR1 delivered to both ranks",
             lambda: all("received SIGUSR1, passed on to pid" in log for log in _rank_logs(run_dir, job)),
             lambda: job_log(run_dir, job))
    (pause_dir / "arm-batch").touch()
    (pause_dir / "arm-ranks").unlink()
    (pause_dir / "release-ranks").touch()

    wait_for("the batch script's last report held", lambda: bool(paused(pause_dir, "batch")), lambda: job_log(run_dir, job))
    batch_shell = json.loads(paused(pause_dir, "batch")[0].read_text())["ppid"]
    assert b"slurm_script" in Path(f"/proc/{batch_shell}/cmdline").read_bytes()
    os.kill(batch_shell, signal.SIGUSR1)  # synchronous: pending in the batch shell before it is released
    (pause_dir / "release-batch").touch()

    result = slurm_cluster.wait_job(job)
    log = job_log(run_dir, job)
    assert (result.state, result.exit_code, result.restarts) == ("COMPLETED", 0, 0), log
    for rank, rank_log in enumerate(_rank_logs(run_dir, job)):
        assert f"rank {rank} exit 0" in rank_log
    job_out = (run_dir / "logs" / f"cpt-pretrain-{job}.out").read_text()
    assert f"== done: checkpoint step {TOTAL_STEPS}" in job_out and "USR1 arrived after the last step" in job_out
