"""The `slurm_cluster` fixture: one two-node SLURM cluster on loopback for the whole session.

Started lazily by the first test that asks for it and stopped at the end of the session (only
the daemons it started). Skipped, with the reason, where SLURM/munge are not installed
(`bash scripts/install_test_deps.sh` installs them) or the tests do not run as root.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.slurm.cluster import DEADLINE_S, SlurmCluster, missing_requirements
from tests.slurm.jobs import REPO_ROOT, Run, pretrain_env, submit

__all__ = ["REPO_ROOT", "slurm_cluster", "reference_run"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A job test waits on several jobs, each within DEADLINE_S: its own time limit is the sum."""
    for item in items:
        if "slurm" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(4 * DEADLINE_S))


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(nodes=("node1", "node2"), cpus_per_node=1).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def reference_run(slurm_cluster: SlurmCluster, tiny_shards_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One uninterrupted two-node ZeRO-2 run of tiny-mlm (the preemption tests compare against it)."""
    run_dir = tmp_path_factory.mktemp("pretrain") / "reference"
    job = submit(slurm_cluster, "pretrain", pretrain_env(run_dir, tiny_shards_dir), "--nodes=2",
                 "--ntasks-per-node=1")["pretrain"]
    return Run(run_dir, job, slurm_cluster.wait_job(job))
