"""One writer per run directory: the lock a training run holds on `train.output_dir` for its lifetime.

Two runs on one directory (a job submitted twice, a requeue overlapping its predecessor) prune each
other's saves in progress and interleave `metrics.jsonl`. So before any compute the run's rank 0
takes an exclusive lock on `OUTPUT_DIR/run.lock` and holds it until `train` returns; a second run
refuses with one line naming the holder (exit 2, `ConfigError`).

* The lock is a POSIX record lock (`fcntl.lockf`, `F_SETLK`): the kernel drops it when the process
  ends, however it ends (`kill -9` included), so a dead run never leaves a stale lock behind.
  Unlike `flock`, a record lock is not inherited by `fork`: a killed rank's lingering DataLoader
  worker cannot keep it. On NFS it goes through the NFS lock protocol (NFSv4 natively), so ranks
  and runs on other machines see it too.
* The lock file records the holder: host, PID, SLURM job id (and step), start time. It is removed
  when the run releases the lock; one left by a killed run is taken over by the next run. (The
  holder reads it only through the locked descriptor: closing any other descriptor of the file
  would drop the process's record locks, a POSIX rule.)
* A requeue waits for its predecessor: when the holder is the same SLURM job (a requeued job keeps
  its id) or a process of this host that has already ended (its lock is about to go), the run
  waits up to `CPT_RUN_LOCK_WAIT_S` seconds (default 120, the same as `EXIT_WAIT`) for the lock
  before refusing. `slurm/pretrain.sbatch` requeues only after every rank has exited and
  `pipeline.launch_requeue` returns only after torchrun's workers have, so there the successor
  always finds the lock free; the wait covers a scheduler that starts the next job while the
  previous one is still tearing down.
* Filesystems where record locks are not available (`ENOLCK`, `ENOSYS`, `EOPNOTSUPP`: an NFS mount
  without a lock daemon, Lustre mounted `-o noflock`): the file's existence is the lock. It cannot
  die with its process, so a run killed there leaves it behind; the next run takes it over when the
  recorded holder is a process of its own host that has ended, and otherwise refuses, naming the
  holder and how to break it: once that run is known to be gone, delete `OUTPUT_DIR/run.lock`
  (docs/guarantees.md, "two runs on one directory").

* A lock file deleted while its run holds it (by hand, or by a tool that cleans the directory) lets a
  second run lock a new file of the same name: two writers. So before every checkpoint the holder
  checks that `run.lock` is still the file it locked (`check_still_held`: same device and inode, a
  stat, never an open, which could drop the record lock); if not, every rank stops with exit 4
  (`RunLockLost`) naming what happened, before writing anything more.

Only the global rank 0 locks: the ranks of one run share the directory. The other ranks of a run
refused here are ended by their launcher when rank 0 exits (torchrun, `srun` within `EXIT_WAIT`).
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from pipeline.config.checks import ConfigError
from pipeline.distributed import first_problem
from pipeline.train.checkpoint.writes import CheckpointWriteError

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
#: Seconds a run waits for a lock held by its own predecessor (same SLURM job, or an ended process of this host).
WAIT_ENV = "CPT_RUN_LOCK_WAIT_S"
DEFAULT_WAIT_S = 120.0
#: errno values of a filesystem that does not implement record locks (then the file itself is the lock).
UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
#: errno values of a lock held by another process (`F_SETLK` reports either).
HELD = {errno.EACCES, errno.EAGAIN}

#: Locks this process holds, by resolved directory: released by `released_at_exit`.
_HELD: dict[Path, "RunLock"] = {}


class RunLockHeld(ConfigError):
    """Another run holds the run directory (exit 2, before any compute)."""


class RunLockLost(CheckpointWriteError):
    """The lock file was deleted or replaced while this run held it (exit 4, like a save that cannot be written)."""


def holder_record() -> dict[str, Any]:
    """What the lock file says about its holder."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_step_id": os.environ.get("SLURM_STEP_ID"),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def describe_holder(record: dict[str, Any]) -> str:
    """`host H, pid P, SLURM job J, since T` (the fields the record has)."""
    parts = [f"host {record.get('host', '?')}", f"pid {record.get('pid', '?')}"]
    if record.get("slurm_job_id"):
        parts.append(f"SLURM job {record['slurm_job_id']}")
    if record.get("started"):
        parts.append(f"since {record['started']}")
    return ", ".join(parts)


def _read_record(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _ended_here(record: dict[str, Any]) -> bool:
    """The recorded holder is a process of this host that no longer exists."""
    return record.get("host") == socket.gethostname() and not _pid_alive(record.get("pid"))


def _predecessor(record: dict[str, Any]) -> bool:
    """The holder is this run's own predecessor: the same SLURM job (requeued), or an ended local process."""
    job = os.environ.get("SLURM_JOB_ID")
    return bool(job and record.get("slurm_job_id") == job) or _ended_here(record)


class RunLock:
    """An exclusive lock on `directory/run.lock`, held from `acquire` until `release` or process end."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_FILE
        self.fd: Optional[int] = None
        self.os_lock = True  # False: the filesystem has no record locks; the file itself is the lock

    def _refuse(self, record: dict[str, Any], why: str = "") -> RunLockHeld:
        hint = ("; record locks are not available on this filesystem: once that run is known to have ended, "
                f"delete {self.path} to break the lock") if not self.os_lock else ""
        return RunLockHeld(f"train.output_dir={self.directory} is in use by another run ({describe_holder(record)}; "
                           f"lock file {self.path}){why}; wait for it to end or choose another train.output_dir{hint}")

    def acquire(self, wait_s: float) -> "RunLock":
        """Take the lock (waiting up to `wait_s` only for this run's own predecessor) or raise `RunLockHeld`."""
        deadline = time.monotonic() + wait_s
        while True:
            record = self._try()
            if record is None:
                return self
            if not _predecessor(record) or time.monotonic() >= deadline:
                waited = f" after waiting {wait_s:.0f} s for it to exit" if _predecessor(record) and wait_s > 0 else ""
                raise self._refuse(record, waited)
            time.sleep(0.5)

    def _try(self) -> Optional[dict[str, Any]]:
        """None when the lock is now ours; else the holder's record."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in HELD:
                return _read_record(self.path)
            if err.errno not in UNSUPPORTED:
                raise
            return self._try_without_os_lock()
        try:  # the holder released (and removed) the file between our open and our lock: lock the new one
            same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            return self._try()
        stale = self._record_of(fd)
        if stale:
            log.info("%s: taking over the lock of a run that ended without releasing it (%s)", self.path,
                     describe_holder(stale))
        self.fd = fd
        self._write(fd)
        return None

    def _try_without_os_lock(self) -> Optional[dict[str, Any]]:
        self.os_lock = False
        record = _read_record(self.path)
        if record and not _ended_here(record):
            return record
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self.fd = fd
        self._write(fd)
        log.warning("%s: no record locks on this filesystem; the lock file alone marks the run directory as in use",
                    self.path)
        return None

    @staticmethod
    def _record_of(fd: int) -> dict[str, Any]:
        """The record, read through the lock's own descriptor: closing any other descriptor of the file
        would drop this process's record locks (POSIX), so the holder never opens it a second time."""
        try:
            record = json.loads(os.pread(fd, 1 << 16, 0).decode() or "{}")
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def record(self) -> dict[str, Any]:
        """What the lock file says while this process holds it."""
        return self._record_of(self.fd) if self.fd is not None else {}

    @staticmethod
    def _write(fd: int) -> None:
        data = (json.dumps(holder_record(), sort_keys=True) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    def lost(self) -> str:
        """"" while `run.lock` is still the file this process locked (same device and inode: our open
        descriptor keeps the inode alive, so a new file never reuses it); else why not, naming the new holder."""
        if self.fd is None:
            return ""
        mine = os.fstat(self.fd)
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return (f"{self.path} was deleted while this run held it, so another run can take train.output_dir="
                    f"{self.directory} too")
        if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return ""
        other = _read_record(self.path)  # another file: reading it cannot drop our lock on ours
        held = f" ({describe_holder(other)})" if other else ""
        return (f"{self.path} was deleted while this run held it and is now another file{held}: another run writes "
                f"to train.output_dir={self.directory}")

    def release(self) -> None:
        """Remove the lock file (while still holding the lock, so no one else can have taken it) and unlock."""
        if self.fd is None:
            return
        try:
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        except OSError:  # already gone (broken by hand): nothing of ours to remove
            pass
        os.close(self.fd)  # closing drops the record lock
        self.fd = None


def hold_run_dir(directory: str | os.PathLike, rank: int) -> Optional[RunLock]:
    """Rank 0: lock `directory` (exists: `check_output_dir` made it) for this run, until
    `released_at_exit` ends; other ranks: nothing. Raises `RunLockHeld` naming the holder."""
    if rank != 0:
        return None
    path = Path(directory).resolve()
    if path in _HELD:  # record locks are per process: a nested run in this process must not pass
        raise RunLock(path)._refuse(_read_record(path / LOCK_FILE), " (this process)")
    wait_s = float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S) or 0)
    lock = RunLock(path).acquire(wait_s)
    _HELD[path] = lock
    return lock


def check_still_held(output_dir: str | os.PathLike, is_main: bool) -> None:
    """Collective, before a save: `RunLockLost` on every rank when rank 0's lock on `output_dir` is no
    longer the lock file's (`RunLock.lost`); nothing when this process holds no lock there."""
    lock = _HELD.get(Path(output_dir).resolve()) if is_main else None
    problem = first_problem(lock.lost() if lock is not None else "")
    if problem:
        raise RunLockLost(f"{problem}; stopping before saving (two writers would mix checkpoints and metrics). "
                          "Make sure only one run uses the directory, then resume")


@contextlib.contextmanager
def released_at_exit() -> Iterator[None]:
    """Release every run lock taken inside the block when it ends (a process's runs follow each other in tests)."""
    before = set(_HELD)
    try:
        yield
    finally:
        for path in [p for p in _HELD if p not in before]:
            _HELD.pop(path).release()
