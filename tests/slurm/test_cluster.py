"""The test cluster itself, and rank discovery under `srun` and under `mpirun` inside an allocation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.slurm.cluster import SlurmCluster
from tests.slurm.conftest import REPO_ROOT

pytestmark = pytest.mark.slurm


def test_batch_job_runs_and_writes_its_output(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "hostname.out"
    job = slurm_cluster.sbatch(["--wrap", "echo node=$SLURMD_NODENAME; hostname", f"--output={out}"])
    result = slurm_cluster.wait_job(job, timeout_s=60)
    assert (result.state, result.exit_code) == ("COMPLETED", 0), slurm_cluster.logs()
    assert out.read_text().splitlines()[0] in {"node=node1", "node=node2"}


def test_two_node_srun_starts_one_task_per_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "srun.out"
    job = slurm_cluster.sbatch(
        ["--nodes=2", "--ntasks-per-node=1", f"--output={out}", "--wrap", "srun bash -c 'echo $SLURM_PROCID $SLURMD_NODENAME'"]
    )
    assert slurm_cluster.wait_job(job, timeout_s=60).state == "COMPLETED", out.read_text()
    assert sorted(out.read_text().split("\n")[:2]) == ["0 node1", "1 node2"]


def _probe_records(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("rank*.json"))]


@pytest.mark.parametrize("launcher, expected", [("srun", "slurm"), ("mpirun", "mpi")])
def test_rank_discovery_and_all_reduce_inside_an_allocation(
    slurm_cluster: SlurmCluster, tmp_path: Path, launcher: str, expected: str
) -> None:
    """`init_distributed` finds ranks 0 and 1 on two nodes and gloo all_reduce works across them.

    Under mpirun the ranks also inherit the per-node proxy step's SLURM_PROCID (0 on both
    nodes), so this fails if SLURM variables win over MPI ones.
    """
    probe_dir, out = tmp_path / "probe", tmp_path / "probe.out"
    job = slurm_cluster.sbatch([
        "--nodes=2", "--ntasks-per-node=1", f"--chdir={REPO_ROOT}", f"--output={out}",
        "--wrap", f"{launcher} {'-np 2 ' if launcher == 'mpirun' else ''}python -m tests.launch.dist_probe {probe_dir}",
    ])
    result = slurm_cluster.wait_job(job, timeout_s=120)
    assert result.state == "COMPLETED", out.read_text()
    records = _probe_records(probe_dir)
    assert [r["rank"] for r in records] == [0, 1]
    assert {r["world_size"] for r in records} == {2}
    assert {r["launcher"] for r in records} == {expected}
    assert [r["dist_rank"] for r in records] == [0, 1]
    assert {r["all_reduce_sum"] for r in records} == {3.0}
    assert {r["slurm_node"] for r in records} == {"node1", "node2"}
    assert {r["local_rank"] for r in records} == {0}  # one rank per node
    if launcher == "srun":
        # Node names do not resolve here: the rendezvous must be node1's SLURM NodeAddr.
        assert {r["master_addr"] for r in records} == {"127.0.0.1"}
