"""`<output_dir>/run_state.json`: whether a run is running or how it ended (exit code, error line).

Nothing else in a run directory says how a run ended: `metrics.jsonl` and the checkpoints look the
same after a requeue stop (exit 75), a divergence (exit 3) and a crash. So rank 0 of the training
entry point (`pipeline.train.__main__`) writes this small record: `begin` once the output directory
is known to be writable (`state: running`, pid, host, start time), `finish` with the exit code
`main` returned and the last `error: ...` line it printed to stderr (`state: exited`). An uncaught
exception records exit 1 and its last line. Both writes are atomic (temp file + rename) and never
raise: a record that cannot be written costs a warning, never the run. `cpt-status`
(`pipeline.status`) reads it; a record still saying `running` whose process is gone (same host, no
such pid: SIGKILL, OOM killer) reads as "ended without an exit record".
"""
from __future__ import annotations

import io
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional, TextIO

from pipeline.io import write_atomic

log = logging.getLogger(__name__)

RUN_STATE_FILE = "run_state.json"
_current: Optional[Path] = None  # rank 0's run directory once `begin` ran in this process
_started: dict[str, Any] = {}


def _write(path: Path, record: dict[str, Any]) -> None:
    try:
        write_atomic(path, json.dumps(record, indent=1, sort_keys=True))
    except OSError as err:  # the run's own writes report a full or read-only disk; this one only warns
        log.warning("could not write %s (%s); cpt-status will not know this run's state", path, err)


def begin(output_dir: Path, is_main: bool, **run: Any) -> None:
    """Rank 0: record that the run is running (pid, host, start time, and `run`: e.g. `name`,
    `total_steps`, what `cpt-status` needs before the first checkpoint)."""
    global _current, _started
    if not is_main:
        return
    _current = Path(output_dir) / RUN_STATE_FILE
    _started = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time(),
                "argv": list(sys.argv), **run}
    _write(_current, {"state": "running", **_started})


def finish(code: int, error: str = "") -> None:
    """Record the exit code (and error line) of the run `begin` registered; nothing when none was."""
    global _current
    if _current is None:
        return
    _write(_current, {"state": "exited", "exit_code": int(code), "error": error, "ended_at": time.time(),
                      **_started})
    _current = None


def read(output_dir: Path) -> Optional[dict[str, Any]]:
    """The record of a run directory, or None (none written, or damaged: `read_checked` says which)."""
    return read_checked(output_dir)[0]


def read_checked(output_dir: Path) -> tuple[Optional[dict[str, Any]], str]:
    """(record, problem): the record, or None with `problem` "" when no record was written, or
    saying how the file is damaged ("not valid JSON (...)", "not a JSON object"). The writes are
    atomic (a rename), so a reader never sees a half-written record: a truncated file is damage
    (a disk fault, a hand edit), not a write in progress."""
    path = Path(output_dir) / RUN_STATE_FILE
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None, ""
    except OSError as err:
        return None, f"unreadable ({err.strerror or err})"
    except UnicodeDecodeError as err:
        return None, f"invalid UTF-8 (byte {err.start + 1})"
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        return None, f"not valid JSON ({err.msg} at character {err.pos} of {len(text)}: truncated?)"
    if not isinstance(raw, dict):
        return None, "not a JSON object"
    return raw, ""


def last_error_line(log_text: str) -> str:
    """The most telling line of a failed run's log, for a parent that ran it as a child process (the study's
    local executor, the throughput benchmark): the last `error:` line the entry point printed, else the last
    exception line (`...Error: ...`), else the last line; at most 300 characters."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:") or "Error" in ln.split(":")[0]:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


class ErrorLineTap(io.TextIOBase):
    """A stream that forwards everything to `stream` and remembers the last line starting with
    `error: ` (how the entry point reports every failure exit, `pipeline.train.loop.main`)."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream
        self.last_error = ""
        self._partial = ""

    def write(self, text: str) -> int:
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            if line.startswith("error: "):
                self.last_error = line[len("error: "):]
        self._partial = self._partial[-4096:]  # a progress bar's carriage returns never end a line
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # anything else (`buffer`, `errors`, ...) is the stream's
        return getattr(self.stream, name)
