"""Preemption: SIGTERM / SIGUSR1 become a flag that the loop reads at the next step boundary; it then
writes a checkpoint and exits with `REQUEUE_EXIT_CODE` (75), which job scripts read as "requeue"."""
from __future__ import annotations

import logging
import signal
from typing import Any, Callable

log = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 75


class PreemptionHandler:
    """Context manager: SIGTERM / SIGUSR1 set `requested` instead of killing the process."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, Callable | int | None] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> "PreemptionHandler":
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay with their current owner
                log.warning("cannot install a %s handler outside the main thread", signal.Signals(sig).name)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
