"""`pipeline.distributed.discover`: which launcher's variables win (no processes started)."""
from __future__ import annotations

from pipeline.distributed import DistInfo, discover

# What a rank sees under `mpirun` inside a SLURM allocation: Hydra starts one proxy per node with
# srun, so SLURM_PROCID is the proxy's (node) index while PMI_RANK is the rank's own.
MPIRUN_IN_ALLOCATION = {
    "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
    "PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1",
}


def test_mpi_variables_win_over_the_proxy_steps_slurm_ones() -> None:
    assert discover(MPIRUN_IN_ALLOCATION) == DistInfo(3, 4, 1, "mpi")


def test_srun_task_variables() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    assert discover(env) == DistInfo(5, 8, 1, "slurm")


def test_the_batch_script_of_a_multi_task_job_is_a_single_process() -> None:
    # What sbatch --nodes=2 --ntasks-per-node=1 shows the batch script: SLURM_PROCID=0 and the
    # job's task count, but no step id. A python run there is not rank 0 of 2 (it would wait
    # for a rank 1 that never comes).
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NNODES": "2"}
    assert discover(env) == DistInfo(0, 1, 0, "single")


def test_open_mpi_variables() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert discover(env) == DistInfo(2, 4, 0, "mpi")


def test_torch_variables_win_over_everything() -> None:
    env = dict(MPIRUN_IN_ALLOCATION, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    assert discover(env) == DistInfo(1, 2, 1, "env")
