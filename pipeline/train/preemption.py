"""Preemption: SIGTERM / SIGUSR1 become a flag that the training loop reads; a run never dies of them.

What the signal does depends on when it arrives (`pipeline.train.loop.Run.loop` acts on the flag):

| arrives                                            | the run                                             |
| -------------------------------------------------- | --------------------------------------------------- |
| during start-up (imports, checks, model, engine, resume) | every rank exits with `REQUEUE_EXIT_CODE` (75) before the first step; nothing new was computed, `latest` is still the resume point |
| during the steps                                   | checkpoint at the next step boundary on every rank, then exit 75 |
| after the last step (final checkpoint, teardown)   | ignored: the run is complete and exits 0 (so an `afterok` job chain goes on) |

A signal that reaches only some ranks is shared through the loop's per-step all-reduce (and one
all-reduce before the first step), so every rank makes the same decision.

`python -m pipeline.train` (`pipeline/train/__main__.py`) installs the process handler first
thing, with the standard library only (importing torch and DeepSpeed takes seconds), keeps it
until `main` returns, then ignores both signals: the exit code is decided, and CPython's own
teardown restores default handlers before the process ends, which would otherwise turn a late
signal into "killed by SIGUSR1" (exit 138). In-process callers of `pipeline.train.cli.train`
get a handler for the duration of the run (`preemption_scope`).

This module imports nothing but the standard library (it runs before torch is imported).
"""
from __future__ import annotations

import contextlib
import logging
import signal
from typing import Any, Callable, Iterator, Optional

log = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    """SIGTERM / SIGUSR1 set `requested` (and `signal_name`) instead of killing the process."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, Callable | int | None] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def install(self) -> "PreemptionHandler":
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay with their current owner
                log.warning("cannot install a %s handler outside the main thread", signal.Signals(sig).name)
        return self

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.restore()


_process_handler: Optional[PreemptionHandler] = None


def install_process_handler() -> PreemptionHandler:
    """The process-wide handler of a training process, installed once and kept until exit."""
    global _process_handler
    if _process_handler is None:
        _process_handler = PreemptionHandler().install()
    return _process_handler


def ignore_signals() -> None:
    """Ignore SIGTERM / SIGUSR1 from now on (the process is about to exit with its decided code)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def preemption_scope() -> Iterator[PreemptionHandler]:
    """The process handler if the entry point installed one (it stays after the run), else a
    handler installed for the duration of the run and restored afterwards."""
    if _process_handler is not None:
        yield _process_handler
        return
    with PreemptionHandler() as handler:
        yield handler
