"""A throw-away two-node SLURM cluster on loopback, for tests.

Generates its own `slurm.conf` and munge key in a private temp dir, starts `munged`,
`slurmctld` and one `slurmd -N <node>` per node (all in the foreground, as children of this
process so we hold their PIDs), waits until every node is idle, and on `stop()` cancels the
jobs it ran, then terminates exactly the daemons it started and removes the directory.

Nothing here installs anything: `scripts/install_test_deps.sh` (run by `scripts/test.sh` when the selected
tests include these, so by `.ci/run`; declined with CPT_NO_SYSTEM_PACKAGES=1) installs the Debian
packages; `missing_requirements()` says why the cluster cannot run so tests can skip.
The daemons run as root because slurmd must start job steps as the submitting user (root in CI);
each node gets one CPU so a two-node job is the most that fits, as on a real cluster.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.gloo_ranks import LAUNCHER_VARIABLES

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
#: The deadline of every wait in the SLURM tests: generous, since each wait ends as soon as its event is
#: observed; a loaded CI machine (load 5 on 2 cores) only makes the tests slower, never flaky.
DEADLINE_S = float(os.environ.get("CPT_TEST_DEADLINE_S", "900"))
TERMINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED",
}


def _find(program: str) -> str | None:
    """`shutil.which`, also looking in the sbin directories a non-login PATH may lack."""
    return shutil.which(program) or shutil.which(program, path="/usr/sbin:/sbin:/usr/local/sbin")


def missing_requirements() -> str | None:
    """A reason the cluster cannot start here, or None when it can."""
    absent = [p for p in DAEMONS + CLIENTS if _find(p) is None]
    if absent and os.environ.get("CPT_NO_SYSTEM_PACKAGES") == "1":
        return (f"SLURM/munge binaries not found: {', '.join(absent)}; CPT_NO_SYSTEM_PACKAGES=1 declined installing "
                "them (unset it and rerun scripts/test.sh as root, or run scripts/install_test_deps.sh as root)")
    if absent:
        return f"SLURM/munge binaries not found: {', '.join(absent)} (run scripts/install_test_deps.sh as root)"
    if os.geteuid() != 0:
        return "the test SLURM cluster runs slurmd as root; run the slurm tests as root (as CI does)"
    return None


def _free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class JobResult:
    job_id: str
    state: str
    exit_code: int
    restarts: int
    fields: dict[str, str]


class SlurmCluster:
    """Start with `start()`, stop with `stop()` (or use as a context manager)."""

    def __init__(self, nodes: tuple[str, ...] = ("node1", "node2"), cpus_per_node: int = 1) -> None:
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        # A short private path: the munge socket path must fit in sun_path (108 bytes), and munged
        # refuses key/socket directories that others can write.
        self.root = Path(tempfile.mkdtemp(prefix="cpt-slurm-"))
        os.chmod(self.root, 0o700)
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.sock"
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        # Stray SLURM_* variables (a test run inside an allocation) would leak into our jobs.
        for key in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if key != "SLURM_CONF":
                del self.env[key]
        # So would torch launcher variables (an in-process run of the test session exports them).
        for key in LAUNCHER_VARIABLES:
            self.env.pop(key, None)
        self.env["PATH"] = self.env.get("PATH", "") + ":/usr/sbin:/sbin"

    # ------------------------------------------------------------------ set-up
    def _write_munge_key(self) -> Path:
        mdir = self.root / "munge"
        mdir.mkdir(mode=0o700)
        key = mdir / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        return key

    def _write_conf(self) -> None:
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        host = socket.gethostname().split(".")[0]
        r = self.root
        for sub in ["state", *[f"spool/{n}" for n in self.nodes], "log"]:
            (r / sub).mkdir(parents=True, exist_ok=True)
        lines = [
            "ClusterName=cpttest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also sets how long a requeued job waits before it may start again (120 s by
            # default); a short one keeps the preemption test quick.
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroups in containers/CI: plain process-group tracking, no task binding.
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2,bf_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            "KillWait=10",
            "MinJobAge=600",
            "JobRequeue=1",
            "PlugStackConfig=/dev/null",
        ]
        for name, port in zip(self.nodes, node_ports):
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={self.cpus_per_node} RealMemory=4000 State=UNKNOWN"
            )
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "wb")
        self._logs.append(log)
        # Own session: a Ctrl-C on pytest must not reach the daemons before stop() runs.
        self._procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def start(self, timeout_s: float = DEADLINE_S) -> "SlurmCluster":
        reason = missing_requirements()
        if reason:
            raise RuntimeError(reason)
        try:
            key = self._write_munge_key()
            self._write_conf()
            m = self.root / "munge"
            self._spawn("munged", [
                _find("munged"), "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed", f"--log-file={self.root}/log/munged.log",
            ])
            self._wait(lambda: self.munge_socket.exists(), timeout_s, "munged socket")
            self._spawn("slurmctld", [_find("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._wait(lambda: self._cmd(["scontrol", "ping"], check=False).returncode == 0, timeout_s, "slurmctld")
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", [_find("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
            self._wait(self._all_idle, timeout_s, "nodes idle")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.3)
        raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}\n{self.logs()}")

    def _all_idle(self) -> bool:
        out = self._cmd(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.nodes)

    # ------------------------------------------------------------------ use
    def _cmd(self, argv: list[str], check: bool = True, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster (SLURM_CONF set)."""
        return self._cmd(argv, **kw)

    def sbatch(self, args: list[str], env: dict[str, str] | None = None) -> str:
        """Submit (`sbatch --parsable ARGS`) and return the job id."""
        run_env = dict(self.env, **(env or {}))
        out = subprocess.run(["sbatch", "--parsable", *args], env=run_env, capture_output=True, text=True,
                             timeout=DEADLINE_S)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed ({out.returncode}): {out.stderr}")
        return out.stdout.strip().split(";")[0]

    def job_fields(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` as a dict (first record; array jobs give one per task)."""
        out = self._cmd(["scontrol", "show", "job", "-o", job_id], check=False).stdout.strip().splitlines()
        if not out:
            return {}
        return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", out[0]))

    def wait_job(self, job_id: str, timeout_s: float = DEADLINE_S, poll_s: float = 0.5) -> JobResult:
        """Block until the job reaches a terminal state; raise TimeoutError (after cancelling) if not."""
        deadline = time.monotonic() + timeout_s
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in TERMINAL_STATES:
                code = int(fields.get("ExitCode", "0:0").split(":")[0])
                return JobResult(job_id, fields["JobState"], code, int(fields.get("Restarts", "0")), fields)
            time.sleep(poll_s)
        self._cmd(["scancel", job_id], check=False)
        raise TimeoutError(f"job {job_id} not finished after {timeout_s}s: {fields}\n{self.logs()}")

    def wait_state(self, job_id: str, states: set[str], timeout_s: float = DEADLINE_S) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} never reached {states}: {self.job_fields(job_id)}")

    def logs(self, tail: int = 40) -> str:
        """The tail of every daemon log (for failure messages)."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            try:
                lines = path.read_text(errors="replace").splitlines()[-tail:]
            except OSError:
                continue
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # ------------------------------------------------------------------ tear-down
    def stop(self) -> None:
        """Cancel our jobs, then stop exactly the daemons this object started, and clean up."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            self._cmd(["scancel", "--full", "--quiet", "--partition=debug"], check=False)
            # Let slurmstepd finish killing job processes before their slurmd goes away.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                q = self._cmd(["squeue", "-h", "-o", "%i"], check=False)
                if q.returncode != 0 or not q.stdout.strip():
                    break
                time.sleep(0.5)
        # Reverse start order: slurmds, then the controller, then munged.
        for name in reversed(list(self._procs)):
            proc = self._procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self._procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
        if os.environ.get("CPT_KEEP_SLURM_DIR") != "1":
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
