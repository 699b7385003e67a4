"""Fixtures of the training tests (the shard fixtures come from tests/fixtures_data.py).

Every run uses one intra-op thread — in-process (`torch.set_num_threads(1)`) and in subprocesses
(`OMP_NUM_THREADS=1`, see `runs._env`) — so that runs of both kinds compute bit-identical results
and the ranks of 2-rank runs do not oversubscribe the CPU."""
from __future__ import annotations

import logging

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_quiet_deepspeed():
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
