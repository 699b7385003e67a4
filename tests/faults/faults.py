"""Helpers of the fault-injection suite: a run's one-line error, and the check every fault test ends
with: the newest remaining checkpoint loads and the run resumes from it to its end."""
from __future__ import annotations

import shutil
from pathlib import Path

from pipeline.train.checkpoint.tags import verify_checkpoint
from tests.train.runs import latest, run_inprocess


def error_line(stderr: str) -> str:
    """The run's `error: ...` line (exactly one), without the prefix."""
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, f"expected one error line, got {lines!r}"
    return lines[0][len("error: "):]


def copy_shards(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def resumes_to_the_end(preset: str, shards: Path, out: Path, *extra: str) -> None:
    """The newest remaining checkpoint verifies (sizes and sha256) and a resume from it finishes."""
    newest = latest(out)
    assert newest is not None, f"{out}: no checkpoint left"
    verify_checkpoint(newest, check_hashes=True)
    assert run_inprocess(preset, shards, out, f"train.resume={newest}", *extra) == 0
