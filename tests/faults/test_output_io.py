"""Class 4, I/O failures: a full disk at the first save (DeepSpeed's copy of `zero_to_fp32.py`) or
when a later save creates its directories, an output directory that is a file or read-only. Each ends with one line naming the path and exit 4
(`EXIT_SAVE_FAILED`, the code of every failed save), never a traceback; nothing partial is left
as `latest`, and once the cause is gone the run goes on."""
from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

import deepspeed.runtime.engine as ds_engine
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from pipeline.train.cli import EXIT_SAVE_FAILED
from tests.faults.faults import error_line
from tests.train.runs import latest, losses, run_inprocess, tag_dir

STEPS = ["train.total_steps=4", "train.checkpoint_every=2"]


def test_full_disk_at_the_first_save(monkeypatch, tiny_shards_dir, tmp_path, capsys):
    out = tmp_path / "run"
    copy = ds_engine.copyfile

    def full(src, dst, *args, **kwargs):
        if os.path.basename(dst) == "zero_to_fp32.py":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dst)
        return copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(ds_engine, "copyfile", full)
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS) == EXIT_SAVE_FAILED
    message = error_line(capsys.readouterr().err)
    assert message.startswith(f"no space left on device: {out / 'checkpoints' / 'zero_to_fp32.py'}. Checkpoint "
                              "step_00000002 was not written"), message
    assert "checkpoints/latest does not exist yet" in message
    assert latest(out) is None and not tag_dir(out, 2).exists()
    monkeypatch.setattr(ds_engine, "copyfile", copy)  # space freed
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS) == 0 and latest(out) == tag_dir(out, 4)


def test_full_disk_when_a_later_save_creates_its_directories(monkeypatch, tiny_shards_dir, tmp_path, capsys):
    """DeepSpeed creates the checkpoint directories through its checkpoint engine (rank 0 alone, then a
    barrier): a failure there is one line and exit 4 too; step 2's checkpoint stays `latest`."""
    out = tmp_path / "run"
    makedirs = CheckpointEngine.makedirs
    root_calls = []

    def full(self, path, exist_ok=False):
        root_calls.extend([path] if os.path.abspath(path) == str(out / "checkpoints") else [])
        if len(root_calls) >= 2:  # the second save's first directory
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return makedirs(self, path, exist_ok=exist_ok)

    monkeypatch.setattr(CheckpointEngine, "makedirs", full)
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS) == EXIT_SAVE_FAILED
    message = error_line(capsys.readouterr().err)
    assert message.startswith("no space left on device: ") and "Checkpoint step_00000004 was not written" in message, \
        message
    assert latest(out) == tag_dir(out, 2)
    monkeypatch.setattr(CheckpointEngine, "makedirs", makedirs)  # space freed
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS) == 0 and latest(out) == tag_dir(out, 4)


def test_output_dir_that_is_a_file(tiny_shards_dir, tmp_path, capsys):
    out = tmp_path / "run"
    out.write_text("a file")
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS) == EXIT_SAVE_FAILED
    assert error_line(capsys.readouterr().err) == (f"train.output_dir={out}: {out} exists and is not a directory; "
                                                   "choose another train.output_dir (or move that file away)")
    assert out.read_text() == "a file"


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only directory: a read-only tmpfs as root (root ignores permission bits), else mode 0555."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_read_only_output_dir(read_only_dir, tiny_shards_dir, tmp_path, capsys):
    out = read_only_dir / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS) == EXIT_SAVE_FAILED
    assert error_line(capsys.readouterr().err) == (f"train.output_dir={out}: cannot write in {out} (read-only file "
                                                   "system); make it writable or choose another train.output_dir")
    other = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, other, *STEPS) == 0 and max(losses(other)) == 4


def test_bad_lines_in_metrics_jsonl_do_not_stop_a_resume(small_run, tmp_path, caplog):
    """A bare number and invalid UTF-8 in metrics.jsonl (hand edits, a disk error) made the resume
    raise: resume does not depend on the metrics file, so such lines are dropped and reported, the
    run resumes to its end, and every record it had is kept (issue 49)."""
    import logging
    import shutil

    from pipeline.train.metrics import read_jsonl

    run = Path(shutil.copytree(small_run, tmp_path / "run"))
    metrics = run / "metrics.jsonl"
    good = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(good[0] + b"5\n" + good[1] + b"\xff\xfe not utf-8\n" + b"".join(good[2:]))
    shards = Path(json.loads((latest(run) / "pipeline_meta.json").read_text())["config"]["data"]["shards_dir"])
    with caplog.at_level(logging.WARNING, logger="pipeline.train.metrics"):
        assert run_inprocess("tiny-mlm", shards, run, "train.total_steps=6", "train.checkpoint_every=2",
                             "train.keep_last=5", "train.allow_config_change=true") == 0
    warned = [r.getMessage() for r in caplog.records if "not metrics records" in r.getMessage()]
    assert len(warned) == 1 and "line 2: not a JSON object (5); line 4: invalid UTF-8 (byte 1)" in warned[0]
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3, 4, 5, 6]
