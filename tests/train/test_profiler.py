"""`train.profile`: a tiny run profiling steps 2-3 writes a Chrome trace (JSON with both steps'
`ProfilerStep#N` ranges and the operators inside them) and a table of the top operators by self
time, and kineto's USDT lines stay out of stderr (a native line that is not theirs still gets through); without it nothing is written and the profiler is never started; a window outside the run is
refused naming the field, before compute."""
from __future__ import annotations

import json

import pytest

from pipeline.config.checks import ConfigError
from pipeline.train.run_config import load_config
from pipeline.train.metrics import read_jsonl
from pipeline.train.profiler import PROFILE_DIR, StepProfiler
from tests.train.runs import run_inprocess

RUN = ["train.total_steps=4", "train.checkpoint_every=4"]


def test_a_profiled_run_writes_a_trace_and_a_top_operator_table(tiny_shards_dir, tmp_path, capfd):
    assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path, *RUN, "train.profile={start: 2, steps: 2}") == 0
    err = capfd.readouterr().err  # file descriptor 2 itself: what kineto's native code writes
    assert "USDT:" not in err and "profiler_start" not in err  # issue 58: they landed in the run's log
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]  # the run itself is whole
    files = sorted(p.name for p in (tmp_path / PROFILE_DIR).iterdir())
    assert files == ["rank0.steps_2-3.pt.trace.json", "rank0.steps_2-3.top_ops.md"]  # no temporary left behind
    events = json.loads((tmp_path / PROFILE_DIR / files[0]).read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names and "ProfilerStep#4" not in names
    assert any(n.startswith("aten::addmm") or n.startswith("aten::mm") for n in names)  # the layers' GEMMs
    assert any(n.startswith("autograd::engine::evaluate_function") for n in names)  # the backward is in it
    table = (tmp_path / PROFILE_DIR / files[1]).read_text()
    assert "Top operators, steps 2-3" in table and "Self CPU" in table and "aten::" in table


def test_profile_off_writes_nothing_and_starts_nothing(tiny_shards_dir, tmp_path, monkeypatch):
    import torch.profiler

    def refuse(*args, **kwargs):
        raise AssertionError("torch.profiler started with train.profile off")

    monkeypatch.setattr(torch.profiler, "profile", refuse)
    assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path, "train.total_steps=3", "train.checkpoint_every=3") == 0
    assert not (tmp_path / PROFILE_DIR).exists()


def test_only_rank_0_profiles():
    cfg = load_config("tiny-mlm", ["train.profile.start=2", "train.output_dir=/nonexistent"])
    assert StepProfiler.for_run(cfg, 0).enabled and not StepProfiler.for_run(cfg, 1).enabled
    assert not StepProfiler.for_run(load_config("tiny-mlm"), 0).enabled


@pytest.mark.parametrize("overrides, message", [
    (["train.profile.start=-1"], r"train.profile.start=-1: the first profiled step is 1 or later"),
    (["train.profile.start=3", "train.profile.steps=0"], r"train.profile.steps=0: profile at least 1 step"),
    (["train.profile={start: 19, steps: 3}"], r"train.profile: steps 19-21 end after train.total_steps=20"),
])
def test_a_window_outside_the_run_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny-mlm", overrides)


def test_refused_before_compute_with_exit_2(tiny_shards_dir, tmp_path, capsys):
    assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path, *RUN, "train.profile.start=4") == 2
    assert "train.profile: steps 4-6 end after train.total_steps=4" in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / PROFILE_DIR).exists()


def test_the_filter_drops_kineto_lines_and_keeps_the_rest(capfd):
    import os

    from pipeline.train.profiler import native_stderr_filtered

    with native_stderr_filtered():
        os.write(2, b"USDT:2026-11-28 18:37:46 8347:8347 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"STAGE:2026-11-28 18:38:03 8687:8687 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n")
        os.write(2, b"[W kineto] a real warning\n")
    assert capfd.readouterr().err == "[W kineto] a real warning\n"


def test_a_window_before_the_resumed_step_says_nothing_will_be_profiled(tiny_shards_dir, tmp_path, caplog):
    """Issue 57: a run resumed after its window profiles nothing, and says so in one line (before, silence);
    one resumed inside it says which steps it profiles."""
    import logging

    assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path, "train.total_steps=6", "train.checkpoint_every=4") == 0
    resume = ["train.total_steps=6", "train.checkpoint_every=4", f"train.resume={tmp_path}/checkpoints/step_00000004"]
    with caplog.at_level(logging.INFO):
        assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path, *resume, "train.profile={start: 2, steps: 2}") == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train.profile")]
    assert lines == ["train.profile: steps 2-3 were trained before the resumed step 4: nothing will be profiled "
                     "(train.profile.start=N with N > 4 profiles steps of this run)"], lines
    assert not (tmp_path / PROFILE_DIR).exists()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path, *resume, "train.profile={start: 4, steps: 2}") == 0
    assert "train.profile: steps 4-5 asked, resumed at step 4: steps 5-5 will be profiled" in caplog.text
    assert sorted(p.name for p in (tmp_path / PROFILE_DIR).iterdir())[0] == "rank0.steps_5-5.pt.trace.json"
