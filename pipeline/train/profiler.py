"""`train.profile`: a `torch.profiler` trace of a few training steps on rank 0, and the top operators.

    train.profile: {start: 10, steps: 3}      # or train.profile.start=10 train.profile.steps=3

profiles optimizer steps 10, 11 and 12 (every micro-batch's forward, backward and `engine.step()`,
the step's all-reduce included) on rank 0 and writes, into `<output_dir>/profile/`:

* `rank0.steps_10-12.pt.trace.json`: the Chrome trace (CPU operators and, on a GPU, the CUDA
  kernels), each step a `ProfilerStep#N` range; open it in https://ui.perfetto.dev or
  `chrome://tracing`, or `tensorboard --logdir <output_dir>/profile` (the PyTorch profiler plugin
  reads `*.pt.trace.json`);
* `rank0.steps_10-12.top_ops.md`: the operators by self time (`key_averages()`; by self device time
  too on a GPU), the first place to look for a step's largest costs.

Off (`start: 0`, the default) it costs nothing: `StepProfiler.for_run` returns an instance whose
hooks return at once, and `torch.profiler` is never imported. The loop calls three hooks:
`step_begin(step)` before the step's first micro-batch, `step_end(step)` after its all-reduce (the
host has waited for the device there, so the last kernels are in the trace) and `close()` on the way
out (a run stopped inside the window still writes the steps it profiled). A run resumed inside the
window profiles its remaining steps (said in one line); one resumed after it profiles nothing, and says
so. Kineto's own tracing lines (`USDT:... profiler_start` / `profiler_stop`, printed by native code to
stderr) are dropped (`native_stderr_filtered`); any other native output of those calls still reaches stderr.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from pipeline.config.checks import ConfigError
from pipeline.io import write_atomic

log = logging.getLogger(__name__)
PROFILE_DIR = "profile"
#: rows of the top-operators table
TOP_OPS = 25


@dataclass
class ProfileConfig:
    start: int = 0
    """First profiled optimizer step (1-based); 0: off."""
    steps: int = 3
    """Number of consecutive steps profiled from `start` (the window must end by `train.total_steps`)."""

    def check(self, total_steps: int) -> None:
        """Refuse a window outside the run: start < 0, steps < 1, start + steps - 1 > `total_steps`."""
        if self.start == 0:
            return
        if self.start < 1:
            raise ConfigError(f"train.profile.start={self.start}: the first profiled step is 1 or later (0: off)")
        if self.steps < 1:
            raise ConfigError(f"train.profile.steps={self.steps}: profile at least 1 step")
        last = self.start + self.steps - 1
        if last > total_steps:
            raise ConfigError(f"train.profile: steps {self.start}-{last} end after train.total_steps={total_steps}; "
                              f"start at most {max(1, total_steps - self.steps + 1)} or profile fewer steps")


#: What kineto (torch.profiler's native tracer) prints straight to file descriptor 2 on every start and stop, e.g.
#: `USDT:2026-11-28 18:37:46 8347:8347 SyncActivityProfilerHandler.cpp:52] profiler_start`: its own tracing
#: points, nothing a user acts on; KINETO_LOG_LEVEL does not silence them.
KINETO_NOISE = re.compile(r"^(USDT|STAGE):\d{4}-\d\d-\d\d [\d:.]+ \d+:\d+ \S+\.cpp:\d+\] ")


@contextlib.contextmanager
def native_stderr_filtered(noise: re.Pattern = KINETO_NOISE) -> Iterator[None]:
    """Run the block with file descriptor 2 sent to a temporary file, then write every captured line that
    is not `noise` back to stderr (a real native warning still shows, after the block). The noise lines are
    dropped, so they never land in the run's log. Only around the profiler's start and stop: short calls."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            kept = [line for line in lines if not noise.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class StepProfiler:
    """The profiler of one run's window `[first, last]` on this rank (`for_run`); a no-op when off."""

    def __init__(self, out_dir: Optional[Path], first: int = 0, last: int = -1) -> None:
        self.out_dir, self.first, self.last = out_dir, first, last
        self._prof: Any = None  # torch.profiler.profile while the window is open
        self._range: Any = None  # the open `ProfilerStep#N` record_function
        self._steps: list[int] = []

    @classmethod
    def for_run(cls, cfg: Any, rank: int, resumed_step: int = 0) -> "StepProfiler":
        """The profiler `cfg.train.profile` asks for on `rank` (rank 0 only; off elsewhere or when unset).
        A run resumed at `resumed_step` says in one line when its window lies before that step (nothing will
        be profiled) or begins before it (only the steps after it are)."""
        profile: ProfileConfig = cfg.train.profile
        if profile.start == 0 or rank != 0:
            return cls(None)
        first, last = profile.start, profile.start + profile.steps - 1
        if last <= resumed_step:
            log.warning("train.profile: steps %d-%d were trained before the resumed step %d: nothing will be profiled "
                        "(train.profile.start=N with N > %d profiles steps of this run)", first, last, resumed_step,
                        resumed_step)
            return cls(None)
        if first <= resumed_step:
            log.info("train.profile: steps %d-%d asked, resumed at step %d: steps %d-%d will be profiled", first, last,
                     resumed_step, resumed_step + 1, last)
        return cls(Path(cfg.train.output_dir) / PROFILE_DIR, first, last)

    @property
    def enabled(self) -> bool:
        return self.out_dir is not None

    def step_begin(self, step: int) -> None:
        """Before step `step`'s first micro-batch: opens the profiler at the window's first step (or at the
        first step of a run resumed inside the window) and marks the step."""
        if self.out_dir is None or not self.first <= step <= self.last:
            return
        if self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=activities, record_shapes=True)
            with native_stderr_filtered():  # kineto's USDT line
                self._prof.start()
        self._range = torch.profiler.record_function(f"ProfilerStep#{step}")
        self._range.__enter__()
        self._steps.append(step)

    def step_end(self, step: int) -> None:
        """After step `step` (its all-reduce done): closes the step's range; at the window's last step, stops
        the profiler and writes the trace and the table."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write what was profiled (also when the run leaves the loop inside the window)."""
        if self._prof is None:
            return
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the window's last kernels belong in the trace
        prof, self._prof = self._prof, None
        with native_stderr_filtered():  # kineto's USDT line
            prof.stop()
        try:
            self._write(prof)
        except OSError as err:  # diagnostics: a full disk here must not end (or mask the end of) the run
            log.error("train.profile: could not write the profile of steps %d-%d into %s: %s", self._steps[0],
                      self._steps[-1], self.out_dir, err)

    def _write(self, prof: Any) -> None:
        assert self.out_dir is not None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = f"rank0.steps_{self._steps[0]}-{self._steps[-1]}"
        trace = self.out_dir / f"{stem}.pt.trace.json"
        tmp = trace.with_name(trace.name + ".tmp")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
        table = self.out_dir / f"{stem}.top_ops.md"
        write_atomic(table, top_ops_markdown(prof, self._steps))
        log.info("train.profile: steps %d-%d profiled: %s (open in https://ui.perfetto.dev or "
                 "`tensorboard --logdir %s`), top operators: %s", self._steps[0], self._steps[-1], trace,
                 self.out_dir, table)


def top_ops_markdown(prof: Any, steps: list[int]) -> str:
    """The operators by self CPU time (and, on a GPU, by self device time) as Markdown: `key_averages()`
    tables of `TOP_OPS` rows, totals over the profiled steps."""
    averages = prof.key_averages()
    parts = [f"# Top operators, steps {steps[0]}-{steps[-1]} (rank 0, {len(steps)} steps; totals over them)", ""]
    sorts = [("self CPU time", "self_cpu_time_total")]
    if torch.cuda.is_available():
        sorts.insert(0, ("self device time", "self_device_time_total"))
    for title, key in sorts:
        parts += [f"## By {title}", "", "```", averages.table(sort_by=key, row_limit=TOP_OPS), "```", ""]
    return "\n".join(parts)
