"""Test-only (on PYTHONPATH only in the SLURM tests that want it): lets a test hold processes of its
job at an exact moment, deliver a signal there, and release them, instead of guessing with sleeps.

CPT_TEST_PAUSE_DIR   the test's directory for the files below; without it this module does nothing
CPT_TEST_PAUSE       rules `NAME@WHEN@ARGV;...`: WHEN is `import:MODULE` (when MODULE is first
                     imported) or `exit` (at interpreter exit, from atexit); ARGV a substring of the
                     process's command line. Only processes inside a SLURM job (SLURM_JOB_ID) match.
A matching process holds only while `DIR/arm-NAME` exists: it writes `DIR/paused-NAME-HOST-PID`
(JSON: pid, parent pid, argv) and waits until `DIR/release-NAME` exists.
"""
import atexit
import importlib.abc
import json
import os
import socket
import sys
import time
from pathlib import Path


def _hold(directory: Path, name: str) -> None:
    if not (directory / f"arm-{name}").exists():
        return
    record = {"pid": os.getpid(), "ppid": os.getppid(), "argv": getattr(sys, "orig_argv", sys.argv)}
    (directory / f"paused-{name}-{socket.gethostname()}-{os.getpid()}").write_text(json.dumps(record))
    while not (directory / f"release-{name}").exists():  # the test releases us once its signal is delivered
        time.sleep(0.05)


class _HoldOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, directory: Path, name: str, module: str) -> None:
        self.directory, self.name, self.module, self.done = directory, name, module, False

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.module and not self.done:
            self.done = True
            _hold(self.directory, self.name)
        return None


def _install() -> None:
    directory = os.environ.get("CPT_TEST_PAUSE_DIR")
    if not directory or "SLURM_JOB_ID" not in os.environ:
        return
    argv = " ".join(sys.argv)  # at sitecustomize time: the interpreter's own argv ("-m"/"-c" not yet resolved)
    for rule in filter(None, os.environ.get("CPT_TEST_PAUSE", "").split(";")):
        name, when, pattern = rule.split("@", 2)
        if pattern not in argv and pattern not in " ".join(getattr(sys, "orig_argv", [])):
            continue
        if when == "exit":
            atexit.register(_hold, Path(directory), name)
        elif when.startswith("import:"):
            sys.meta_path.insert(0, _HoldOnImport(Path(directory), name, when.split(":", 1)[1]))


_install()
