"""Fixtures of the training tests (the shard fixtures come from tests/fixtures_data.py)."""
from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet_deepspeed() -> None:
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
