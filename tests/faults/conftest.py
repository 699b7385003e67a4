"""Fixtures of the fault-injection suite: the training tests' one-thread set-up (so in-process and
subprocess runs compute alike) and the shared tiny shards (tests/fixtures_data.py, via the root
conftest)."""
from __future__ import annotations

from tests.train.conftest import _one_thread_quiet_deepspeed  # noqa: F401 - autouse fixture, re-exported
