"""A hung rank ends the run within `train.dist_timeout_s` instead of hanging it: rank 1 is stopped
(SIGSTOP) mid-run, and rank 0 fails on its next collective once the timeout has passed, with exit 5
and one line naming rank 1 (`pipeline.distributed.lost_ranks_message`)."""
from __future__ import annotations

import signal
import time

from pipeline.train.cli import EXIT_RANK_LOST
from tests.train.runs import DEADLINE_S, output_of, start_ranks, wait_for_step

TIMEOUT_S = 20


def test_a_hung_rank_ends_the_run_after_the_distributed_timeout(tiny_shards_dir, tmp_path):
    out = tmp_path / "run"
    procs = start_ranks("tiny-mlm", tiny_shards_dir, out, "train.total_steps=500", "train.checkpoint_every=1000",
                        "deepspeed.config=zero2", f"train.dist_timeout_s={TIMEOUT_S}")
    try:
        wait_for_step(out, 2, procs[0])
        procs[1].send_signal(signal.SIGSTOP)  # alive, but never answers a collective again
        stopped = time.monotonic()
        code = procs[0].wait(timeout=DEADLINE_S)
        waited = time.monotonic() - stopped
    finally:
        procs[1].kill()  # works on a stopped process; we started it
        procs[1].wait()
    log = output_of(procs[0])
    assert code == EXIT_RANK_LOST, log[-3000:]
    assert TIMEOUT_S - 1 <= waited, f"rank 0 gave up after {waited:.0f}s, before the {TIMEOUT_S}s timeout"
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: rank 0: a collective with the other ranks failed: rank(s) [1] stopped answering"), log[-3000:]
    assert f"train.dist_timeout_s={TIMEOUT_S}s" in errors[0]
