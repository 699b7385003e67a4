"""`slurm/pretrain.sbatch` on the two-node test cluster: a ZeRO-2 gloo run, preemption + requeue,
and a real error that must not requeue."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.train.checkpoint import read_latest, verify_checkpoint
from pipeline.train.preemption import REQUEUE_EXIT_CODE
from pipeline.train.run_meta import META_FILE
from tests.slurm.cluster import JobResult, SlurmCluster
from tests.slurm.conftest import REPO_ROOT

pytestmark = pytest.mark.slurm

TOTAL_STEPS = 24
GLOBAL_BATCH = 8  # tiny-mlm: 8 sequences per step = micro 4 x accum 1 x 2 ranks


def _submit(cluster: SlurmCluster, env: dict[str, str], *flags: str) -> str:
    out = subprocess.run(
        ["bash", str(REPO_ROOT / "slurm" / "submit.sh"), "pretrain", *flags],
        env=dict(cluster.env, **env), cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split("=", 1)[1]


def _env(run_dir: Path, shards: Path, extra: str = "", **more: str) -> dict[str, str]:
    overrides = (
        f"data.shards_dir={shards} deepspeed.config=zero2 train.total_steps={TOTAL_STEPS} "
        f"train.checkpoint_every=8 train.tensorboard=false {extra}"
    )
    return {"CONFIG": "tiny-mlm", "OUTPUT_DIR": str(run_dir), "OVERRIDES": overrides, "PYTHON": sys.executable, **more}


def _job_log(run_dir: Path, job: str) -> str:
    logs = sorted((run_dir / "logs").glob(f"*-{job}.out")) + sorted((run_dir / "logs" / job).glob("rank*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)


def _metrics(run_dir: Path) -> list[dict]:
    """Complete lines of metrics.jsonl (polled while the run appends to it)."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]  # the part after the last newline may be half-written


def _final_meta(run_dir: Path) -> dict:
    tag = read_latest(run_dir / "checkpoints")
    assert tag is not None, f"no checkpoints/latest in {run_dir}"
    verify_checkpoint(tag)  # raises CheckpointError on a partial or truncated checkpoint
    return json.loads((tag / META_FILE).read_text())


@dataclass
class Run:
    dir: Path
    job: str
    result: JobResult


@pytest.fixture(scope="module")
def reference_run(slurm_cluster: SlurmCluster, tiny_shards_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One uninterrupted two-node run (the preemption test compares against it)."""
    run_dir = tmp_path_factory.mktemp("pretrain") / "reference"
    job = _submit(slurm_cluster, _env(run_dir, tiny_shards_dir), "--nodes=2", "--ntasks-per-node=1")
    return Run(run_dir, job, slurm_cluster.wait_job(job, timeout_s=240))


def test_two_node_zero2_job_finishes_with_a_valid_checkpoint(reference_run: Run) -> None:
    run, log = reference_run, _job_log(reference_run.dir, reference_run.job)
    assert (run.result.state, run.result.exit_code, run.result.restarts) == ("COMPLETED", 0, 0), log
    meta = _final_meta(run.dir)
    assert (meta["step"], meta["world_size"], meta["zero_stage"]) == (TOTAL_STEPS, 2, 2)
    assert meta["consumed_samples"] == TOTAL_STEPS * GLOBAL_BATCH
    tag = read_latest(run.dir / "checkpoints")
    # ZeRO-2 partitions the optimizer state: one file per rank.
    assert sorted(p.name for p in tag.glob("*zero_pp_rank_*optim_states.pt")) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)
    ]
    # Per-job and per-rank logs in the documented places; the job says where outputs go.
    job_log = (run.dir / "logs" / f"cpt-pretrain-{run.job}.out").read_text()
    assert f"checkpoints {run.dir}/checkpoints/" in job_log and f"metrics     {run.dir}/metrics.jsonl" in job_log
    assert "ranks 2, CPU (gloo)" in job_log
    for rank in (0, 1):
        rank_log = (run.dir / "logs" / run.job / f"rank{rank}.log").read_text()
        assert f"rank {rank} exit 0" in rank_log
    assert f"step {TOTAL_STEPS}/{TOTAL_STEPS}" in (run.dir / "logs" / run.job / "rank0.log").read_text()
    steps = [m["step"] for m in _metrics(run.dir)]
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
    env = _env(run_dir, tiny_shards_dir, LAUNCHER=launcher)
    job = _submit(slurm_cluster, env, "--nodes=2", "--ntasks-per-node=1")
    deadline = time.monotonic() + 120
    while not _metrics(run_dir):  # step 1 logged: the preemption handler is installed
        assert time.monotonic() < deadline, _job_log(run_dir, job)
        assert slurm_cluster.job_fields(job).get("JobState") in {"PENDING", "RUNNING", "CONFIGURING"}, _job_log(run_dir, job)
        time.sleep(0.2)
    signalled = slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job], check=False)
    assert signalled.returncode == 0, signalled.stderr
    result = slurm_cluster.wait_job(job, timeout_s=240)
    log = _job_log(run_dir, job)
    assert (result.state, result.exit_code, result.restarts) == ("COMPLETED", 0, 1), log
    job_log = (run_dir / "logs" / f"cpt-pretrain-{job}.out").read_text()
    assert f"received USR1: sending {'USR1' if launcher == 'srun' else 'TERM'} to the ranks" in job_log
    assert "requeueing job" in job_log and "restart 1" in job_log and f"launcher {launcher}" in job_log
    for rank in (0, 1):  # both ranks exited with the requeue code in the first run, 0 in the second
        rank_log = (run_dir / "logs" / job / f"rank{rank}.log").read_text()
        assert f"rank {rank} exit {REQUEUE_EXIT_CODE}" in rank_log and f"rank {rank} exit 0" in rank_log

    reference, resumed = _final_meta(reference_run.dir), _final_meta(run_dir)
    assert (resumed["step"], resumed["consumed_samples"]) == (reference["step"], reference["consumed_samples"])
    assert resumed["tokens_seen"] == reference["tokens_seen"]
    # Each step logged once (nothing repeated or skipped across the requeue), with the same loss.
    got, want = _metrics(run_dir), _metrics(reference_run.dir)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    assert [m["consumed_samples"] for m in got] == [m["consumed_samples"] for m in want]
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=1e-6)


def test_a_real_error_fails_the_job_without_requeue(slurm_cluster: SlurmCluster, tiny_shards_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "bad"
    job = _submit(slurm_cluster, _env(run_dir, tiny_shards_dir, extra="optim.lr=-1"), "--nodes=2", "--ntasks-per-node=1")
    result = slurm_cluster.wait_job(job, timeout_s=120)
    log = _job_log(run_dir, job)
    assert (result.state, result.restarts) == ("FAILED", 0), log
    assert result.exit_code not in (0, REQUEUE_EXIT_CODE)
    assert "not requeued" in log and "optim.lr" in log


def test_preemption_past_max_requeues_ends_the_job_with_a_resumable_checkpoint(
    slurm_cluster: SlurmCluster, tiny_shards_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "capped"
    job = _submit(slurm_cluster, _env(run_dir, tiny_shards_dir, MAX_REQUEUES="0"), "--nodes=2", "--ntasks-per-node=1")
    deadline = time.monotonic() + 120
    while not _metrics(run_dir):  # step 1 logged: the preemption handler is installed
        assert time.monotonic() < deadline, _job_log(run_dir, job)
        time.sleep(0.2)
    slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job])
    result = slurm_cluster.wait_job(job, timeout_s=120)
    log = _job_log(run_dir, job)
    assert (result.state, result.exit_code, result.restarts) == ("FAILED", REQUEUE_EXIT_CODE, 0), log
    assert "NOT requeueing: MAX_REQUEUES=0 reached" in log
    meta = _final_meta(run_dir)  # the preemption checkpoint is complete: a resubmission resumes from it
    assert 1 <= meta["step"] < TOTAL_STEPS and meta["consumed_samples"] == meta["step"] * GLOBAL_BATCH


def test_convert_job_turns_the_run_into_a_hugging_face_model(
    slurm_cluster: SlurmCluster, reference_run: Run, tmp_path: Path
) -> None:
    from transformers import AutoConfig

    hf_dir = tmp_path / "hf"
    env = dict(slurm_cluster.env, CHECKPOINT=str(reference_run.dir), HF_DIR=str(hf_dir), PYTHON=sys.executable)
    submitted = subprocess.run(["bash", str(REPO_ROOT / "slurm" / "submit.sh"), "convert"],
                               env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split("=", 1)[1]
    result = slurm_cluster.wait_job(job, timeout_s=180)
    log = (tmp_path / "logs" / f"cpt-convert-{job}.out").read_text()
    assert (result.state, result.exit_code) == ("COMPLETED", 0), log
    assert (hf_dir / "model.safetensors").is_file()
    meta = _final_meta(reference_run.dir)
    assert AutoConfig.from_pretrained(hf_dir).hidden_size == meta["encoder_config"]["hidden_size"]
