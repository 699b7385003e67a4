"""`slurm/pretrain.sbatch` with training phases (`pipeline.train.phases.schedule`): a job preempted in a
two-phase run (L=64 -> L=128) is requeued, and its second run resumes into the right phase at the
right sample; every step is logged once, with the losses of the same run uninterrupted."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from pipeline.train.checkpoint.tags import TRAIN_STATE_FILE
from tests.slurm.cluster import SlurmCluster
from tests.slurm.jobs import TOTAL_STEPS, job_log, metrics, pretrain_env, submit, wait_for
from tests.train.runs import metric_rows, run_torchrun
from tests.train.test_phases import long_shards_dir  # noqa: F401  (fixture: the tiny corpus at seq_len 128)

pytestmark = pytest.mark.slurm


def test_a_requeued_job_resumes_into_the_right_phase(slurm_cluster: SlurmCluster, tiny_shards_dir: Path,
                                                     long_shards_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    config = tmp_path / "two-phase.yaml"
    phases = [{"name": "short", "steps": 2},
              {"name": "long", "steps": TOTAL_STEPS - 2, "shards_dir": str(long_shards_dir), "seq_len": 128,
               "micro_batch_size": 2, "global_batch_size": 4}]
    config.write_text("inherit: tiny-mlm\nphases: " + json.dumps(phases) + "\n")
    run_dir = tmp_path / "preempted"
    env = pretrain_env(run_dir, tiny_shards_dir, "train.keep_last=10", CONFIG=str(config))
    job = submit(slurm_cluster, "pretrain", env, "--nodes=2", "--ntasks-per-node=1")["pretrain"]
    wait_for("step 3 (phase 2) of the run", lambda: len(metrics(run_dir)) >= 3, lambda: job_log(run_dir, job))
    signalled = slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job], check=False)
    assert signalled.returncode == 0, signalled.stderr
    result = slurm_cluster.wait_job(job)
    log = job_log(run_dir, job)
    assert (result.state, result.exit_code, result.restarts) == ("COMPLETED", 0, 1), log

    rank0 = (run_dir / "logs" / job / "rank0.log").read_text()
    found = re.search(r"resumed from (\S+) at step (\d+)", rank0)
    assert found, log
    tag, step = Path(found.group(1)), int(found.group(2))
    state = torch.load(tag / TRAIN_STATE_FILE, map_location="cpu", weights_only=False)
    assert state["phase"] == ("long" if step > 2 else "short") and step >= 2, (step, state["phase"])

    got = metrics(run_dir)
    assert [m["step"] for m in got] == list(range(1, TOTAL_STEPS + 1))  # each step once across the requeue
    assert [m["phase"] for m in got] == [0, 0] + [1] * (TOTAL_STEPS - 2)
    reference = tmp_path / "reference"  # the same run uninterrupted: 2 ranks, gloo, ZeRO-2
    run_torchrun(str(config), tiny_shards_dir, reference, "deepspeed.config=zero2", f"train.total_steps={TOTAL_STEPS}",
                 "train.checkpoint_every=8", "train.tensorboard=false")
    want = metric_rows(reference)
    assert [m["consumed_samples"] for m in got] == [want[s]["consumed_samples"] for s in range(1, TOTAL_STEPS + 1)]
    assert [m["tokens_seen"] for m in got] == [want[s]["tokens_seen"] for s in range(1, TOTAL_STEPS + 1)]
    assert [m["loss"] for m in got] == pytest.approx([want[s]["loss"] for s in range(1, TOTAL_STEPS + 1)], rel=1e-6)
