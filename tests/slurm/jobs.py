"""Helpers of the SLURM job tests: submit through `slurm/submit.sh`, read job and rank logs,
metrics and checkpoints, and wait on observable events (files, log lines, job states) with one
generous deadline instead of fixed sleeps, so a busy CI machine only makes the tests slower."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.train.checkpoint.tags import read_latest, verify_checkpoint
from pipeline.train.run_meta import META_FILE
from tests.slurm.cluster import DEADLINE_S, JobResult, SlurmCluster

REPO_ROOT = Path(__file__).resolve().parents[2]
PAUSE_HOOK = Path(__file__).with_name("pause_hook")
TOTAL_STEPS = 24
GLOBAL_BATCH = 8  # tiny-mlm: 8 sequences per step = micro 4 x accum 1 x 2 ranks


def submit(cluster: SlurmCluster, kind: str, env: dict[str, str], *flags: str) -> dict[str, str]:
    """`slurm/submit.sh KIND FLAGS...` -> {key: job id}; fails the test with its stderr otherwise."""
    out = run_submit(cluster, kind, env, *flags)
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.split())


def run_submit(cluster: SlurmCluster, kind: str, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO_ROOT / "slurm" / "submit.sh"), kind, *flags],
                          env=dict(cluster.env, **env), cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=DEADLINE_S)


def pretrain_env(run_dir: Path, shards: Path, extra: str = "", **more: str) -> dict[str, str]:
    overrides = (
        f"data.shards_dir={shards} deepspeed.config=zero2 train.total_steps={TOTAL_STEPS} "
        f"train.checkpoint_every=8 train.tensorboard=false {extra}"
    )
    return {"CONFIG": "tiny-mlm", "OUTPUT_DIR": str(run_dir), "OVERRIDES": overrides, "PYTHON": sys.executable, **more}


def pause_env(pause_dir: Path, rules: str) -> dict[str, str]:
    """Environment that loads `pause_hook/sitecustomize.py` into the job's Python processes."""
    pause_dir.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join([str(PAUSE_HOOK), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "CPT_TEST_PAUSE_DIR": str(pause_dir), "CPT_TEST_PAUSE": rules}


def job_log(run_dir: Path, job: str) -> str:
    logs = sorted((run_dir / "logs").glob(f"*-{job}.out")) + sorted((run_dir / "logs" / job).glob("rank*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)


def metrics(run_dir: Path) -> list[dict]:
    """Complete lines of metrics.jsonl (polled while the run appends to it)."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]  # the part after the last newline may be half-written


def final_meta(run_dir: Path) -> dict:
    tag = read_latest(run_dir / "checkpoints")
    assert tag is not None, f"no checkpoints/latest in {run_dir}"
    verify_checkpoint(tag)  # raises CheckpointError on a partial or truncated checkpoint
    return json.loads((tag / META_FILE).read_text())


def wait_for(what: str, ready: Callable[[], bool], describe: Callable[[], str] = lambda: "",
             timeout_s: float = DEADLINE_S) -> None:
    """Poll `ready` until it holds; fail with `what` and `describe()` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}\n{describe()}"
        time.sleep(0.1)


def paused(pause_dir: Path, name: str) -> list[Path]:
    return sorted(pause_dir.glob(f"paused-{name}-*"))


@dataclass
class Run:
    dir: Path
    job: str
    result: JobResult
