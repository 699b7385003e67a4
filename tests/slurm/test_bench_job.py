"""`slurm/submit.sh bench`: a throughput sweep over 1 and 2 nodes inside one allocation."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.cluster import SlurmCluster
from tests.slurm.conftest import REPO_ROOT

pytestmark = pytest.mark.slurm


def test_bench_sweep_measures_each_node_count_and_reports_scaling(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out_dir = tmp_path / "bench"
    env = dict(
        slurm_cluster.env, OUTPUT_DIR=str(out_dir), NODE_COUNTS="1 2", PYTHON=sys.executable,
        BENCH_ARGS="--objectives mlm --sizes tiny --seq-lens 32 --micro-batch 2 --steps 2 --warmup 1 --vocab-size 1000",
    )
    submitted = subprocess.run(["bash", str(REPO_ROOT / "slurm" / "submit.sh"), "bench", "--nodes=2", "--ntasks-per-node=1"],
                               env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split("=", 1)[1]
    result = slurm_cluster.wait_job(job, timeout_s=300)
    job_log = (out_dir / "logs" / f"cpt-bench-{job}.out").read_text()
    assert (result.state, result.exit_code) == ("COMPLETED", 0), job_log

    for nodes in (1, 2):
        rows = json.loads((out_dir / f"n{nodes}" / "throughput.json").read_text())["rows"]
        assert [(r["objective"], r["nodes"], r["world_size"], r["error"]) for r in rows] == [("mlm", nodes, nodes, None)]
        assert rows[0]["tokens_per_s"] > 0
        # Every rank of the step logged where the documentation says.
        assert sorted(p.name for p in (out_dir / "logs" / job / f"n{nodes}").glob("rank*.log")) == [f"rank{r}.log" for r in range(nodes)]
    scaling = json.loads((out_dir / "scaling" / "scaling.json").read_text())["rows"]
    assert sorted((r["nodes"], r["world_size"]) for r in scaling) == [(1, 1), (2, 2)]
    assert next(r for r in scaling if r["nodes"] == 1)["scaling_efficiency"] == pytest.approx(1.0)


def test_bench_rejects_a_node_count_larger_than_the_allocation(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out_dir = tmp_path / "bench"
    env = dict(slurm_cluster.env, OUTPUT_DIR=str(out_dir), NODE_COUNTS="1 3", PYTHON=sys.executable)
    submitted = subprocess.run(["bash", str(REPO_ROOT / "slurm" / "submit.sh"), "bench", "--nodes=2"],
                               env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    job = submitted.stdout.strip().split("=", 1)[1]
    result = slurm_cluster.wait_job(job, timeout_s=60)
    assert (result.state, result.exit_code) == ("FAILED", 2)
    assert "NODE_COUNTS: '3' is not a node count between 1 and the allocation's 2 nodes" in (
        out_dir / "logs" / f"cpt-bench-{job}.out").read_text()
