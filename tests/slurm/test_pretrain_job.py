"""`slurm/pretrain.sbatch` on the two-node test cluster: a ZeRO-2 gloo run, preemption + requeue,
and a real error that must not requeue."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.train.checkpoint.tags import read_latest
from pipeline.train.preemption import REQUEUE_EXIT_CODE
from tests.slurm.cluster import DEADLINE_S, SlurmCluster
from tests.slurm.jobs import (
    GLOBAL_BATCH,
    REPO_ROOT,
    TOTAL_STEPS,
    Run,
    final_meta,
    job_log,
    metrics,
    pretrain_env,
    run_submit,
    submit,
    wait_for,
)

pytestmark = pytest.mark.slurm


def _submit(cluster: SlurmCluster, env: dict[str, str], *flags: str) -> str:
    return submit(cluster, "pretrain", env, *flags)["pretrain"]


def test_two_node_zero2_job_finishes_with_a_valid_checkpoint(reference_run: Run) -> None:
    run, log = reference_run, job_log(reference_run.dir, reference_run.job)
    assert (run.result.state, run.result.exit_code, run.result.restarts) == ("COMPLETED", 0, 0), log
    meta = final_meta(run.dir)
    assert (meta["step"], meta["world_size"], meta["zero_stage"]) == (TOTAL_STEPS, 2, 2)
    assert meta["consumed_samples"] == TOTAL_STEPS * GLOBAL_BATCH
    tag = read_latest(run.dir / "checkpoints")
    # ZeRO-2 partitions the optimizer state: one file per rank.
    assert sorted(p.name for p in tag.glob("*zero_pp_rank_*optim_states.pt")) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)
    ]
    # Per-job and per-rank logs in the documented places; the job says where outputs go.
    job_out = (run.dir / "logs" / f"cpt-pretrain-{run.job}.out").read_text()
    assert f"checkpoints {run.dir}/checkpoints/" in job_out and f"metrics     {run.dir}/metrics.jsonl" in job_out
    assert "ranks 2, CPU (gloo)" in job_out
    for rank in (0, 1):
        rank_log = (run.dir / "logs" / run.job / f"rank{rank}.log").read_text()
        assert f"rank {rank} exit 0" in rank_log
    assert f"step {TOTAL_STEPS}/{TOTAL_STEPS}" in (run.dir / "logs" / run.job / "rank0.log").read_text()
    steps = [m["step"] for m in metrics(run.dir)]
    assert steps == list(range(1, TOTAL_STEPS + 1))


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_preempted_job_requeues_and_ends_like_the_uninterrupted_one(
    slurm_cluster: SlurmCluster, reference_run: Run, tiny_shards_dir: Path, tmp_path: Path, launcher: str
) -> None:
    """SIGUSR1 to the batch script mid-run (what --signal=B:USR1@SECS sends before the time limit):
    the ranks checkpoint and exit 75, the script requeues the job, the second run resumes; step,
    consumed samples and every logged loss match the uninterrupted srun run. Under mpirun the
    script passes the signal on as SIGTERM (what Hydra forwards to the ranks)."""
    run_dir = tmp_path / "preempted"
    env = pretrain_env(run_dir, tiny_shards_dir, LAUNCHER=launcher)
    job = _submit(slurm_cluster, env, "--nodes=2", "--ntasks-per-node=1")
    wait_for("step 1 of the run", lambda: bool(metrics(run_dir)), lambda: job_log(run_dir, job))
    signalled = slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job], check=False)
    assert signalled.returncode == 0, signalled.stderr
    result = slurm_cluster.wait_job(job)
    log = job_log(run_dir, job)
    assert (result.state, result.exit_code, result.restarts) == ("COMPLETED", 0, 1), log
    job_out = (run_dir / "logs" / f"cpt-pretrain-{job}.out").read_text()
    assert f"received USR1: sending {'USR1' if launcher == 'srun' else 'TERM'} to the ranks" in job_out
    assert "requeueing job" in job_out and "restart 1" in job_out and f"launcher {launcher}" in job_out
    for rank in (0, 1):  # both ranks exited with the requeue code in the first run, 0 in the second
        rank_log = (run_dir / "logs" / job / f"rank{rank}.log").read_text()
        assert f"rank {rank} exit {REQUEUE_EXIT_CODE}" in rank_log and f"rank {rank} exit 0" in rank_log

    reference, resumed = final_meta(reference_run.dir), final_meta(run_dir)
    assert (resumed["step"], resumed["consumed_samples"]) == (reference["step"], reference["consumed_samples"])
    assert resumed["tokens_seen"] == reference["tokens_seen"]
    # Each step logged once (nothing repeated or skipped across the requeue), with the same loss.
    got, want = metrics(run_dir), metrics(reference_run.dir)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    assert [m["consumed_samples"] for m in got] == [m["consumed_samples"] for m in want]
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=1e-6)


def test_a_config_error_is_refused_before_anything_is_queued(slurm_cluster: SlurmCluster, tiny_shards_dir: Path,
                                                            tmp_path: Path) -> None:
    """submit.sh runs `pipeline.train --check` for the job's own rank count: 8 sequences per step
    with micro-batches of 8 fit one rank, not the two of `--nodes=2`."""
    run_dir = tmp_path / "refused"
    env = pretrain_env(run_dir, tiny_shards_dir, extra="data.micro_batch_size=8")
    queued_before = slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout
    out = run_submit(slurm_cluster, "pretrain", env, "--nodes=2", "--ntasks-per-node=1")
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert "checking config, data and checkpoint for 2 rank(s)" in out.stderr
    assert "data.global_batch_size=8 is not divisible by data.micro_batch_size=8 x world size 2" in out.stderr
    assert "nothing was submitted" in out.stderr
    assert slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout == queued_before


def test_a_real_error_fails_the_job_without_requeue(slurm_cluster: SlurmCluster, tiny_shards_dir: Path, tmp_path: Path) -> None:
    """An error the job hits itself (here: a config error let through with SKIP_CHECK=1): no requeue,
    and the job log says per rank what the exit status means and its first error line."""
    run_dir = tmp_path / "bad"
    env = pretrain_env(run_dir, tiny_shards_dir, extra="optim.lr=-1", SKIP_CHECK="1")
    job = _submit(slurm_cluster, env, "--nodes=2", "--ntasks-per-node=1")
    result = slurm_cluster.wait_job(job)
    log = job_log(run_dir, job)
    assert (result.state, result.restarts) == ("FAILED", 0), log
    assert result.exit_code not in (0, REQUEUE_EXIT_CODE)
    job_out = (run_dir / "logs" / f"cpt-pretrain-{job}.out").read_text()
    assert "not requeued" in job_out
    for rank in (0, 1):
        assert (f"rank {rank}: exit 2 (bad config, data or checkpoint: nothing was computed): "
                "error: optim.lr=-1.0: must be > 0") in job_out, job_out


def test_preemption_past_max_requeues_ends_the_job_with_a_resumable_checkpoint(
    slurm_cluster: SlurmCluster, tiny_shards_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "capped"
    job = _submit(slurm_cluster, pretrain_env(run_dir, tiny_shards_dir, MAX_REQUEUES="0"), "--nodes=2", "--ntasks-per-node=1")
    wait_for("step 1 of the run", lambda: bool(metrics(run_dir)), lambda: job_log(run_dir, job))
    slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job])
    result = slurm_cluster.wait_job(job)
    log = job_log(run_dir, job)
    assert (result.state, result.exit_code, result.restarts) == ("FAILED", REQUEUE_EXIT_CODE, 0), log
    assert "NOT requeueing: MAX_REQUEUES=0 reached" in log
    meta = final_meta(run_dir)  # the preemption checkpoint is complete: a resubmission resumes from it
    assert 1 <= meta["step"] < TOTAL_STEPS and meta["consumed_samples"] == meta["step"] * GLOBAL_BATCH


def test_convert_job_turns_the_run_into_a_hugging_face_model(
    slurm_cluster: SlurmCluster, reference_run: Run, tmp_path: Path
) -> None:
    from transformers import AutoConfig

    hf_dir = tmp_path / "hf"
    env = dict(slurm_cluster.env, CHECKPOINT=str(reference_run.dir), HF_DIR=str(hf_dir), PYTHON=sys.executable)
    submitted = subprocess.run(["bash", str(REPO_ROOT / "slurm" / "submit.sh"), "convert"],
                               env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=DEADLINE_S)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split("=", 1)[1]
    result = slurm_cluster.wait_job(job)
    log = (tmp_path / "logs" / f"cpt-convert-{job}.out").read_text()
    assert (result.state, result.exit_code) == ("COMPLETED", 0), log
    assert (hf_dir / "model.safetensors").is_file()
    meta = final_meta(reference_run.dir)
    assert AutoConfig.from_pretrained(hf_dir).hidden_size == meta["encoder_config"]["hidden_size"]
