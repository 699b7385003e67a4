"""Helpers of the training tests: run `pipeline.train` in-process, as a subprocess, or on 2 ranks.

Every run uses a tiny preset (2 layers, hidden 64, seq_len 64 shards), fp32 on CPU, and writes
one metrics line per step, so per-step losses can be compared bit for bit.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from pipeline.train.checkpoint.tags import CHECKPOINT_DIR, read_latest, step_of_tag
from pipeline.train.metrics import read_jsonl
from tests.gloo_ranks import LAUNCHER_VARIABLES, free_port

REPO = Path(__file__).resolve().parents[2]
QUIET = ["train.progress_bar=false", "train.tensorboard=false", "train.log_every=1"]

#: Deadline of every wait on a subprocess: generous, because these tests share a busy CI machine and
#: every wait ends as soon as its event is observed (no fixed sleeps).
DEADLINE_S = 600


def overrides(shards: Path, out: Path, *extra: str) -> list[str]:
    return [f"data.shards_dir={shards}", f"train.output_dir={out}", *QUIET, *extra]


def run_inprocess(preset: str, shards: Path, out: Path, *extra: str) -> int:
    """`pipeline.train.main` in this process (world size 1) with one intra-op thread; returns the exit code.

    The thread count is set here, not only by the conftest's per-test fixture: a module-scoped fixture
    (a reference run) is built before any function-scoped fixture, so it would otherwise run with the
    process's default threads and differ in the last bits from the runs it is compared with."""
    from pipeline.train.cli import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(["--config", preset, *overrides(shards, out, *extra)])
    finally:
        torch.set_num_threads(previous)


def _env(extra: Optional[dict] = None) -> dict:
    """The test process's environment with one intra-op thread, like the in-process runs (conftest)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    for key in LAUNCHER_VARIABLES:
        env.pop(key, None)
    env.update(extra or {})
    return env


def train_command(preset: str, shards: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.train", "--config", preset, *overrides(shards, out, *extra)]


def start_subprocess(preset: str, shards: Path, out: Path, *extra: str) -> subprocess.Popen:
    """One rank, no launcher, in its own process (so it can be killed)."""
    return subprocess.Popen(train_command(preset, shards, out, *extra), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start_ranks(preset: str, shards: Path, out: Path, *extra: str, world: int = 2) -> list[subprocess.Popen]:
    """`world` processes with the torch env variables set, as srun or torchrun would."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = _env({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        procs.append(subprocess.Popen(train_command(preset, shards, out, *extra), cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def run_torchrun(preset: str, shards: Path, out: Path, *extra: str, world: int = 2, timeout: float = DEADLINE_S) -> None:
    """2 ranks under torchrun (gloo on CPU); fails the test with the output on a non-zero exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "-m", "pipeline.train", "--config", preset, *overrides(shards, out, *extra)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def wait_all(procs: Sequence[subprocess.Popen], timeout: float = DEADLINE_S) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        codes.append(proc.returncode)
    return codes


def output_of(proc: subprocess.Popen) -> str:
    return proc.stdout.read() if proc.stdout else ""


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = DEADLINE_S) -> None:
    """Poll metrics.jsonl until it shows `step` (fails if the process ends first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("step", 0) >= step for r in read_jsonl(out / "metrics.jsonl")):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended (rc {proc.returncode}) before step {step}:\n{output_of(proc)[-3000:]}")
        time.sleep(0.005)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def stop(proc: subprocess.Popen, timeout: float = DEADLINE_S) -> None:
    """SIGSTOP `proc` and wait until every thread of it has stopped (`kill` only queues the stop: a
    thread running on another core goes on for a moment), so its files hold still while read."""
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{proc.pid}/task").glob("*/stat"):
            try:
                states.append(task.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):  # a thread that ended meanwhile
                continue
        if all(state in "tTZX" for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"pid {proc.pid} did not stop in {timeout}s")


def kill_after_a_checkpoint(out: Path, step: int, proc: subprocess.Popen, timeout: float = DEADLINE_S) -> int:
    """`kill -9` a run once it logged `step`, at a moment when `latest` names a complete checkpoint and
    metrics.jsonl already holds steps after it (what the kill -9 tests resume from); returns that
    checkpoint's step. Seeing step N logged says neither: `latest` moves on the checkpoint finisher's
    thread while the next steps run (`pipeline.train.checkpoint.tags.CheckpointFinisher`), and a late kill
    can fall right after a save, before the next step is logged. So the run is stopped (SIGSTOP),
    looked at, and killed, or let go on and looked at again."""
    wait_for_step(out, step, proc, timeout)
    deadline = time.monotonic() + timeout
    while True:
        stop(proc, timeout)
        tag = latest(out)
        saved = step_of_tag(tag.name) if tag is not None else None
        if saved is not None and max(losses(out)) > saved:
            proc.kill()  # works on a stopped process
            assert proc.wait(timeout=timeout) == -signal.SIGKILL
            return saved
        os.kill(proc.pid, signal.SIGCONT)
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the run ended (rc {proc.wait()}) or {timeout}s passed before a moment with a complete "
                                 f"checkpoint and later steps logged:\n{output_of(proc)[-3000:]}")
        time.sleep(0.005)


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r}  # not val/ records


def metric_rows(out: Path) -> dict[int, dict]:
    """step -> record without the timing/memory fields (which differ between runs by nature)."""
    volatile = {"step_time_s", "samples_per_s", "tokens_per_s", "tflops_per_device", "mfu", "peak_rss_gb",
                "peak_mem_gb"}
    return {r["step"]: {k: v for k, v in r.items() if k not in volatile} for r in read_jsonl(out / "metrics.jsonl")}


def tag_dir(out: Path, step: int) -> Path:
    return out / CHECKPOINT_DIR / f"step_{step:08d}"


def latest(out: Path) -> Optional[Path]:
    return read_latest(out / CHECKPOINT_DIR)


def module_state(tag: Path) -> dict[str, torch.Tensor]:
    """Model weights of a ZeRO-1/2 checkpoint tag (DeepSpeed's module state dict)."""
    return torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]


def send_signal(proc: subprocess.Popen, sig: signal.Signals) -> None:
    os.kill(proc.pid, sig)


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler installed for `sig` (the kernel's SigCgt mask, Linux)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(re.search(r"^SigCgt:\s*([0-9a-fA-F]+)", status, re.MULTILINE).group(1), 16)
    return bool(caught & (1 << (int(sig) - 1)))


def wait_for_handler(proc: subprocess.Popen, sig: signal.Signals = signal.SIGUSR1, timeout: float = DEADLINE_S) -> None:
    """Poll until `proc` catches `sig` (the training entry point installed its preemption handler)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process ended (rc {proc.returncode}) before handling {sig.name}:\n{output_of(proc)[-3000:]}")
        if catches(proc.pid, sig):
            return
        time.sleep(0.002)
    raise AssertionError(f"no {sig.name} handler after {timeout}s")
