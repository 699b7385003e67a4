"""DeepSpeed's CPU communication op (`pipeline.distributed.cpu_comm_op`, issue 58): DeepSpeed JIT-builds its
shared-memory all-reduce with g++ the first time a process group starts on the CPU (about 100 s idle, minutes
on a busy machine) without a word. A single process does without it: a training run in a fresh extensions
directory compiles nothing. Several ranks need it: rank 0 says so before the build, once."""
from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

from pipeline.capabilities import SHM_COMM_OP
from pipeline.distributed import cpu_comm_op
from tests.train.runs import DEADLINE_S, REPO, _env, train_command


def test_one_process_trains_without_building_the_op(tiny_shards_dir: Path, tmp_path: Path) -> None:
    extensions = tmp_path / "torch_extensions"  # fresh: nothing built yet
    started = time.monotonic()
    proc = subprocess.run(train_command("tiny-mlm", tiny_shards_dir, tmp_path / "run", "train.total_steps=3",
                                        "train.checkpoint_every=3"),
                          cwd=REPO, env=_env({"TORCH_EXTENSIONS_DIR": str(extensions)}), capture_output=True,
                          text=True, timeout=DEADLINE_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (extensions / SHM_COMM_OP).exists(), "the shared-memory op was built for one process"
    assert "Building extension module" not in proc.stderr and "built successfully" not in proc.stdout + proc.stderr
    assert time.monotonic() - started < 90  # the build alone took 100+ s


def test_several_ranks_are_told_before_the_build(tmp_path: Path, monkeypatch, caplog) -> None:
    import deepspeed.ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="pipeline.distributed"):
        with cpu_comm_op(world_size=2, rank=0):
            pass
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith(f"DeepSpeed now builds its CPU communication op ({SHM_COMM_OP}) with g++ for the 2 ranks: "
                           "once per Python environment") and str(tmp_path / SHM_COMM_OP) in said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline.distributed"):
        with cpu_comm_op(world_size=2, rank=1):  # the other ranks stay quiet
            pass
        (tmp_path / SHM_COMM_OP).mkdir()
        (tmp_path / SHM_COMM_OP / f"{SHM_COMM_OP}.so").write_bytes(b"")
        with cpu_comm_op(world_size=2, rank=0):  # built: nothing to say
            pass
    assert caplog.records == []
    before = deepspeed.ops.__compatible_ops__.get(SHM_COMM_OP)
    with cpu_comm_op(world_size=1, rank=0):
        assert deepspeed.ops.__compatible_ops__[SHM_COMM_OP] is False
    assert deepspeed.ops.__compatible_ops__.get(SHM_COMM_OP) == before  # DeepSpeed's record restored
