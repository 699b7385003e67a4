"""SIGTERM as a clean stop for the long, resumable study driver (`cpt-study run`, the local
executor): `kill PID` raises KeyboardInterrupt in the driver, whose handler says how to resume, while
the running training child checkpoints on its own SIGTERM. The previous handler comes back when the
driver returns, so calling a driver in process (the tests do) leaves no handler behind: a Python
handler inherited by later forked workers (`data_prep.build_shards`'s pool) would otherwise turn the
pool's SIGTERM into a KeyboardInterrupt that a worker inside C code never sees (a hung
`Pool.terminate`, seen in CI)."""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator


def _stop(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_stops() -> Iterator[None]:
    """Within the block SIGTERM raises KeyboardInterrupt; the previous handler is restored after it."""
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
