"""Fixtures of the fault-injection suite: the training tests' one-thread set-up (so in-process and
subprocess runs compute alike) and the shared tiny shards (tests/fixtures_data.py, via the root
conftest); a small finished run and its export, for the faults of the tools that read them."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.conftest import _one_thread_quiet_deepspeed  # noqa: F401 - autouse fixture, re-exported


@pytest.fixture(scope="session")
def small_run(tmp_path_factory: pytest.TempPathFactory, tiny_shards_dir: Path) -> Path:
    """A 4-step tiny MLM run (ZeRO-1, checkpoints at steps 2 and 4) on its own copy of the shards."""
    from tests.faults.faults import copy_shards
    from tests.train.runs import run_inprocess

    base = tmp_path_factory.mktemp("small_run")
    shards = copy_shards(tiny_shards_dir, base / "shards")
    out = base / "run"
    assert run_inprocess("tiny-mlm", shards, out, "train.total_steps=4", "train.checkpoint_every=2",
                         "train.keep_last=5") == 0
    return out


@pytest.fixture(scope="session")
def small_export(small_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`cpt-convert` of `small_run`'s latest checkpoint (read-only for the tests: copy it to change it)."""
    from pipeline.export.convert import main as convert_main

    out = tmp_path_factory.mktemp("small_export") / "hf"
    assert convert_main([str(small_run), str(out)]) == 0
    return out
