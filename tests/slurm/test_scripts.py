"""The SLURM scripts' own logic, without a cluster (bash only): one `--signal` lead time everywhere,
how the launch command is built (mpirun found beside the interpreter, pyxis container flags, a
bounded wait for the other ranks), and how the job log explains exit codes and errors."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash") or "/bin/bash"


def _bash(script: str, **env: str) -> subprocess.CompletedProcess:
    """Run `script` after sourcing slurm/common.sh (PYTHON = this interpreter unless given)."""
    full_env = {"PATH": "/usr/bin:/bin", "CPT_ROOT": str(REPO), "PYTHON": sys.executable, "HOME": os.environ.get("HOME", "/")}
    full_env.update(env)
    return subprocess.run([BASH, "-c", f"source {REPO}/slurm/common.sh\n{script}"], env=full_env,
                          capture_output=True, text=True, timeout=120)


def test_one_signal_lead_time_everywhere():
    """The batch script's --signal lead time is the one the documentation states."""
    script = (REPO / "slurm" / "pretrain.sbatch").read_text()
    (lead,) = re.findall(r"^#SBATCH --signal=B:USR1@(\d+)$", script, re.MULTILINE)
    stated = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "slurm").iterdir())]:
        stated += [(path.name, n) for n in re.findall(r"USR1@(\d+)", path.read_text())]
    assert stated and {n for _, n in stated} == {lead}, stated
    assert f"{lead} s before the time limit" in " ".join((REPO / "docs" / "slurm.md").read_text().split())


def test_mpirun_is_found_beside_the_interpreter():
    beside = Path(sys.executable).parent / "mpirun"
    if not beside.is_file():
        pytest.skip(f"no mpirun beside {sys.executable} (pip install mpich)")
    # PATH without the interpreter's bin/: a virtual environment used through its interpreter.
    out = _bash('LAUNCHER=mpirun SLURM_NTASKS=2 set_launch_cmd /tmp/logs python -m pipeline.train\n'
                'printf "%s\\n" "${LAUNCH_CMD[@]}"')
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == [str(beside), "-np", "2"]


def test_a_missing_mpirun_says_what_to_install(tmp_path):
    python = tmp_path / "env" / "bin" / "python"  # an interpreter with no mpirun beside it
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    out = _bash("LAUNCHER=mpirun SLURM_NTASKS=2 set_launch_cmd /tmp/logs true", PYTHON=str(python), PATH=str(tmp_path))
    assert out.returncode == 2
    assert f"no mpirun beside PYTHON={python} ({python.parent}/) nor on PATH" in out.stderr
    assert f"{python} -m pip install mpich" in out.stderr and "MPIRUN=/path/to/mpirun" in out.stderr


def test_srun_gets_a_bounded_wait_and_the_container_flags():
    out = _bash('set_launch_cmd /tmp/logs python -m pipeline.train\nprintf "%s\\n" "${LAUNCH_CMD[@]}"',
                CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:24.05-py3", CONTAINER_MOUNTS="/scratch:/scratch,/home:/home",
                CONTAINER_ARGS="--container-workdir=/scratch/repo --no-container-mount-home", EXIT_WAIT="90")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:7] == [
        "srun", "--kill-on-bad-exit=0", "--wait=90", "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
        "--container-mounts=/scratch:/scratch,/home:/home", "--container-workdir=/scratch/repo",
        "--no-container-mount-home"]
    plain = _bash('set_launch_cmd /tmp/logs true\nprintf "%s\\n" "${LAUNCH_CMD[@]}"')
    assert plain.stdout.split("\n")[:4] == ["srun", "--kill-on-bad-exit=0", "--wait=120", "bash"]
    refused = _bash("LAUNCHER=mpirun set_launch_cmd /tmp/logs true", CONTAINER_IMAGE="img")
    assert refused.returncode == 2 and "use LAUNCHER=srun" in refused.stderr


def test_the_job_log_explains_each_failing_rank(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text(
        "=== 2026-01-01 00:00:00 job 7 restart 0 rank 0 host node1 ===\nerror: from an earlier run\n"
        "=== 2026-01-01 01:00:00 job 7 restart 1 rank 0 host node1 ===\n2026-01-01 INFO pipeline.train: step 1\n"
        "Traceback (most recent call last):\n  File \"loop.py\", line 3\n"
        "[rank0]: torch.distributed.DistBackendError: Timed out waiting 20000ms for recv operation\n"
        "During handling of the above exception, another exception occurred:\nValueError: later\n")
    (logs / "rank0.exit").write_text("1\n")
    (logs / "rank1.log").write_text("=== 2026-01-01 01:00:00 job 7 restart 1 rank 1 host node2 ===\n")
    (logs / "rank2.log").write_text("=== x rank 2 host node1 ===\nerror: data.shards_dir=/d: shard_00001.arrow: damaged\n")
    (logs / "rank2.exit").write_text("2\n")
    (logs / "rank3.exit").write_text("0\n")
    out = _bash(f"report_ranks {logs} 4\nfor c in 3 4 5 75 137 138 143; do echo \"$c: $(explain_exit $c)\"; done")
    assert out.stdout.splitlines() == [
        "   rank 0: exit 1 (Python error: see the traceback in the rank log): "
        "[rank0]: torch.distributed.DistBackendError: Timed out waiting 20000ms for recv operation",
        "   rank 1: exit none (no exit status: the rank's shell was killed, or never started)",
        "   rank 2: exit 2 (bad config, data or checkpoint: nothing was computed): "
        "error: data.shards_dir=/d: shard_00001.arrow: damaged",
        "3: stopped by the non-finite / divergence guard: nothing exploded was saved; the message names the last good "
        "checkpoint",
        "4: output not writable (disk full, read-only, not a directory): the previous checkpoint is still latest",
        "5: another rank died or hung: the message names it",
        "75: checkpointed for requeue after SIGTERM/SIGUSR1",
        "137: killed by SIGKILL: out of memory (OOM killer), or ended by srun after another rank exited",
        "138: killed by SIGUSR1 before its preemption handler was installed",
        "143: killed by SIGTERM (scancel, or srun ending the ranks after another one exited)",
    ]


def test_a_preempted_job_with_ranks_ended_by_a_signal_still_requeues(tmp_path):
    for name, text in {"rank0.exit": "75", "rank1.exit": "137"}.items():
        (tmp_path / name).write_text(text + "\n")
    out = _bash(f"all_ranks_stopped_with {tmp_path} 3 75; all_ranks_exited_with {tmp_path} 2 75")
    assert out.stdout.split() == ["yes", "no"]  # rank 2 left no status: killed with its shell
    (tmp_path / "rank1.exit").write_text("1\n")  # a Python error is not a preemption
    assert _bash(f"all_ranks_stopped_with {tmp_path} 2 75").stdout.strip() == "no"
