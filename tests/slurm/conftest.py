"""The `slurm_cluster` fixture: one two-node SLURM cluster on loopback for the whole session.

Started lazily by the first test that asks for it and stopped at the end of the session (only
the daemons it started). Skipped, with the reason, where SLURM/munge are not installed
(`bash scripts/install_test_deps.sh` installs them) or the tests do not run as root.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.slurm.cluster import SlurmCluster, missing_requirements

REPO_ROOT = Path(__file__).resolve().parents[2]


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
