"""A full disk while a checkpoint is saved: "no space left on device: PATH" on every rank (exit 4), the
partial tag removed, the previous checkpoint still `latest`, and a resume after freeing space ends
exactly like an uninterrupted run.

Two ways: ENOSPC injected into DeepSpeed's checkpoint writer, the layer below our
`pipeline.train.checkpoint.writes` (fast, any machine, one rank); and a real full file system: a
small tmpfs mounted in the test's own temp directory (root only; unmounted afterwards), where
torch reports the full disk without an errno, on two ranks that must agree."""
from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from pipeline.train.cli import EXIT_SAVE_FAILED
from tests.train.runs import latest, metric_rows, output_of, run_inprocess, start_ranks, tag_dir, wait_all

STEPS = ["train.total_steps=6", "train.checkpoint_every=2", "train.keep_last=5"]


def test_enospc_injected_into_the_checkpoint_writer(monkeypatch, tiny_shards_dir, tmp_path, capsys):
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, reference, *STEPS) == 0

    save = TorchCheckpointEngine.save
    victim = tag_dir(run, 4) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"

    def full_disk(self, state_dict, path):
        if Path(path) == victim:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return save(self, state_dict, path)

    monkeypatch.setattr(TorchCheckpointEngine, "save", full_disk)
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *STEPS) == EXIT_SAVE_FAILED
    err = capsys.readouterr().err
    assert f"error: no space left on device: {victim}. Checkpoint step_00000004 was not written" in err
    assert "checkpoints/latest still names step_00000002" in err
    assert latest(run) == tag_dir(run, 2) and not tag_dir(run, 4).exists()

    monkeypatch.setattr(TorchCheckpointEngine, "save", save)  # space freed
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *STEPS) == 0
    assert metric_rows(run) == metric_rows(reference)


def _tag_bytes(tag: Path) -> int:
    return sum(p.stat().st_size for p in tag.rglob("*") if p.is_file())


@pytest.fixture
def small_tmpfs(tmp_path):
    """`mount(size_bytes) -> Path`: a tmpfs of that size inside tmp_path; `.remount(size)` grows it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mounted = []

    def mount(size: int, options: str = "") -> Path:
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"{options}size={size}", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
        mounted[:] = [mountpoint]
        return mountpoint

    mount.remount = lambda size: mount(size, "remount,")
    yield mount
    if mounted:
        if subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], check=True)


@pytest.mark.timeout(1800)  # three 2-rank runs on a shared CI machine
def test_a_real_full_file_system_on_two_ranks(small_tmpfs, tiny_shards_dir, tmp_path):
    steps = [*STEPS, "deepspeed.config=zero2"]
    reference = tmp_path / "reference"
    assert wait_all(procs := start_ranks("tiny-mlm", tiny_shards_dir, reference, *steps)) == [0, 0], \
        output_of(procs[0])[-3000:]
    one_checkpoint = _tag_bytes(tag_dir(reference, 2))
    # Room for the first checkpoint and the metrics, not for a second checkpoint.
    mnt = small_tmpfs(int(one_checkpoint * 1.5) // 4096 * 4096)
    run = mnt / "run"
    procs = start_ranks("tiny-mlm", tiny_shards_dir, run, *steps)
    codes = wait_all(procs)
    logs = [output_of(p) for p in procs]
    assert codes == [EXIT_SAVE_FAILED] * 2, logs[0][-3000:] + logs[1][-3000:]
    for log in logs:  # the same message on both ranks, naming a file of the failed tag
        assert f"error: no space left on device: {tag_dir(run, 4)}/" in log
        assert "Checkpoint step_00000004 was not written (its partial files were removed); checkpoints/latest " \
               "still names step_00000002" in log
    assert latest(run) == tag_dir(run, 2) and not tag_dir(run, 4).exists()
    assert "Traceback" not in logs[0] + logs[1]

    small_tmpfs.remount(64 << 20)  # space freed: the resume ends exactly like the uninterrupted run
    assert wait_all(procs := start_ranks("tiny-mlm", tiny_shards_dir, run, *steps)) == [0, 0], \
        output_of(procs[0])[-3000:]
    assert metric_rows(run) == metric_rows(reference)
