"""Activation checkpointing saves what it should: on the CPU, one training step of a 4-layer encoder of each
family under torch.profiler's memory profiling, with checkpointing off, every 2nd layer and every layer:
the same loss (the same step, recomputed or not) and a peak allocation that falls as more layers are
checkpointed (the committed measurement at 24 layers: benchmarks/results/activation_checkpointing.md,
made by the retired CPU script; its model is `benchmarks.memory.activation_checkpointing.build_model`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.memory.activation_checkpointing import build_model, micro_batch


def profiled_peak_bytes(step, tmp: Path) -> int:
    """Largest `Total Allocated` of the CPU `[memory]` events while `step()` runs under the profiler: the
    peak of the bytes allocated on top of those that existed when profiling started."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    prof.export_chrome_trace(str(tmp / "trace.json"))
    events = json.loads((tmp / "trace.json").read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0]
    assert totals, "the profiler recorded no CPU memory events"
    return int(max(totals))


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_checkpointing_lowers_the_peak_and_keeps_the_loss(family: str, tmp_path: Path) -> None:
    peaks, losses = {}, {}
    for setting in ("none", "2", "all"):
        model = build_model(family, 4, 64, 128, setting, window=32).train()
        batch = micro_batch(model, 2, 64, 128)

        def step() -> None:
            torch.manual_seed(0)  # the same dropout masks for every setting
            loss, _ = model(batch, sampling_seed=1)
            loss.backward()
            losses[setting] = float(loss.detach())

        step()  # unprofiled first: the gradient buffers exist, the profiled peak is the step's activations
        peaks[setting] = profiled_peak_bytes(step, tmp_path)
    assert losses["none"] == losses["2"] == losses["all"]
    assert peaks["all"] < peaks["2"] < peaks["none"]
