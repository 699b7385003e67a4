"""`mpirun -np 2` (MPICH from the PyPI package `mpich`) launches the same training as torchrun."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from pipeline.train.checkpoint.tags import read_latest, verify_checkpoint
from pipeline.train.run_meta import META_FILE
from tests.gloo_ranks import LAUNCHER_VARIABLES

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 12


def _mpich_mpirun() -> str:
    """The mpirun the `mpich` wheel installs beside this interpreter (else the one on PATH)."""
    beside = Path(sysconfig.get_path("scripts")) / "mpirun"
    candidate = str(beside) if beside.is_file() else shutil.which("mpirun")
    if candidate is None:
        pytest.skip("no mpirun: pip install mpich")
    version = subprocess.run([candidate, "--version"], capture_output=True, text=True, timeout=30).stdout
    if "HYDRA" not in version:
        pytest.skip(f"{candidate} is not MPICH's Hydra mpirun")
    return candidate


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    for key in [k for k in env if k.startswith(("SLURM_", "PMI_", "OMPI_")) or k in LAUNCHER_VARIABLES]:
        del env[key]  # the launcher under test must provide the ranks
    return env


def _train_args(shards: Path, out: Path) -> list[str]:
    return [
        "-m", "pipeline.train", "--config", "tiny-mlm", f"data.shards_dir={shards}", f"train.output_dir={out}",
        "deepspeed.config=zero2", f"train.total_steps={STEPS}", "train.checkpoint_every=6", "train.tensorboard=false",
    ]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_mpirun_rank_discovery_and_all_reduce(tmp_path: Path) -> None:
    mpirun = _mpich_mpirun()
    out = subprocess.run([mpirun, "-np", "2", sys.executable, "-m", "tests.launch.dist_probe", str(tmp_path)],
                         env=_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert [(r["rank"], r["local_rank"], r["world_size"], r["launcher"]) for r in records] == [(0, 0, 2, "mpi"), (1, 1, 2, "mpi")]
    assert {r["all_reduce_sum"] for r in records} == {3.0}
    assert len({r["master_port"] for r in records}) == 1  # rank 0's free port, broadcast with mpi4py


def test_mpirun_trains_like_torchrun(tiny_shards_dir: Path, tmp_path: Path) -> None:
    mpirun = _mpich_mpirun()
    mpi_dir, torchrun_dir = tmp_path / "mpirun", tmp_path / "torchrun"
    out = subprocess.run([mpirun, "-np", "2", sys.executable, *_train_args(tiny_shards_dir, mpi_dir)],
                         env=_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    tag = read_latest(mpi_dir / "checkpoints")
    verify_checkpoint(tag)
    meta = json.loads((tag / META_FILE).read_text())
    assert (meta["step"], meta["world_size"], meta["zero_stage"], meta["consumed_samples"]) == (STEPS, 2, 2, STEPS * 8)

    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          *_train_args(tiny_shards_dir, torchrun_dir)],
                         env=_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    mpi, torchrun = _metrics(mpi_dir), _metrics(torchrun_dir)
    assert [m["step"] for m in mpi] == [m["step"] for m in torchrun] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in mpi] == pytest.approx([m["loss"] for m in torchrun], rel=1e-6)
