"""Shared pytest set-up: the `gpu` marker skips without CUDA; shared tiny-data fixtures live in
`tests/fixtures_data.py` and are re-exported here so every test directory can use them."""
from __future__ import annotations

import os

import pytest
import torch

from tests.gloo_ranks import LAUNCHER_VARIABLES

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:  # the data helper's fixtures (tiny tokenizer, tiny shards)
    from tests.fixtures_data import *  # noqa: F401,F403
except ImportError as err:  # pragma: no cover - only while the module is being written
    if "fixtures_data" not in str(err):
        raise


# `init_distributed` exports these for DeepSpeed; a run inside the pytest process must not leave
# them behind, or a later subprocess (an sbatch job exports the submitter's environment) would take
# the leaked RANK=0 WORLD_SIZE=1 over its launcher's ranks.


@pytest.fixture(autouse=True)
def _restore_launcher_variables():
    before = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
